"""The frontier view (a tab of the cache monitor): hit rate against fidelity for key width k' x guard tau on the
user's prompts, beside the nearest-neighbour bound at each tau (tools/measure.py run_frontier).

It runs in the engine thread (one of the worker's handlers, qt/lab_jobs.py); replies wait behind it. Each
finished design reports a FrontierProgress line; Stop ends the run at the next generation.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QFormLayout, QGridLayout, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QSizePolicy, QSpinBox, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from larql_desktop.qt.qt_collapse_lab import scrolling
from larql_desktop.qt.worker import EngineClient
from larql_desktop.qt.protocol import FrontierProgress, FrontierResult, RunFrontier
from larql_desktop.tools.measure import parse_sweep
from larql_desktop.qt.qt_tables import read_only_table

TAU_COLOURS = ("#7f7f7f", "#3a7bd5", "#e8871e", "#2ca02c", "#9467bd", "#d62728", "#17a398")
BOUND_COLOUR = "#d62728"
TABLE_COLUMNS = ("design", "tau", "hit rate", "greedy agree", "same text", "hit cos mean", "hit cos min")


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


class FrontierView(QWidget):
    error = Signal(str)

    def __init__(self, client: EngineClient, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.result: FrontierResult | None = None
        self._request: RunFrontier | None = None
        client.frontier_progress.connect(self._on_progress)
        client.frontier_finished.connect(self._on_finished)
        client.error.connect(self._on_error)
        client.model_loaded.connect(lambda _: self._update_enabled())

        self.prompts = QPlainTextEdit()
        self.prompts.setAccessibleName("Frontier prompts")
        self.prompts.setPlaceholderText("Prompts, one per line")
        self.prompts.setPlainText("What is the capital of France?\nTell me the capital city of France.")
        self.widths = QLineEdit("K,64,8,1")
        self.widths.setAccessibleName("Frontier key widths")
        self.widths.setToolTip("Key widths k' to sweep, comma-separated; K = all K ids (the seed)")
        self.taus = QLineEdit("off,0.999,0.995,0.99")
        self.taus.setAccessibleName("Frontier taus")
        self.taus.setToolTip("Cosine guards to sweep; off = none. The nearest-neighbour bound runs at each tau")
        self.tokens = QSpinBox(minimum=1, maximum=512, value=24)
        self.tokens.setAccessibleName("Frontier tokens")
        self.seed_hits = QCheckBox("off = seed (any entry under the key)")
        self.seed_hits.setAccessibleName("Frontier seed hits")
        self.seed_hits.setToolTip("Without a guard, serve any entry under the key (the seed's rule, for study) "
                                  "rather than only the entry's own input (the default)")
        self.run_button = QPushButton("Run")
        self.run_button.setAccessibleName("Run frontier")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop frontier")
        self.stop_button.clicked.connect(self.stop)
        self.status = QLabel("Each design runs every prompt in fresh chats sharing L2; replies wait while it runs.")
        # One or two lines, clipped rather than wrapped: a wrapping label would make the scrolling content as
        # tall as its preferred height instead of the panel's.
        self.status.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.status.setAccessibleName("Frontier status")

        form = QFormLayout()
        form.addRow("k'", self.widths)
        form.addRow("tau", self.taus)
        form.addRow("Tokens", self.tokens)
        form.addRow(self.seed_hits)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.prompts, 1)
        column.addLayout(form)
        column.addLayout(buttons)
        self.prompts.setMinimumHeight(48)

        self.plot_widget = pg.PlotWidget()
        self.plot_widget.setAccessibleName("Frontier chart")
        self.plot_widget.setBackground("#ffffff")
        self.plot = self.plot_widget.getPlotItem()
        self.plot.setMenuEnabled(False)
        self.plot.showGrid(x=True, y=True, alpha=0.25)
        self.plot.setLabel("bottom", "hit rate of decode lookups")
        self.plot.setLabel("left", "greedy agreement")
        self.plot.setTitle("Hit rate vs fidelity<br><span style='font-size:8pt'>"
                           f"<span style='color:{BOUND_COLOUR}'>&#9733;&nbsp;NN bound</span> "
                           "&#9679;&nbsp;keys (colour: tau)</span>", size="10pt")
        self.design_points = pg.ScatterPlotItem(size=9, pen=None)
        self.bound_line = self.plot.plot([], [], pen=pg.mkPen(BOUND_COLOUR, width=1.5, style=Qt.DashLine),
                                         symbol="star", symbolSize=13, symbolBrush=BOUND_COLOUR, symbolPen=None)
        self.plot.addItem(self.design_points)
        self.table = read_only_table(TABLE_COLUMNS, "Frontier table", stretch=False, row_height=20)
        # As the lab: controls | chart | table, the status lines under them; scrolling below the minimum size.
        self.plot_widget.setMinimumSize(200, 60)
        self.table.setMinimumSize(120, 60)
        controls = scrolling(left)
        controls.setFixedWidth(220)
        controls.setMinimumHeight(40)
        content = QWidget()
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scrolling(content))
        layout = QGridLayout(content)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(controls, 0, 0, 2, 1)
        layout.addWidget(self.plot_widget, 0, 1)
        layout.addWidget(self.table, 0, 2)
        layout.addWidget(self.status, 1, 1, 1, 2)
        layout.setColumnStretch(1, 3)
        layout.setColumnStretch(2, 2)
        layout.setRowStretch(0, 1)
        self._update_enabled()

    @property
    def busy(self) -> bool:
        return self._request is not None

    def request(self) -> RunFrontier:
        """Raises ValueError for input the sweep refuses."""
        prompts = tuple(line.strip() for line in self.prompts.toPlainText().splitlines() if line.strip())
        if not prompts:
            raise ValueError("give one or more prompts, one per line")
        widths = tuple(parse_sweep(self.widths.text(), "key widths", int))
        taus = tuple(parse_sweep(self.taus.text(), "taus", float))
        return RunFrontier(self.client.next_request_id(), prompts, widths, taus, self.tokens.value(),
                           self.seed_hits.isChecked())

    @Slot()
    def run(self) -> None:
        try:
            request = self.request()
        except ValueError as exc:
            self.error.emit(f"Frontier: {exc}")
            return
        self._request = request
        self.status.setText(f"Running {len(request.widths) * len(request.taus)} designs on "
                            f"{len(request.prompts)} prompts…")
        self._update_enabled()
        self.client.submit(request)

    @Slot()
    def stop(self) -> None:
        if self._request is not None:
            self._request.cancel.set()

    def _update_enabled(self) -> None:
        self.run_button.setEnabled(self.client.model is not None and not self.busy)
        self.stop_button.setEnabled(self.busy)

    @Slot(object)
    def _on_progress(self, event: FrontierProgress) -> None:
        if self._request is not None and event.request_id == self._request.request_id:
            self.status.setText(f"{event.done}/{event.total}: {event.line}")

    @Slot(object)
    def _on_finished(self, event: FrontierResult) -> None:
        if self._request is not None and event.request_id == self._request.request_id:
            self._request = None
            if event.stopped:
                self.status.setText("Stopped.")
            else:
                self.show_result(event)
            self._update_enabled()

    @Slot(object)
    def _on_error(self, report) -> None:
        if self._request is not None and report.request_id == self._request.request_id:
            self._request = None
            self.status.setText(f"Failed: {report.message}")
            self._update_enabled()

    def show_result(self, result: FrontierResult) -> None:
        self.result = result
        taus = sorted({p.tau for p in result.points}, key=lambda t: -1.0 if t is None else t)
        colour = {t: TAU_COLOURS[i % len(TAU_COLOURS)] for i, t in enumerate(taus)}
        self.design_points.setData([{"pos": (p.hit_rate, p.agreement), "brush": pg.mkBrush(colour[p.tau]),
                                     "data": p} for p in result.points])
        bounds = sorted(result.bounds, key=lambda b: b.hit_rate)
        self.bound_line.setData([b.hit_rate for b in bounds], [b.agreement for b in bounds])
        top = max([p.hit_rate for p in (*result.points, *result.bounds)], default=0.0)
        self.plot.setRange(xRange=(0, max(0.05, top * 1.1)), yRange=(0, 1.02), padding=0)
        rows = [*result.points, *result.bounds]
        self.table.setRowCount(len(rows))
        for r, p in enumerate(rows):
            cells = ("NN bound" if p.is_bound else f"k'={p.key_width}", p.tau_label,
                     _pct(p.hit_rate), _pct(p.agreement), f"{p.identical}/{p.generations}",
                     "—" if math.isnan(p.mean_cosine) else f"{p.mean_cosine:.4f}",
                     "—" if math.isnan(p.min_cosine) else f"{p.min_cosine:.4f}")
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if p.is_bound:
                    item.setForeground(pg.mkColor(BOUND_COLOUR))
                self.table.setItem(r, c, item)
        self.table.resizeColumnsToContents()
        faithful = [p for p in result.points if p.agreement >= 1.0]
        best = (f"the best design keeping every token hits {_pct(max(p.hit_rate for p in faithful))}" if faithful
                else "no design kept every token")
        bounds = ", ".join(f"tau {b.tau:g} {_pct(b.hit_rate)} ({b.identical}/{b.generations} unchanged)"
                           for b in result.bounds)
        self.status.setText(f"{result.model}, K={result.top_k}: {best};<br>nearest-neighbour bound: {bounds or 'none'}.")

    def export(self, path: str | Path) -> Path:
        if self.result is None:
            raise ValueError("run the frontier first: there is nothing to export")
        path = Path(path)
        doc = {"model": self.result.model, "top_k": self.result.top_k,
               "designs": [p.to_dict() for p in self.result.points], "bounds": [b.to_dict() for b in self.result.bounds]}
        path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        return path

