"""What keeps the app as fast as the engine (issue 17), on the real widgets offscreen: streamed text reaches the
view in coalesced appends, not one layout and repaint per token."""
from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from larql_desktop.engine.model.generation import SamplingSettings  # noqa: E402
from larql_desktop.qt.chat_controller import Chat  # noqa: E402
from larql_desktop.qt.qt_chat_tab import APPEND_INTERVAL_MS, ChatTab  # noqa: E402


def test_streamed_tokens_reach_the_view_in_one_append_per_interval(qtbot):
    tab = ChatTab(Chat(1, "Chat 1", SamplingSettings(), None), [])
    qtbot.addWidget(tab)
    tab.transcript.add_user("Count.")
    tab.transcript.start_reply()
    tab.render()
    inserts = []
    tab.view.document().contentsChange.connect(lambda pos, removed, added: inserts.append(added))
    pieces = [f" {i}" for i in range(200)]
    for piece in pieces:   # as the chat controller streams a reply: into the transcript, then the view
        tab.transcript.append(piece)
        tab.show_streamed(piece)
    assert tab.transcript.last.text == "".join(pieces)     # the transcript has every token at once...
    assert "199" not in tab.view.toPlainText()              # ...the view only when the timer fires
    assert tab._append_timer.isActive() and tab._append_timer.interval() == APPEND_INTERVAL_MS
    qtbot.waitUntil(lambda: tab.view.toPlainText().endswith(" 199"), timeout=10_000)   # a bounded wait for the timer
    assert len(inserts) == 1                                # one insert for the 200 tokens
    assert tab.view.toPlainText().count(" 150 ") == 1
    tab.transcript.append(" more")
    tab.show_streamed(" more")
    tab.render()                                            # a rebuild shows the pending text once, now
    assert tab.view.toPlainText().endswith(" 199 more")
    # ...and the timer cannot append it again: the rebuild stopped it and took the pending text; what its
    # timeout would do now adds nothing.
    assert not tab._append_timer.isActive()
    tab.flush_stream()
    assert tab.view.toPlainText().count(" more") == 1
