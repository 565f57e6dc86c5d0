"""Two panels of the chat window: the saved chats (search, open, rename, delete) and the token view (one
reply's tokens; for the selected token its top alternatives and what the FFN cache did per layer)."""
from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QSplitter, QTableWidgetItem, QTabWidget, QToolButton,
                               QVBoxLayout, QWidget)

from larql_desktop.engine.chats import ChatSummary
from larql_desktop.qt.qt_feature_view import FeatureTable
from larql_desktop.qt.qt_reply_views import LensTable
from larql_desktop.qt.qt_tables import read_only_table


class ChatsPanel(QWidget):
    """The saved chats, most recent first. The window does the work; this lists and asks."""

    open_requested = Signal(int)
    rename_requested = Signal(int)
    delete_requested = Signal(int)
    search_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search titles and messages")
        self.search.setAccessibleName("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.search_changed)
        self.list = QListWidget()
        self.list.setAccessibleName("Saved chats")
        self.list.setWordWrap(True)   # a long title wraps; the list never scrolls sideways
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.list.itemActivated.connect(lambda item: self.open_requested.emit(item.data(Qt.UserRole)))
        buttons = QHBoxLayout()
        for text, signal in (("Open", self.open_requested), ("Rename", self.rename_requested),
                             ("Delete", self.delete_requested)):
            button = QToolButton()   # compact: the panel shares the right-hand dock with the others
            button.setText(text)
            button.setAccessibleName(f"{text.rstrip('…')} chat")
            button.clicked.connect(lambda _=False, s=signal: self._emit_selected(s))
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)

    def _emit_selected(self, signal) -> None:
        chat_id = self.selected_chat()
        if chat_id is not None:
            signal.emit(chat_id)

    def selected_chat(self) -> int | None:
        item = self.list.currentItem()
        return item.data(Qt.UserRole) if item is not None else None

    def show_chats(self, chats: list[ChatSummary]) -> None:
        selected = self.selected_chat()
        self.list.clear()
        for chat in chats:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated))
            item = QListWidgetItem(f"{chat.title}\n{when} · {chat.messages} messages"
                                   + (f" · {chat.model}" if chat.model else ""))
            item.setData(Qt.UserRole, chat.id)
            item.setToolTip(chat.title)
            self.list.addItem(item)
            if chat.id == selected:
                self.list.setCurrentItem(item)

    def chat_ids(self) -> list[int]:
        return [self.list.item(i).data(Qt.UserRole) for i in range(self.list.count())]


def _wrapped(text: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    return label


def _visible(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t") if text.strip() else repr(text)


class TokenView(QWidget):
    """A reply's tokens (a list) and, for the one selected, its alternatives and per-layer FFN outcomes."""

    def __init__(self, client=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.events: list = []   # the reply's TokenEvents
        self.caption = QLabel("Pick a reply (right-click it: Show tokens…); the last reply is shown by default.")
        self.caption.setWordWrap(True)
        self.tokens = QListWidget()
        self.tokens.setAccessibleName("Reply tokens")
        self.tokens.currentRowChanged.connect(self.show_token)
        self.alternatives = read_only_table(["Token", "Probability"], "Top alternatives")
        self.layers = read_only_table(["Layer", "FFN"], "FFN per layer")
        self.note = QLabel("")
        self.note.setWordWrap(True)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addWidget(_wrapped("Top 5 (the model's probabilities at this step)"))
        top_layout.addWidget(self.alternatives, 1)
        top_layout.addWidget(self.note)
        per_layer = QWidget()
        per_layer_layout = QVBoxLayout(per_layer)
        per_layer_layout.setContentsMargins(0, 0, 0, 0)
        per_layer_layout.addWidget(_wrapped("FFN per layer, in the pass this token was sampled from"))
        per_layer_layout.addWidget(self.layers, 1)
        # The selected token's details in tabs, each with the panel's full height: what the FFN did per layer,
        # its strongest features at a layer (click a layer row), the logit lens.
        self.details = QTabWidget()
        self.details.setAccessibleName("Token details")
        self.details.addTab(top, "Top 5")
        self.details.addTab(per_layer, "FFN per layer")
        # With an engine client: the features at a layer and the logit lens.
        self.features = FeatureTable(client) if client is not None else None
        self.lens = LensTable(client) if client is not None else None
        if self.features is not None:
            self.layers.cellClicked.connect(self._layer_clicked)
            self.details.addTab(self.features, "Features")
            self.details.addTab(self.lens, "Logit lens")
            self.details.currentChanged.connect(self._details_changed)
        splitter = QSplitter(Qt.Vertical)   # narrow: it shares the right-hand dock with the other panels
        splitter.addWidget(self.tokens)
        splitter.addWidget(self.details)
        splitter.setStretchFactor(1, 3)
        layout = QVBoxLayout(self)
        layout.addWidget(self.caption)
        layout.addWidget(splitter, 1)

    def show_reply(self, events: list, caption: str) -> None:
        self.events = list(events)
        self.caption.setText(caption if self.events else
                             f"{caption}: no token details (kept for replies that ran to their end in this app)")
        self.tokens.clear()
        for event in self.events:
            label = f"{event.index}: {_visible(event.text) if not event.is_stop else '(stop)'}"
            if event.alternatives:
                chosen = next((a.probability for a in event.alternatives if a.token_id == event.token_id), None)
                label += f"  ({chosen:.1%})" if chosen is not None else "  (<top 5)"
            self.tokens.addItem(label)
        if self.events:
            self.tokens.setCurrentRow(0)
        else:
            self.show_token(-1)

    def show_token(self, row: int) -> None:
        event = self.events[row] if 0 <= row < len(self.events) else None
        self.alternatives.setRowCount(0)
        self.layers.setRowCount(0)
        self.note.setText("")
        if self.features is not None:
            before = tuple(e.token_id for e in self.events[:max(row, 0)])
            self.features.set_token(event, before, len(event.layers) if event is not None else 0)
            self.lens.set_token(event)
            if self.details.currentWidget() is self.lens:
                self.lens.request()
        if event is None:
            return
        for a in event.alternatives:
            r = self.alternatives.rowCount()
            self.alternatives.insertRow(r)
            mark = "▶ " if a.token_id == event.token_id else ""
            self.alternatives.setItem(r, 0, QTableWidgetItem(f"{mark}{_visible(a.text)}  [{a.token_id}]"))
            self.alternatives.setItem(r, 1, QTableWidgetItem(f"{a.probability:.4f}"))
        if event.alternatives and all(a.token_id != event.token_id for a in event.alternatives):
            self.note.setText("the sampled token was not among the top 5")
        for o in event.layers:
            r = self.layers.rowCount()
            self.layers.insertRow(r)
            self.layers.setItem(r, 0, QTableWidgetItem(str(o.layer)))
            self.layers.setItem(r, 1, QTableWidgetItem(o.describe()))

    def _layer_clicked(self, row: int, _column: int) -> None:
        item = self.layers.item(row, 0)
        if item is not None and self.features is not None:
            self.show_features(int(item.text()))

    def show_features(self, layer: int) -> int | None:
        """The selected token's features at `layer`, in front."""
        self.details.setCurrentWidget(self.features)
        return self.features.request(layer)

    def show_lens(self) -> int | None:
        """The selected token's logit lens, in front (computed now)."""
        self.details.blockSignals(True)
        self.details.setCurrentWidget(self.lens)
        self.details.blockSignals(False)
        return self.lens.request()

    def _details_changed(self, _index: int) -> None:
        if self.details.currentWidget() is self.lens and self.lens.lens is None:
            self.lens.request()
