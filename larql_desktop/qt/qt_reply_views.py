"""The reply as pictures: the reply x layer map (tokens across, layers down, each cell what the FFN did for that
token at that layer, INSERT fired marked) and the logit lens of a token (at every layer, the tokens its residual
would predict through the final norm and head, and the chosen token's rank).

Both come from the reply's pass recomputed once in the engine thread (engine/analysis/reply_pass.py) through
the worker's handlers (qt/lab_jobs.py); the outcomes the map draws are the ones the engine recorded while it
generated (TokenEvent.layers), INSERT fired from the recomputed pass. The last pass is kept for the lens.
"""
from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import QLabel, QTableWidgetItem, QVBoxLayout, QWidget

from larql_desktop.engine.analysis.lens import LogitLens
from larql_desktop.engine.analysis.reply_pass import CELL_LABELS, Cell, outcome_grid
from larql_desktop.qt.protocol import AnalyseReply, LensResult, ReplyAnalysed, ShowLens
from larql_desktop.qt.qt_tables import read_only_table
from larql_desktop.qt.token_shading import visible

CELL_COLOURS = {Cell.L1_HIT: "#1f77b4", Cell.L2_HIT: "#ff7f0e", Cell.L3_HIT: "#17a589", Cell.MISS: "#d62728",
                Cell.BYPASS_PREFILL: "#c7c7c7", Cell.BYPASS_PATCHED: "#b39ddb", Cell.BYPASS_CACHE_OFF: "#8c8c8c",
                Cell.BYPASS_FULL_K: "#6d6d6d", Cell.DENSE: "#5d4037", Cell.INSERT_FIRED: "#ffd400",
                Cell.UNKNOWN: "#ffffff"}
_RGB = np.array([[int(CELL_COLOURS[Cell(i)][k:k + 2], 16) for k in (1, 3, 5)] for i in range(len(Cell))], np.uint8)


# --- the reply x layer map ---

def cell_legend_html() -> str:
    return " ".join(f"<span style='background:{CELL_COLOURS[c]}; color:{'black' if c in _LIGHT else 'white'}'>"
                    f"&nbsp;{html.escape(CELL_LABELS[c])}&nbsp;</span>" for c in Cell if c != Cell.UNKNOWN)


_LIGHT = {Cell.BYPASS_PREFILL, Cell.BYPASS_PATCHED, Cell.INSERT_FIRED, Cell.L2_HIT, Cell.UNKNOWN}


