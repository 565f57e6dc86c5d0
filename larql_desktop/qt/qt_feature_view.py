"""The feature table: for a selected token and layer, the strongest FFN features by gate score, which formed the
cache key and which INSERT overrides fired (engine/analysis/features.py).

The request runs in the engine thread, one of the worker's handlers (qt/lab_jobs.py). The token
view's table rebuilds the pass a token was sampled from out of its chat session's token history (`set_token`);
the collapse lab's asks for the last of explicit token ids, a prompt as the lab measured it (`set_ids`).
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Slot
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QSpinBox, QTableWidgetItem, QVBoxLayout, QWidget)

from larql_desktop.engine.analysis.features import FeatureView
from larql_desktop.engine.analysis.lens import PromotedTokens
from larql_desktop.qt.protocol import FeaturesResult, ShowFeatures, ShowFeaturesOfIds
from larql_desktop.qt.qt_tables import read_only_table

FEATURE_COLUMNS = ("Feature", "Gate score", "In key", "INSERT fired", "Promotes")


def _visible(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t") if text.strip() else repr(text)


class FeatureTable(QWidget):
    """A layer selector and the table of one FeatureView; `request(layer)` asks the engine for the view of the
    token set with `set_token` (a chat reply's) or `set_ids` (the last of explicit ids)."""

    def __init__(self, client, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.view: FeatureView | None = None
        self.promoted: tuple[PromotedTokens, ...] = ()
        self._pending: int | None = None
        # (request_id, layer) -> the request for the selected token; None: nothing selected.
        self._make_request: Callable[[int, int], object] | None = None
        client.features_shown.connect(self._on_features)
        client.error.connect(self._on_error)
        self.layer = QSpinBox(minimum=0, maximum=0)
        self.layer.setAccessibleName("Feature view layer")
        self.layer.valueChanged.connect(self._layer_changed)
        self.status = QLabel("Pick a token, then a layer (or click a layer row above).")
        self.status.setWordWrap(True)
        self.table = read_only_table(FEATURE_COLUMNS, "Strongest features", stretch=False)
        header = self.table.horizontalHeader()
        for column in range(len(FEATURE_COLUMNS) - 1):
            header.setSectionResizeMode(column, header.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(len(FEATURE_COLUMNS) - 1, header.ResizeMode.Stretch)
        self.header = QHBoxLayout()     # a host panel may add its own choice of token here
        self.header.addWidget(QLabel("Features at layer"))
        self.header.addWidget(self.layer, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(self.header)
        layout.addWidget(self.status)
        layout.addWidget(self.table, 1)

    def set_token(self, event, reply_before: tuple[int, ...], n_layers: int) -> None:
        """The token whose features the table shows (None: nothing selected) and the reply's tokens sampled
        before it; clears the last answer."""
        reply_before = tuple(reply_before)
        self._select(None if event is None else (lambda request_id, layer: ShowFeatures(
            request_id, event.session_id, event.position, reply_before, layer)), n_layers,
            "Pick a layer (or click a layer row above).")

    def set_ids(self, token_ids, n_layers: int, note: str = "Pick a layer.") -> None:
        """Show the last of `token_ids` (empty: nothing selected); clears the last answer."""
        ids = tuple(int(i) for i in token_ids)
        self._select((lambda request_id, layer: ShowFeaturesOfIds(request_id, ids, layer)) if ids else None,
                     n_layers, note)

    def _select(self, make_request, n_layers: int, note: str) -> None:
        self._make_request = make_request
        self._pending = None
        self.view = None
        self.table.setRowCount(0)
        self.layer.blockSignals(True)
        self.layer.setMaximum(max(0, n_layers - 1))
        self.layer.blockSignals(False)
        self.status.setText(note if make_request is not None else "")

    def request(self, layer: int) -> int | None:
        """Ask for the selected token's features at `layer`; returns the request id (None without a token)."""
        if self._make_request is None or self.client.model is None:
            return None
        self.layer.blockSignals(True)
        self.layer.setValue(layer)
        self.layer.blockSignals(False)
        request = self._make_request(self.client.next_request_id(), layer)
        self._pending = request.request_id
        self.status.setText(f"Computing the features of layer {layer}…")
        self.client.submit(request)
        return request.request_id

    @Slot(int)
    def _layer_changed(self, layer: int) -> None:
        self.request(layer)

    @Slot(object)
    def _on_features(self, event: FeaturesResult) -> None:
        if event.request_id == self._pending:
            self._pending = None
            self.show_view(event.view, event.promoted)

    @Slot(object)
    def _on_error(self, report) -> None:
        if self._pending is not None and report.request_id == self._pending:
            self._pending = None
            self.status.setText(f"Failed: {report.message}")

    def show_view(self, view: FeatureView, promoted: tuple[PromotedTokens, ...] = ()) -> None:
        self.view = view
        self.promoted = promoted
        self.table.setRowCount(0)
        for n, r in enumerate(view.rows):
            i = self.table.rowCount()
            self.table.insertRow(i)
            tokens = promoted[n] if n < len(promoted) else None
            cells = (str(r.feature), f"{r.score:+.4f}", "yes" if r.in_key else "",
                     f"patch {r.patch_id}" if r.patch_id else "",
                     " ".join(_visible(t) for t in tokens.texts) if tokens is not None else "")
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if column == 4 and tokens is not None:
                    item.setToolTip("Its down vector through the final norm and head promotes:\n" + "\n".join(
                        f"{_visible(t)}  logit {v:+.2f}" for t, v in zip(tokens.texts, tokens.logits)))
                self.table.setItem(i, column, item)
        fired = ", ".join(f"{r.feature} (patch {r.patch_id})" for r in view.fired) or "none"
        self.status.setText(f"Layer {view.layer}, position {view.position}: the {len(view.rows)} strongest of "
                            f"K={view.top_k}; key of k'={view.key_width} features, hash {view.key_hash:016x}"
                            f"{' (not looked up: the layer is patched)' if view.layer_patched else ''}; "
                            f"INSERT overrides fired: {fired}")
