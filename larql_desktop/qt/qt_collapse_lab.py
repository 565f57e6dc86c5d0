"""The collapse lab: do the user's paraphrases reach the same cache entry? (engine/analysis/collapse.py)

Prompts (one per line), K, Run. The measurement runs in the engine thread (one of the worker's handlers, qt/lab_jobs.py),
on the numpy fp32 path (the model as its weights define it); each captured
prompt reports a CollapseProgress line, Stop ends the run before the next prompt (the previous report stays). The
result comes back as a frozen CollapseResult and is drawn per layer: cosine of the normed FFN inputs, top-K
overlap |A ∩ B| / K and the overlap two random K-subsets already have (K / F), with the K sweep beside it and a
table; exportable as JSON, CSV and PNG. Clicking a layer row shows the feature view (what the engine's cache sees
there) of the pair's prompt A or B at its last token.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (QComboBox, QFileDialog, QFormLayout, QGridLayout, QHBoxLayout, QLabel, QPlainTextEdit,
                               QPushButton, QScrollArea, QSizePolicy, QSpinBox, QSplitter, QTableWidgetItem, QVBoxLayout, QWidget)

from larql_desktop.engine.analysis.collapse import (COMPUTATION, CSV_HEADER, CollapseReport, PairReport,
                                                 report_csv_rows)
from larql_desktop.qt.protocol import (CollapseProgress, CollapseResult, CollapseStopped, ErrorReport, ModelInfo,
                                       RunCollapse)
from larql_desktop.qt.qt_feature_view import FeatureTable
from larql_desktop.qt.worker import EngineClient
from larql_desktop.qt.qt_tables import read_only_table

COSINE_COLOUR = "#3a7bd5"
OVERLAP_COLOUR = "#e8871e"
BASELINE_COLOUR = "#7f7f7f"
TABLE_COLUMNS = ("layer", "cosine", "overlap", "random K/F", "key overlap", "keys equal")


def scrolling(content: QWidget) -> QScrollArea:
    """`content` in a frameless scroll area that resizes it (a panel's minimum size is then the area's)."""
    area = QScrollArea()
    area.setWidget(content)
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.NoFrame)
    return area


def _keys(items: dict[str, str]) -> str:
    return " ".join(f"<span style='color:{c}'>&#9632;&nbsp;{n}</span>" for n, c in items.items())


class CollapseLab(QWidget):
    error = Signal(str)

    def __init__(self, client: EngineClient, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.report: CollapseReport | None = None
        self._request: RunCollapse | None = None
        self._feature_layer: int | None = None     # the layer row last clicked, for the shown report and pair
        self._report_model_current = False         # the loaded model is the one the report measured
        self._last_dir = str(Path.home())
        client.collapse_progress.connect(self._on_progress)
        client.collapse_finished.connect(self._on_finished)
        client.collapse_stopped.connect(self._on_stopped)
        client.error.connect(self._on_error)
        client.model_loaded.connect(self._on_model_loaded)
        client.busy_changed.connect(self._update_enabled)

        self.prompts = QPlainTextEdit()
        self.prompts.setAccessibleName("Collapse prompts")
        self.prompts.setPlaceholderText("One prompt per line (two or more)")
        self.prompts.setMinimumHeight(48)
        self.prompts.setPlainText("What is the capital of France?\nTell me the capital city of France.\n"
                                  "Write a haiku about autumn leaves.")
        self.top_k = QSpinBox(minimum=0, maximum=1_000_000, singleStep=64)
        self.top_k.setSpecialValueText("79% (seed)")
        self.top_k.setAccessibleName("Collapse K")
        self.pair = QComboBox()
        self.pair.setAccessibleName("Collapse pair")
        self.pair.currentIndexChanged.connect(self._draw)
        self.run_button = QPushButton("Run")
        self.run_button.setAccessibleName("Run collapse")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop collapse")
        self.stop_button.clicked.connect(self.stop)
        self.export_json_button = QPushButton("JSON…")
        self.export_csv_button = QPushButton("CSV…")
        self.export_png_button = QPushButton("PNG…")
        for button, kind in ((self.export_json_button, "json"), (self.export_csv_button, "csv"),
                             (self.export_png_button, "png")):
            button.setAccessibleName(f"Export collapse {kind.upper()}")
            button.clicked.connect(lambda _=False, k=kind: self._on_export(k))
        self.status = QLabel("Prompts are compared at their last token, as the chat renders them.")
        # One or two lines, clipped rather than wrapped: a wrapping label would make the scrolling content as
        # tall as its preferred height instead of the panel's.
        self.status.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.status.setAccessibleName("Collapse status")

        form = QFormLayout()
        form.addRow("K", self.top_k)
        form.addRow("Pair", self.pair)
        exports = QHBoxLayout()
        for b in (self.export_json_button, self.export_csv_button, self.export_png_button):
            exports.addWidget(b)
        left = QWidget()
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(QLabel("Prompts"))
        column.addWidget(self.prompts, 1)
        column.addLayout(form)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        column.addLayout(buttons)
        column.addLayout(exports)

        self.charts = pg.GraphicsLayoutWidget()
        self.charts.setAccessibleName("Collapse charts")
        self.charts.setBackground("#ffffff")
        self.layer_plot = self.charts.addPlot(row=0, col=0)
        self.layer_plot.setTitle("Per layer<br><span style='font-size:8pt'>"
                                 + _keys({"cosine": COSINE_COLOUR, "top-K overlap": OVERLAP_COLOUR,
                                          "random K/F": BASELINE_COLOUR}) + "</span>", size="10pt")
        self.layer_plot.setLabel("bottom", "layer")
        self.layer_plot.showGrid(x=True, y=True, alpha=0.25)
        self.layer_plot.setMenuEnabled(False)
        self.cosine_line = self.layer_plot.plot([], [], pen=pg.mkPen(COSINE_COLOUR, width=2), symbol="o",
                                                symbolSize=4, symbolBrush=COSINE_COLOUR, symbolPen=None)
        self.overlap_line = self.layer_plot.plot([], [], pen=pg.mkPen(OVERLAP_COLOUR, width=2), symbol="o",
                                                 symbolSize=4, symbolBrush=OVERLAP_COLOUR, symbolPen=None)
        self.baseline_line = pg.InfiniteLine(angle=0, pen=pg.mkPen(BASELINE_COLOUR, width=1.5, style=Qt.DashLine))
        self.layer_plot.addItem(self.baseline_line)
        self.sweep_plot = self.charts.addPlot(row=0, col=1)
        self.sweep_plot.setTitle("K sweep: median overlap<br><span style='font-size:8pt'>"
                                 + _keys({"measured": OVERLAP_COLOUR, "random K/F": BASELINE_COLOUR})
                                 + "</span>", size="10pt")
        self.sweep_plot.setLabel("bottom", "K / F")
        self.sweep_plot.showGrid(x=True, y=True, alpha=0.25)
        self.sweep_plot.setMenuEnabled(False)
        self.sweep_plot.setRange(xRange=(0, 1), yRange=(0, 1.02), padding=0)
        self.sweep_line = self.sweep_plot.plot([], [], pen=pg.mkPen(OVERLAP_COLOUR, width=2), symbol="o",
                                               symbolSize=5, symbolBrush=OVERLAP_COLOUR, symbolPen=None)
        self.sweep_baseline = self.sweep_plot.plot([0, 1], [0, 1], pen=pg.mkPen(BASELINE_COLOUR, width=1.5,
                                                                               style=Qt.DashLine))
        self.charts.ci.layout.setColumnStretchFactor(0, 3)
        self.charts.ci.layout.setColumnStretchFactor(1, 2)

        self.table = read_only_table(TABLE_COLUMNS, "Collapse table", stretch=False, row_height=20)
        self.table.cellClicked.connect(self._layer_clicked)

        # The feature view of a clicked layer row: prompt A or B of the pair, at its last token, through the
        # engine's own graphs and settings (what the cache saw there, while the table is the fp32 measurement).
        self.feature_prompt = QComboBox()
        self.feature_prompt.setAccessibleName("Collapse feature prompt")
        self.feature_prompt.currentIndexChanged.connect(self._feature_prompt_changed)
        self.feature_prompt.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.feature_prompt.setMinimumContentsLength(6)
        self.features = FeatureTable(client)
        self.features.header.insertWidget(0, self.feature_prompt, 1)
        # One clipped line under the table's header, as the lab's own status: the dock is short.
        self.features.status.setWordWrap(False)
        self.features.status.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.features.status.setText("Run the lab, then click a layer row.")
        self.features.table.verticalHeader().setDefaultSectionSize(20)
        self.features.setMinimumHeight(60)

        # Wide and short, as the bottom dock is: controls | charts | table over features, the status line under
        # the last two.
        # The whole panel scrolls below its (small) minimum size, and the controls on their own when the dock is
        # shorter than they are, so the panel never holds the window to a larger minimum than the monitor does.
        self.charts.setMinimumSize(200, 60)
        self.table.setMinimumSize(250, 60)          # every column in view at the default window size
        table_column = QSplitter(Qt.Vertical)    # the layer rows, and below them the clicked row's features
        table_column.addWidget(self.table)
        table_column.addWidget(self.features)
        right = QSplitter(Qt.Horizontal)
        right.addWidget(self.charts)
        right.addWidget(table_column)
        right.setStretchFactor(0, 2)
        right.setStretchFactor(1, 1)
        controls = scrolling(left)
        controls.setFixedWidth(left.sizeHint().width() + 16)
        controls.setMinimumHeight(40)
        content = QWidget()
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scrolling(content))
        layout = QGridLayout(content)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(controls, 0, 0, 2, 1)
        layout.addWidget(right, 0, 1)
        layout.addWidget(self.status, 1, 1)
        layout.setColumnStretch(1, 1)
        layout.setRowStretch(0, 1)
        self._update_enabled()

    # --- running ---

    def prompt_list(self) -> list[str]:
        return [line.strip() for line in self.prompts.toPlainText().splitlines() if line.strip()]

    @Slot()
    def run(self) -> None:
        prompts = self.prompt_list()
        if len(prompts) < 2:
            self.error.emit("Collapse lab: give at least two prompts, one per line")
            return
        request = RunCollapse(self.client.next_request_id(), tuple(prompts), self.top_k.value() or None)
        self._request = request
        self.status.setText(f"Measuring {len(prompts)} prompts ({COMPUTATION})…")
        self._update_enabled()
        self.client.submit(request)

    @Slot()
    def stop(self) -> None:
        """Ends the running measurement before its next prompt; the report shown stays."""
        if self._request is not None:
            self._request.cancel.set()

    @property
    def busy(self) -> bool:
        return self._request is not None

    def _answers_mine(self, answer) -> bool:
        return self._request is not None and answer.request_id == self._request.request_id

    @Slot(object)
    def _on_progress(self, event: CollapseProgress) -> None:
        if self._answers_mine(event):
            self.status.setText(f"Captured {event.captured} of {event.total} prompts ({COMPUTATION})…")

    @Slot(object)
    def _on_finished(self, event: CollapseResult) -> None:
        if self._answers_mine(event):
            self._request = None
            self._report_model_current = True
            self.show_report(event.report)
            self._update_enabled()

    @Slot(object)
    def _on_stopped(self, event: CollapseStopped) -> None:
        if self._answers_mine(event):
            self._request = None
            shown = "; the report shown is the previous run's" if self.report is not None else ""
            self.status.setText(f"Run cancelled after {event.captured} of {event.total} prompts{shown}.")
            self._update_enabled()

    @Slot(object)
    def _on_error(self, report: ErrorReport) -> None:
        if self._answers_mine(report):
            self._request = None
            self.status.setText(f"Failed: {report.message}")
            self._update_enabled()

    @Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        if info.intermediate:
            self.top_k.setMaximum(info.intermediate)
        if self.report is not None:    # its token ids belong to the model it measured
            self._report_model_current = False
            self._reset_features("The model changed since this report: run the lab again for its features.")
        self._update_enabled()

    @Slot()
    def _update_enabled(self) -> None:
        self.run_button.setEnabled(self.client.model is not None and not self.busy)
        self.stop_button.setEnabled(self.busy)
        for b in (self.export_json_button, self.export_csv_button, self.export_png_button):
            b.setEnabled(self.report is not None)

    # --- drawing ---

    def show_report(self, report: CollapseReport) -> None:
        self.report = report
        self.pair.blockSignals(True)
        self.pair.clear()
        for p in report.pairs:
            self.pair.addItem(f"{p.a + 1} vs {p.b + 1}")
        self.pair.setCurrentIndex(0)
        self.pair.blockSignals(False)
        first = report.pairs[0]
        equal = int(first.column("keys_equal").sum())
        self.status.setText(
            f"{report.model}, {report.template} prompts, K={report.top_k} of {report.intermediate}: two random "
            f"K-sets already share {report.baseline:.3f} of their features.<br>Prompts 1-2: cosine median "
            f"{np.median(first.column('cosine')):.3f}, overlap median {np.median(first.column('overlap')):.3f}, "
            f"equal keys on {equal} of {len(first.layers)} layers.")
        self._draw()
        self._update_enabled()

    def current_pair(self) -> PairReport | None:
        return None if self.report is None else self.report.pairs[max(0, self.pair.currentIndex())]

    @Slot()
    def _draw(self) -> None:
        report = self.report
        if report is None:
            return
        pair = self.current_pair()
        self.feature_prompt.blockSignals(True)
        self.feature_prompt.clear()
        for name, index in (("A", pair.a), ("B", pair.b)):
            self.feature_prompt.addItem(f"{name} = #{index + 1}")
            self.feature_prompt.setItemData(self.feature_prompt.count() - 1, report.prompts[index], Qt.ToolTipRole)
        self.feature_prompt.blockSignals(False)
        if self._report_model_current:
            self._reset_features("Click a layer row for the strongest features of the chosen prompt at its last "
                                 "token (through the engine's graphs: what the cache sees).")
        x = np.arange(len(pair.layers), dtype=float)
        cos, ovl = pair.column("cosine"), pair.column("overlap")
        self.cosine_line.setData(x, cos)
        self.overlap_line.setData(x, ovl)
        self.baseline_line.setValue(report.baseline)
        low = min(float(cos.min()), float(ovl.min()), report.baseline)
        self.layer_plot.setRange(xRange=(-0.5, len(x) - 0.5), yRange=(max(-1.0, low - 0.05), 1.02), padding=0)
        sizes = np.array([p.size for p in pair.top_k_sweep], float) / report.intermediate
        medians = np.array([np.median(p.overlap) for p in pair.top_k_sweep])
        self.sweep_line.setData(sizes, medians)
        self.table.setRowCount(len(pair.layers))
        for row, c in enumerate(pair.layers):
            for col, text in enumerate((str(c.layer), f"{c.cosine:.4f}", f"{c.overlap:.4f}", f"{report.baseline:.4f}",
                                        f"{c.key_overlap:.4f}", "yes" if c.keys_equal else "no")):
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.table.setItem(row, col, item)
        self.table.resizeColumnsToContents()

    # --- the feature view of a layer row ---

    def feature_ids(self) -> tuple[int, ...]:
        """The token ids of the pair's chosen prompt, as the lab measured them (its last is the position shown)."""
        pair = self.current_pair()
        if pair is None:
            return ()
        return self.report.token_ids[pair.b if self.feature_prompt.currentIndex() == 1 else pair.a]

    def _reset_features(self, note: str) -> None:
        self._feature_layer = None
        ids = self.feature_ids() if self._report_model_current else ()
        self.features.set_ids(ids, len(self.current_pair().layers) if ids else 0, note)
        if not ids:
            self.features.status.setText(note)

    @Slot(int, int)
    def _layer_clicked(self, row: int, _column: int) -> None:
        item = self.table.item(row, 0)
        if item is None or not self._report_model_current:
            return
        self._feature_layer = int(item.text())
        self.features.request(self._feature_layer)

    @Slot(int)
    def _feature_prompt_changed(self, _index: int) -> None:
        layer = self._feature_layer
        self._reset_features("Click a layer row.")
        if layer is not None and self._report_model_current:
            self._feature_layer = layer
            self.features.request(layer)

    # --- exports ---

    def export(self, path: str | Path) -> Path:
        """JSON (.json), CSV (.csv, a row per pair and layer) or PNG (.png, the charts). OSError, ValueError."""
        if self.report is None:
            raise ValueError("run the lab first: there is nothing to export")
        path = Path(path)
        kind = path.suffix.lower()
        if kind == ".json":
            path.write_text(json.dumps(self.report.to_dict(), indent=1), encoding="utf-8")
        elif kind == ".csv":
            out = io.StringIO()
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(CSV_HEADER)
            writer.writerows(report_csv_rows(self.report))
            path.write_text(out.getvalue(), encoding="utf-8")
        elif kind == ".png":
            if not self.charts.grab().save(str(path), "PNG"):
                raise OSError(f"could not write {path}")
        else:
            raise ValueError(f"export to .json, .csv or .png, not {kind or 'no suffix'}")
        return path

    def _on_export(self, kind: str) -> None:
        filters = {"json": "JSON (*.json)", "csv": "CSV (*.csv)", "png": "PNG image (*.png)"}[kind]
        path, _ = QFileDialog.getSaveFileName(self, "Export collapse lab", str(Path(self._last_dir) / f"collapse.{kind}"),
                                              filters)
        if not path:
            return
        self._last_dir = str(Path(path).parent)
        try:
            self.export(path)
        except (OSError, ValueError) as exc:
            self.error.emit(f"Exporting the collapse lab: {exc}")
