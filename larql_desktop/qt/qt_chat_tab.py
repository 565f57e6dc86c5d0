"""One chat: its transcript view and its draft. Behaviour lives in MainWindow; this is layout and rendering.

Replies are rendered as Markdown once they have ended (code blocks monospaced); while one streams its text is
appended as it comes. The view's context menu copies a reply (as shown or as its Markdown source) and opens
its tokens in the token view."""
from __future__ import annotations

from PySide6.QtCore import QEvent, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import (QAction, QColor, QFont, QFontDatabase, QTextBlockFormat, QTextCharFormat, QTextCursor,
                           QTextDocument, QTextFormat)
from PySide6.QtWidgets import (QApplication, QHBoxLayout, QMenu, QPlainTextEdit, QSplitter, QTextBrowser,
                               QToolButton, QToolTip, QVBoxLayout, QWidget)

from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.qt import token_shading
from larql_desktop.qt.chat_controller import Chat
from larql_desktop.qt.transcript import ASSISTANT, NOTICE, USER, Transcript

_HEADERS = {USER: "You", ASSISTANT: "Assistant"}
# Streamed text reaches the view at most this often: a layout and repaint per token took the GUI thread's share of
# the GIL and of the cores from the decode (the transcript itself takes each token at once).
APPEND_INTERVAL_MS = 50
# Character format properties of a shaded reply's tokens: which turn and which of its tokens the text is.
TURN_PROPERTY = QTextFormat.UserProperty + 1
TOKEN_PROPERTY = QTextFormat.UserProperty + 2


def markdown_as_plain_text(markdown: str) -> str:
    """What a Markdown text reads as once rendered (list markers and emphasis marks gone)."""
    doc = QTextDocument()
    doc.setMarkdown(markdown)
    return doc.toPlainText()


