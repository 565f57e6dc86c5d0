"""One chat: its transcript view and its draft. Behaviour lives in MainWindow; this is layout and rendering."""
from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QFont, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QHBoxLayout, QPlainTextEdit, QSplitter, QTextBrowser, QToolButton, QVBoxLayout,
                               QWidget)

from larql_desktop.qt.transcript import ASSISTANT, NOTICE, USER, Transcript

_HEADERS = {USER: "You", ASSISTANT: "Assistant"}
# Streamed text reaches the view at most this often: a layout and repaint per token took the GUI thread's share of
# the GIL and of the cores from the decode (the transcript itself takes each token at once).
APPEND_INTERVAL_MS = 50


class ChatTab(QWidget):
    def __init__(self, session_id: int, title: str, actions: list[QAction], parent: QWidget | None = None):
        super().__init__(parent)
        self.session_id = session_id
        self.title = title
        self.transcript = Transcript()
        self._unshown = ""      # streamed text the view has yet to show
        self._append_timer = QTimer(self)
        self._append_timer.setSingleShot(True)
        self._append_timer.setInterval(APPEND_INTERVAL_MS)
        self._append_timer.timeout.connect(self.flush_stream)
        self.view = QTextBrowser()
        self.view.setOpenExternalLinks(False)
        self.view.setAccessibleName(f"{title} transcript")
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Type a message; Ctrl+Return sends it")
        self.input.setAccessibleName(f"{title} message")
        self.buttons = []
        row = QHBoxLayout()
        row.addStretch(1)
        for action in actions:   # the window's actions, so enabling one updates every tab's button
            button = QToolButton()
            button.setDefaultAction(action)
            button.setToolButtonStyle(Qt.ToolButtonTextOnly)
            button.setAccessibleName(action.text().replace("&", ""))
            row.addWidget(button)
            self.buttons.append(button)
        bottom = QWidget()
        bottom_layout = QVBoxLayout(bottom)
        bottom_layout.setContentsMargins(0, 0, 0, 0)
        bottom_layout.addWidget(self.input)
        bottom_layout.addLayout(row)
        splitter = QSplitter(Qt.Vertical)
        splitter.addWidget(self.view)
        splitter.addWidget(bottom)
        splitter.setStretchFactor(0, 4)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(splitter)

    # --- rendering ---

    def _formats(self) -> dict[str, QTextCharFormat]:
        body = QTextCharFormat()
        header = QTextCharFormat()
        header.setFontWeight(QFont.Bold)
        footer = QTextCharFormat()
        footer.setForeground(self.palette().placeholderText())
        footer.setFontPointSize(max(6.0, self.font().pointSizeF() * 0.85))
        notice = QTextCharFormat(footer)
        notice.setFontItalic(True)
        return {"body": body, "header": header, "footer": footer, "notice": notice}

    def render(self) -> None:
        """Rebuild the whole view from the transcript (on structural changes; tokens go through `append`)."""
        self._append_timer.stop()
        self._unshown = ""      # the transcript has it: rebuilt below
        formats = self._formats()
        doc = self.view.document()
        doc.clear()
        cursor = QTextCursor(doc)
        first = True
        spaced, tight = QTextBlockFormat(), QTextBlockFormat()
        spaced.setTopMargin(10)   # a gap above each turn

        def block(text: str, fmt: QTextCharFormat, new_turn: bool = False) -> None:
            nonlocal first
            if first:
                cursor.setBlockFormat(tight)
            else:
                cursor.insertBlock(spaced if new_turn else tight)
            first = False
            cursor.setCharFormat(fmt)
            cursor.insertText(text, fmt)

        for turn in self.transcript.turns:
            if turn.role == NOTICE:
                block(turn.text, formats["notice"], new_turn=True)
                continue
            block(_HEADERS[turn.role], formats["header"], new_turn=True)
            block(turn.text, formats["body"])
            if turn.footer:
                block(turn.footer, formats["footer"])
        self._scroll_to_end()

    def append(self, text: str) -> None:
        """Add streamed text to the reply being generated; the view shows it within APPEND_INTERVAL_MS."""
        self.transcript.append(text)
        self._unshown += text
        if not self._append_timer.isActive():
            self._append_timer.start()

    def flush_stream(self) -> None:
        """Show the streamed text not yet shown (the document's last block)."""
        text, self._unshown = self._unshown, ""
        if not text:
            return
        at_end = self._at_end()
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.End)
        cursor.insertText(text, self._formats()["body"])
        if at_end:
            self._scroll_to_end()

    def _at_end(self) -> bool:
        bar = self.view.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scroll_to_end(self) -> None:
        bar = self.view.verticalScrollBar()
        bar.setValue(bar.maximum())
