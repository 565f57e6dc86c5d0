"""The token view's feature table on the real window with the real SmolLM2 (offscreen)."""
from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

import test_qt_chats as chats  # noqa: E402
from larql_desktop.engine.analysis.features import feature_view  # noqa: E402
from larql_desktop.qt.protocol import ShowFeatures  # noqa: E402

# The chat tests' window fixtures and helpers (a fixture is found by its name in this module).
home, make_window, send, REPLY_TIMEOUT = chats.home, chats.make_window, chats.send, chats.REPLY_TIMEOUT

LAYER = 7


def test_clicking_a_layer_row_fills_the_feature_table_with_the_engines_answer(make_window, qtbot):
    win = make_window()
    send(qtbot, win, "Name a colour.", max_tokens=3)
    win.show_last_reply_tokens()
    view = win.token_view
    assert view.tokens.count() >= 2
    view.tokens.setCurrentRow(1)
    table = view.features.table
    assert table.rowCount() == 0
    cell = view.layers.visualItemRect(view.layers.item(LAYER, 0)).center()
    with qtbot.waitSignal(win.client.features_shown, timeout=REPLY_TIMEOUT):
        qtbot.mouseClick(view.layers.viewport(), Qt.LeftButton, pos=cell)
    assert view.features.layer.value() == LAYER
    assert table.rowCount() == 20
    # The engine function's answer for the pass token 1 was sampled from: the prompt and token 0.
    worker = win.client.worker
    session = worker.sessions[win.current_tab().session_id]
    ids = worker.model.encode_prompt(session.conversation(session.messages[:-1])) + [view.events[0].token_id]
    expected = feature_view(worker.engine, ids, LAYER)
    assert view.features.view == expected
    assert table.item(0, 0).text() == str(expected.rows[0].feature)
    assert [table.item(r, 2).text() == "yes" for r in range(20)] == [r.in_key for r in expected.rows]
    assert f"{expected.key_hash:016x}" in view.features.status.text()
    # The layer selector asks again for another layer of the same token.
    with qtbot.waitSignal(win.client.features_shown, timeout=REPLY_TIMEOUT):
        view.features.layer.setValue(LAYER + 1)
    assert view.features.view.layer == LAYER + 1
    assert table.item(0, 0).text() == str(feature_view(worker.engine, ids, LAYER + 1).rows[0].feature)


def test_a_token_whose_chat_moved_on_or_closed_gets_a_clear_error_and_an_empty_table(make_window, qtbot):
    win = make_window()
    send(qtbot, win, "Name a colour.", max_tokens=3)
    win.show_last_reply_tokens()
    view = win.token_view
    session_id = win.current_tab().session_id
    event = view.events[2]
    # Tokens that are not the ones before this position in the session (the chat was regenerated meanwhile).
    wrong = tuple((e.token_id + 1) % 1000 for e in view.events[:2])
    with qtbot.waitSignal(win.client.error, timeout=REPLY_TIMEOUT) as failed:
        win.client.submit(ShowFeatures(win.client.next_request_id(), session_id, event.position, wrong, LAYER))
    assert "moved on" in failed.args[0].message
    # A closed session cannot answer: the status says why and the table stays empty.
    win.client.close_session(session_id)
    view.tokens.setCurrentRow(1)
    with qtbot.waitSignal(win.client.error, timeout=REPLY_TIMEOUT):
        view.features.request(LAYER)
    assert "session is gone" in view.features.status.text()
    assert view.features.table.rowCount() == 0 and view.features.view is None