class ChatTab(QWidget):
    """The view of one chat: its transcript rendered, the streaming text, the message box."""
    tokens_requested = Signal(int)   # index of a turn whose tokens the user wants to see
    token_clicked = Signal(int, int)  # (turn index, token index): the user clicked that token of a reply

    def __init__(self, chat: Chat, actions: list[QAction], parent: QWidget | None = None):
        super().__init__(parent)
        self.chat = chat                     # what this tab shows (the chat controller keeps it)
        title = chat.title
        self.shade_by = token_shading.NONE   # the measure ended replies are shaded by (the window sets it)
        self._unshown = ""      # streamed text the view has yet to show
        self._append_timer = QTimer(self)
        self._append_timer.setSingleShot(True)
        self._append_timer.setInterval(APPEND_INTERVAL_MS)
        self._append_timer.timeout.connect(self.flush_stream)
        self.turn_spans: list[tuple[int, int, int]] = []   # (start, end, turn index) in the view's document
        self.view = QTextBrowser()
        self.view.setOpenExternalLinks(False)
        self.view.setAccessibleName(f"{title} transcript")
        self.view.setContextMenuPolicy(Qt.CustomContextMenu)
        self.view.customContextMenuRequested.connect(self._show_context_menu)
        self.view.viewport().installEventFilter(self)   # a click on a reply picks its token for the token view
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


    # The chat's own state, read through the tab (the controller changes it).
    @property
    def session_id(self) -> int:
        return self.chat.id

    @property
    def title(self) -> str:
        return self.chat.title

    @property
    def sampling(self) -> SamplingSettings:
        return self.chat.sampling

    @property
    def system_prompt(self) -> str | None:
        return self.chat.system_prompt

    @property
    def transcript(self) -> Transcript:
        return self.chat.transcript
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
        doc.setDefaultStyleSheet("")
        cursor = QTextCursor(doc)
        first = True
        spaced, tight = QTextBlockFormat(), QTextBlockFormat()
        spaced.setTopMargin(10)   # a gap above each turn
        self.turn_spans = []

        def block(text: str, fmt: QTextCharFormat, new_turn: bool = False, markdown: bool = False) -> None:
            nonlocal first
            if first:
                cursor.setBlockFormat(tight)
            else:
                cursor.insertBlock(spaced if new_turn else tight)
            first = False
            cursor.setCharFormat(fmt)
            if markdown:
                cursor.insertMarkdown(text)
            else:
                cursor.insertText(text, fmt)

        for index, turn in enumerate(self.transcript.turns):
            start = cursor.position()
            if turn.role == NOTICE:
                block(turn.text, formats["notice"], new_turn=True)
            elif self._shaded(turn):
                block(_HEADERS[turn.role], formats["header"], new_turn=True)
                block("", formats["body"])
                self._insert_shaded(cursor, index, turn, formats["body"])
                if turn.footer:
                    block(turn.footer, formats["footer"])
            else:
                block(_HEADERS[turn.role], formats["header"], new_turn=True)
                # A streaming reply stays plain text: `append` adds to it, and half a code fence renders oddly.
                block(turn.text, formats["body"], markdown=turn.role == ASSISTANT and turn.done and bool(turn.text.strip()))
                if turn.footer:
                    block(turn.footer, formats["footer"])
            self.turn_spans.append((start, cursor.position(), index))
        _monospace_code(doc)
        self._scroll_to_end()

    def _shaded(self, turn) -> bool:
        return (self.shade_by != token_shading.NONE and turn.role == ASSISTANT and turn.done
                and bool(turn.tokens))

    def _insert_shaded(self, cursor: QTextCursor, index: int, turn, body: QTextCharFormat) -> None:
        """The reply as its tokens, each with its shade, its tooltip and which token it is (for clicks)."""
        remaining = len(turn.text)          # stop strings and held-back bytes: the reply's text is what counts
        shown = 0
        for number, event in enumerate(turn.tokens):
            text = event.text[:max(0, remaining - shown)]
            if not text:
                continue
            fired = turn.fired.get(number, ())
            fmt = QTextCharFormat(body)
            colour = token_shading.shade(event, self.shade_by, fired)
            if colour is not None:
                fmt.setBackground(QColor(colour))
                fmt.setForeground(QColor("black"))   # the shades are light in either theme
            fmt.setToolTip(token_shading.token_tooltip(event, fired))
            fmt.setProperty(TURN_PROPERTY, index)
            fmt.setProperty(TOKEN_PROPERTY, number)
            cursor.insertText(text, fmt)
            shown += len(text)
        if shown < remaining:
            cursor.insertText(turn.text[shown:], body)

    def shaded_tokens(self) -> list[tuple[int, int, str, str | None]]:
        """(turn index, token index, text, background '#rrggbb' or None) of every shaded token shown, in order."""
        out = []
        block = self.view.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                fmt = fragment.charFormat()
                if fragment.isValid() and fmt.hasProperty(TOKEN_PROPERTY):
                    background = fmt.background().color().name() if fmt.hasProperty(QTextFormat.BackgroundBrush) \
                        else None
                    key = (fmt.intProperty(TURN_PROPERTY), fmt.intProperty(TOKEN_PROPERTY))
                    if out and out[-1][:2] == key:   # a token's text across a line break: one entry
                        out[-1] = (*key, out[-1][2] + "\n" + fragment.text(), background)
                    else:
                        out.append((*key, fragment.text(), background))
                it += 1
            block = block.next()
        return out

    def _token_format_at(self, point: QPoint) -> QTextCharFormat | None:
        """The format of the shaded token under a viewport point, if any."""
        cursor = self.view.cursorForPosition(point)
        for position in (cursor.position() + 1, cursor.position()):
            probe = QTextCursor(self.view.document())
            probe.setPosition(min(position, self.view.document().characterCount() - 1))
            fmt = probe.charFormat()
            if fmt.hasProperty(TOKEN_PROPERTY):
                return fmt
        return None

    def show_streamed(self, text: str) -> None:
        """Show text streamed into the reply being generated (already in the transcript) within
        APPEND_INTERVAL_MS."""
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
        if self.turn_spans:
            start, _, index = self.turn_spans[-1]
            self.turn_spans[-1] = (start, cursor.position(), index)
        if at_end:
            self._scroll_to_end()

    def _at_end(self) -> bool:
        bar = self.view.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scroll_to_end(self) -> None:
        bar = self.view.verticalScrollBar()
        bar.setValue(bar.maximum())

    # --- what is where, copying ---

    def turn_at(self, position: int) -> int | None:
        """The index of the turn shown at a document position."""
        return next((index for start, end, index in self.turn_spans if start <= position <= end), None)

    def reply_index_at(self, point: QPoint) -> int | None:
        index = self.turn_at(self.view.cursorForPosition(point).position())
        if index is None or self.transcript.turns[index].role != ASSISTANT:
            return None
        return index

    def copy_turn(self, index: int, markdown: bool = False) -> str:
        """Put a turn's text on the clipboard: as shown (rendered) or as its Markdown source."""
        text = self.transcript.turns[index].text
        text = text if markdown or self.transcript.turns[index].role != ASSISTANT else markdown_as_plain_text(text)
        QApplication.clipboard().setText(text)
        return text

    def eventFilter(self, watched, event) -> bool:
        if watched is self.view.viewport() and event.type() == QEvent.ToolTip:
            fmt = self._token_format_at(event.pos())
            if fmt is not None:
                QToolTip.showText(event.globalPos(), fmt.toolTip(), self.view)
                return True
        if (watched is self.view.viewport() and event.type() == QEvent.MouseButtonRelease
                and event.button() == Qt.LeftButton and not self.view.textCursor().hasSelection()):
            point = event.position().toPoint()
            fmt = self._token_format_at(point)
            hit = (fmt.intProperty(TURN_PROPERTY), fmt.intProperty(TOKEN_PROPERTY)) if fmt is not None else \
                self.token_at(self.view.cursorForPosition(point).position())
            if hit is not None:
                self.token_clicked.emit(*hit)
        return super().eventFilter(watched, event)

    def token_at(self, position: int) -> tuple[int, int] | None:
        """(turn index, token index) of the reply token shown at a document position, if it has token details.

        A rendered reply's text is not its Markdown source: each shown block is found in the source in order
        (code and plain paragraphs appear verbatim; for a block that changed, the few characters before the
        position are looked up instead), and the source offset picks the token whose text covers it."""
        index = self.turn_at(position)
        if index is None:
            return None
        turn = self.transcript.turns[index]
        if turn.role != ASSISTANT or not turn.tokens:
            return None
        start, end, _ = self.turn_spans[[i for _, _, i in self.turn_spans].index(index)]
        doc = self.view.document()
        block = doc.findBlock(start).next()   # after the header
        source, searched, offset = turn.text, 0, None
        while block.isValid() and block.position() <= min(end, position):
            text = block.text()
            found = source.find(text, searched) if text else -1
            if block.contains(position):
                at = position - block.position()
                if found >= 0:
                    offset = found + at
                else:
                    needle = text[max(0, at - 12):at]
                    near = source.find(needle, searched) if needle else -1
                    offset = near + len(needle) if near >= 0 else None
                break
            if found >= 0:
                searched = found + len(text)
            block = block.next()
        if offset is None:
            return None
        covered = 0
        for number, event in enumerate(turn.tokens):
            covered += len(event.text)
            if covered > offset:
                return index, number
        return None

    def _show_context_menu(self, point: QPoint) -> None:
        menu = QMenu(self.view)
        if self.view.textCursor().hasSelection():
            menu.addAction("Copy selection", self.view.copy)
        index = self.reply_index_at(point)
        if index is not None:
            menu.addAction("Copy reply", lambda: self.copy_turn(index))
            menu.addAction("Copy reply as Markdown", lambda: self.copy_turn(index, markdown=True))
            menu.addAction("Show tokens…", lambda: self.tokens_requested.emit(index))
        menu.addSeparator()
        menu.addAction("Select all", self.view.selectAll)
        menu.exec(self.view.viewport().mapToGlobal(point))


def _monospace_code(doc: QTextDocument) -> None:
    """Make sure code (fenced blocks and inline spans, which the Markdown reader marks fixed-pitch) shows in the
    system's monospaced font: the fixed-pitch hint alone picks none on some platforms."""
    fixed = QFontDatabase.systemFont(QFontDatabase.FixedFont)
    block = doc.begin()
    while block.isValid():
        is_code = block.blockFormat().hasProperty(QTextBlockFormat.BlockCodeFence) or \
            block.blockFormat().nonBreakableLines()
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            families = fragment.charFormat().fontFamilies() or [] if fragment.isValid() else []
            # The first line of a fenced block merges into the block the reply starts in and keeps only the
            # reader's "monospace" family; every other code line is marked as such.
            if fragment.isValid() and (is_code or fragment.charFormat().fontFixedPitch() or "monospace" in families):
                cursor = QTextCursor(doc)
                cursor.setPosition(fragment.position())
                cursor.setPosition(fragment.position() + fragment.length(), QTextCursor.KeepAnchor)
                fmt = QTextCharFormat()
                fmt.setFontFamilies([fixed.family()])
                fmt.setFontFixedPitch(True)
                cursor.mergeCharFormat(fmt)
            it += 1
        block = block.next()