class ReplyMap(QWidget):
    """Tokens across, layers down: what the FFN did per token and layer in the selected reply; click a cell for
    that pass's features."""

    cell_clicked = Signal(int, int)     # (token index, layer)
    analysed = Signal(object)           # the Turn whose `fired` was just filled

    def __init__(self, client, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.events: list = []
        self.turn = None
        self.grid = np.zeros((0, 0), np.int16)
        self.fired: np.ndarray | None = None
        self._pending: int | None = None
        self.caption = QLabel("Pick a reply (click one of its tokens): its tokens across, the layers down.")
        self.caption.setWordWrap(True)
        self.plot_widget = pg.PlotWidget()
        self.plot_widget.setAccessibleName("Reply by layer picture")
        self.plot_widget.setBackground(None)
        self.plot = self.plot_widget.getPlotItem()
        self.plot.setLabel("bottom", "token of the reply")
        self.plot.setLabel("left", "layer")
        self.plot.invertY(True)
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        self.plot_widget.scene().sigMouseClicked.connect(self._on_click)
        self.legend = QLabel(cell_legend_html())
        self.legend.setWordWrap(True)
        self.legend.setAccessibleName("Reply by layer legend")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addWidget(self.plot_widget, 1)
        layout.addWidget(self.legend)
        client.reply_analysed.connect(self._on_analysed)
        client.error.connect(self._on_error)

    def show_reply(self, turn, caption: str, analyse: bool = True) -> int | None:
        """Draw `turn`'s tokens (its recorded outcomes at once); with `analyse`, ask the engine where INSERTed
        features fired (the map redraws when it answers). Returns that request's id."""
        self.turn = turn
        self.events = list(turn.tokens) if turn is not None else []
        self.fired = None
        self._pending = None
        self.caption.setText(caption if self.events else f"{caption}: no token details")
        self._draw()
        if analyse:
            return self.analyse()
        return None

    @property
    def analysing(self) -> bool:
        """Whether an analysis this map asked for is still in the worker."""
        return self._pending is not None

    def analyse(self) -> int | None:
        events = [e for e in self.events if e.position >= 0]
        if not events or len(events) != len(self.events) or self.client.model is None:
            return None
        request = AnalyseReply(self.client.next_request_id(), events[0].session_id,
                               tuple(e.position for e in events), tuple(e.token_id for e in events))
        self._pending = request.request_id
        self.client.submit(request)
        return request.request_id

    def _n_layers(self) -> int:
        recorded = max((o.layer + 1 for e in self.events for o in e.layers), default=0)
        return max(recorded, self.client.model.n_layers if self.client.model is not None else 0)

    def _draw(self) -> None:
        self.grid = outcome_grid([e.layers for e in self.events], self._n_layers(), self.fired)
        if self.grid.size == 0:
            self.image.clear()
            return
        self.image.setImage(_RGB[self.grid], autoLevels=False, levels=(0, 255))
        self.plot.setXRange(0, self.grid.shape[1], padding=0)
        self.plot.setYRange(0, self.grid.shape[0], padding=0)
        ticks = [(t + 0.5, visible(e.text)[:8]) for t, e in enumerate(self.events)]
        step = max(1, len(ticks) // 24)            # every token's text while they fit, else every step-th
        self.plot.getAxis("bottom").setTicks([ticks[::step]])

    def image_colours(self) -> np.ndarray:
        """(n_layers, T, 3) the colours drawn (what the picture shows)."""
        return np.asarray(self.image.image)

    @Slot(object)
    def _on_click(self, event) -> None:
        if self.grid.size == 0:
            return
        point = self.plot.vb.mapSceneToView(event.scenePos())
        token, layer = int(np.floor(point.x())), int(np.floor(point.y()))
        if 0 <= token < self.grid.shape[1] and 0 <= layer < self.grid.shape[0]:
            self.cell_clicked.emit(token, layer)

    @Slot(object)
    def _on_analysed(self, event: ReplyAnalysed) -> None:
        if event.request_id == self._pending:
            self._pending = None
            self.fired = event.fired
            if self.turn is not None:
                self.turn.fired = {t: tuple(int(layer) for layer in np.flatnonzero(event.fired[:, t]))
                                   for t in range(event.fired.shape[1]) if event.fired[:, t].any()}
                self.analysed.emit(self.turn)
            self._draw()

    @Slot(object)
    def _on_error(self, report) -> None:
        if self._pending is not None and report.request_id == self._pending:
            self._pending = None
            self.caption.setText(f"{self.caption.text()} (where INSERTs fired is unknown: {report.message})")


# --- the logit lens ---

LENS_COLUMNS = ("Layer", "Top tokens (P)", "Rank of chosen")


class LensTable(QWidget):
    """The logit lens of the selected token: at every layer, the top tokens and the chosen token's rank."""

    def __init__(self, client, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.lens: LogitLens | None = None
        self._pending: int | None = None
        self._event = None
        self.status = QLabel("Pick a token: the residual after each layer, read through the final norm and head.")
        self.status.setWordWrap(True)
        self.table = read_only_table(list(LENS_COLUMNS), "Logit lens", stretch=False)
        header = self.table.horizontalHeader()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, header.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, header.ResizeMode.Stretch)
        header.setSectionResizeMode(2, header.ResizeMode.ResizeToContents)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.status)
        layout.addWidget(self.table, 1)
        client.lens_shown.connect(self._on_lens)
        client.error.connect(self._on_error)

    def set_token(self, event) -> None:
        self._event = event
        self._pending = None
        self.lens = None
        self.table.setRowCount(0)
        self.status.setText("Computing the logit lens…" if event is not None else "")

    def request(self) -> int | None:
        event = self._event
        if event is None or event.position < 0 or self.client.model is None:
            if event is not None:
                self.status.setText("No logit lens: this reply's pass is not in a session of this run.")
            return None
        request = ShowLens(self.client.next_request_id(), event.session_id, event.position, event.token_id)
        self._pending = request.request_id
        self.client.submit(request)
        return request.request_id

    @Slot(object)
    def _on_lens(self, event: LensResult) -> None:
        if event.request_id == self._pending:
            self._pending = None
            self.show_lens(event.lens)

    @Slot(object)
    def _on_error(self, report) -> None:
        if self._pending is not None and report.request_id == self._pending:
            self._pending = None
            self.status.setText(f"Failed: {report.message}")

    def show_lens(self, lens: LogitLens) -> None:
        self.lens = lens
        self.table.setRowCount(len(lens.layers))
        for r, layer in enumerate(lens.layers):
            tops = "  ".join(f"{visible(t)} {p:.2f}" for t, p in zip(layer.top_texts, layer.top_probabilities))
            cells = (str(layer.layer), tops, str(layer.chosen_rank))
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c == 2:
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                    item.setToolTip(f"P({visible(lens.chosen_text)}) = {layer.chosen_probability:.4f} at layer "
                                    f"{layer.layer}")
                self.table.setItem(r, c, item)
        first_top = next((layer.layer for layer in lens.layers if layer.chosen_rank == 1), None)
        if first_top is not None:   # where the choice is written: in view
            self.table.scrollToItem(self.table.item(first_top, 0), self.table.ScrollHint.PositionAtCenter)
        self.status.setText(f"“{visible(lens.chosen_text)}” at position {lens.position}: "
                            + (f"first the top prediction after layer {first_top}." if first_top is not None
                               else "the top prediction at no layer (it was sampled below the top)."))
