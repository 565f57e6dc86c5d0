"""The Qt app on the real default model (SmolLM2), offscreen: loading, streaming, stopping, tabs, errors, closing."""
from __future__ import annotations

import gc
import sys
import time

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QObject, QSettings, Qt, Signal  # noqa: E402

from larql_desktop.cli import serve_api  # noqa: E402
from larql_desktop.engine.catalog import DEFAULT_MODEL, PACKAGED_MODELS  # noqa: E402
from larql_desktop.qt.main_window import MainWindow  # noqa: E402
from larql_desktop.qt.qt_chat_tab import markdown_as_plain_text  # noqa: E402
from larql_desktop.qt.reply_stats import COMPLETE, LENGTH, STOPPED  # noqa: E402
from larql_desktop.qt.transcript import ASSISTANT, NOTICE, USER  # noqa: E402
from larql_desktop.qt.worker import EngineClient  # noqa: E402

LOAD_TIMEOUT = 180_000    # ms; a first load exports ONNX files
REPLY_TIMEOUT = 120_000


@pytest.fixture
def settings_file(tmp_path):
    return tmp_path / "settings.ini"


@pytest.fixture
def window(qtbot, qapp, app_paths, settings_file, capture_store):
    """A shown window with its own engine thread; closed and joined at the end whatever the test did."""
    # As run_app wires it, INSERT's passes in the app's store (the run's one: capture_store).
    client = EngineClient(app_paths, threads=2, serve=serve_api, capture_store=capture_store)
    win = MainWindow(client, QSettings(str(settings_file), QSettings.IniFormat), qapp)
    win.show()
    win.activateWindow()   # shortcuts fire only in the active window
    try:
        yield win
    finally:
        win.close()
        assert not client.is_running()
        win.deleteLater()


@pytest.fixture
def loaded(window, qtbot):
    with qtbot.waitSignal(window.client.model_loaded, timeout=LOAD_TIMEOUT):
        window.load_model(DEFAULT_MODEL)
    return window


def send(qtbot, win, text: str, max_tokens: int = 24):
    """Type a prompt, press Ctrl+Return and wait for the reply to finish; returns (tokens, ReplyFinished)."""
    win.sampling.max_tokens.setValue(max_tokens)
    tab = win.current_tab()
    tab.input.setPlainText(text)
    tokens = []
    win.client.token.connect(tokens.append)
    try:
        with qtbot.waitSignal(win.client.reply_finished, timeout=REPLY_TIMEOUT) as finished:
            qtbot.keyClick(tab.input, Qt.Key_Return, Qt.ControlModifier)
    finally:
        win.client.token.disconnect(tokens.append)
    return tokens, finished.args[0]


def test_window_opens_and_loads_the_default_model(window, qtbot):
    progress = []
    window.client.load_progress.connect(lambda message, fraction: progress.append(fraction))
    assert not window.send_action.isEnabled()          # nothing to talk to yet
    assert not window.windowIcon().isNull()            # the packaged icon, read through importlib.resources
    with qtbot.waitSignal(window.client.model_loaded, timeout=LOAD_TIMEOUT) as loaded_signal:
        window.load_model(DEFAULT_MODEL)
        assert window.progress.isVisible()
        assert not window.model_picker.isEnabled()
    info = loaded_signal.args[0]
    assert info.key == DEFAULT_MODEL and info.packaged and info.is_chat
    assert progress and progress[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in progress)
    assert not window.progress.isVisible()
    assert window.model_picker.currentData() == DEFAULT_MODEL
    assert PACKAGED_MODELS[DEFAULT_MODEL].display_name in window.model_label.text()
    assert window.send_action.isEnabled() and not window.stop_action.isEnabled()
    assert not window.regenerate_action.isEnabled()
    assert window.error_banner.text == ""


def test_prompt_streams_a_reply_with_a_stats_line(loaded, qtbot):
    tokens, finished = send(qtbot, loaded, "Name three colours.")
    tab = loaded.current_tab()
    assert tokens and tokens[0].index == 0 and all(t.session_id == tab.session_id for t in tokens)
    assert finished.stats.outcome in (COMPLETE, LENGTH)
    assert finished.stats.tokens == sum(not t.is_stop for t in tokens)
    roles = [turn.role for turn in tab.transcript.turns]
    assert roles == [USER, ASSISTANT]
    reply = tab.transcript.turns[1]
    assert reply.text.strip() and reply.text == finished.text
    assert "tok/s" in reply.footer and f"{finished.stats.tokens} token" in reply.footer
    shown = tab.view.toPlainText()
    # Replies are rendered as Markdown (this one is a numbered list): the view shows the rendered text.
    assert "Name three colours." in shown and markdown_as_plain_text(reply.text).strip() in shown
    assert reply.footer in shown
    assert tab.input.toPlainText() == ""               # the draft went out
    assert loaded.send_action.isEnabled() and loaded.regenerate_action.isEnabled()
    assert not loaded.stop_action.isEnabled()


def test_tokens_reach_the_window_in_batches_all_of_them_in_order(loaded, qtbot):
    """The engine thread sends a streaming reply's tokens in batches at most every TOKEN_BATCH_INTERVAL (the
    first at once, the rest held until then or until the reply ends); the client re-emits every one of them, in
    order, and the view shows the whole reply."""
    batches = []     # appended in the engine thread as it emits
    loaded.client.worker.tokens.connect(batches.append)
    tokens, finished = send(qtbot, loaded, "Write four sentences about the moon.", max_tokens=48)
    sent = [event for batch in batches for event in batch]
    # (How many batches a reply takes depends on the host's speed: a timing fact, measured by `bench`, not here.)
    assert len(sent) == len(tokens) >= 20 and len(batches) <= len(sent) and all(batches)
    assert [e.index for e in sent] == list(range(len(sent))) == [e.index for e in tokens]
    assert [e.token_id for e in sent] == [e.token_id for e in tokens]
    assert len(batches[0]) == 1                        # the first token is not held back
    assert finished.text and loaded.current_tab().transcript.last.text == finished.text


def test_stop_ends_a_long_reply_after_a_few_tokens(loaded, qtbot):
    loaded.sampling.max_tokens.setValue(2000)
    tab = loaded.current_tab()
    tab.input.setPlainText("Write a very long story about a dragon who learns to paint.")
    tokens = []
    loaded.client.token.connect(tokens.append)
    loaded.send_action.trigger()
    qtbot.waitUntil(lambda: len(tokens) >= 3, timeout=REPLY_TIMEOUT)
    assert loaded.stop_action.isEnabled() and not loaded.send_action.isEnabled()
    with qtbot.waitSignal(loaded.client.reply_finished, timeout=REPLY_TIMEOUT) as finished:
        qtbot.keyClick(tab.input, Qt.Key_Escape)
    stats = finished.args[0].stats
    assert stats.outcome == STOPPED
    assert 3 <= stats.tokens < 200                     # stopped long before max tokens
    assert "stopped" in tab.transcript.last.footer
    assert loaded.send_action.isEnabled() and not loaded.stop_action.isEnabled()
    # The stopped reply stays in the conversation, and the chat goes on from it.
    session = loaded.client.worker.sessions[tab.session_id]
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    _, again = send(qtbot, loaded, "Now summarise it in one sentence.", max_tokens=12)
    assert again.stats.outcome in (COMPLETE, LENGTH)
    assert [turn.role for turn in tab.transcript.turns] == [USER, ASSISTANT, USER, ASSISTANT]


def test_regenerate_replaces_the_last_reply(loaded, qtbot):
    send(qtbot, loaded, "Say hello.", max_tokens=8)
    tab = loaded.current_tab()
    loaded.sampling.temperature.setValue(0.9)
    loaded.sampling.seed.setValue(7)
    with qtbot.waitSignal(loaded.client.reply_finished, timeout=REPLY_TIMEOUT) as finished:
        qtbot.keyClick(tab.input, Qt.Key_R, Qt.ControlModifier)
    assert [turn.role for turn in tab.transcript.turns] == [USER, ASSISTANT]
    assert tab.transcript.last.text == finished.args[0].text
    assert tab.view.toPlainText().count("Say hello.") == 1


def test_a_second_chat_tab_is_independent(loaded, qtbot):
    first = loaded.current_tab()
    send(qtbot, loaded, "My name is Ada. Reply with one word.", max_tokens=8)
    qtbot.keyClick(first.input, Qt.Key_N, Qt.ControlModifier)
    second = loaded.current_tab()
    assert second is not first and loaded.tabs.count() == 2
    assert second.transcript.turns == [] and second.view.toPlainText() == ""
    assert not loaded.regenerate_action.isEnabled()    # nothing to regenerate in the new chat
    send(qtbot, loaded, "What is the capital of France?", max_tokens=8)
    assert [t.text for t in first.transcript.turns if t.role == USER] == ["My name is Ada. Reply with one word."]
    assert [t.text for t in second.transcript.turns if t.role == USER] == ["What is the capital of France?"]
    sessions = loaded.client.worker.sessions
    assert sessions[first.session_id] is not sessions[second.session_id]
    assert sessions[second.session_id].messages[0]["content"] == "What is the capital of France?"
    assert len(sessions[first.session_id].messages) == len(sessions[second.session_id].messages) == 2
    loaded.close_chat(loaded.tabs.indexOf(second))
    assert loaded.chat_tabs() == [first]


def test_empty_prompt_shows_an_error_and_changes_nothing(loaded, qtbot):
    tab = loaded.current_tab()
    tab.input.setPlainText("   ")
    with qtbot.waitSignal(loaded.client.error, timeout=REPLY_TIMEOUT) as error:
        loaded.send_action.trigger()
    assert "empty" in error.args[0].message
    assert "empty" in loaded.error_banner.text and loaded.error_banner.isVisible()
    assert tab.transcript.turns == [] and tab.view.toPlainText() == ""
    assert tab.input.toPlainText() == "   "
    assert loaded.client.worker.sessions[tab.session_id].messages == []
    assert loaded.send_action.isEnabled() and not loaded.stop_action.isEnabled()
    # The next good prompt clears the error.
    send(qtbot, loaded, "Hi!", max_tokens=4)
    assert loaded.error_banner.text == ""


def test_a_bad_model_path_is_reported_and_the_old_model_stays(loaded, qtbot, tmp_path):
    missing = tmp_path / "missing.gguf"
    with qtbot.waitSignal(loaded.client.error, timeout=LOAD_TIMEOUT) as error:
        loaded.load_model(str(missing))
    assert "no such GGUF file" in error.args[0].message and "no such GGUF file" in loaded.error_banner.text
    assert not loaded.progress.isVisible() and loaded.model_picker.isEnabled()
    assert loaded.model_picker.currentData() == DEFAULT_MODEL
    assert loaded.client.model.key == DEFAULT_MODEL and loaded.send_action.isEnabled()


def test_reloading_a_model_starts_the_chats_afresh(loaded, qtbot):
    send(qtbot, loaded, "Hello!", max_tokens=4)
    tab = loaded.current_tab()
    with qtbot.waitSignal(loaded.client.model_loaded, timeout=LOAD_TIMEOUT):
        loaded.load_model(DEFAULT_MODEL)
    assert tab.transcript.last.role == NOTICE
    assert loaded.client.worker.sessions == {}


def test_closing_mid_reply_joins_the_engine_thread(window, qtbot, settings_file):
    with qtbot.waitSignal(window.client.model_loaded, timeout=LOAD_TIMEOUT):
        window.load_model(DEFAULT_MODEL)
    window.sampling.max_tokens.setValue(2000)
    window.current_tab().input.setPlainText("Count from one to one thousand in words.")
    tokens = []
    window.client.token.connect(tokens.append)
    window.send_action.trigger()
    qtbot.waitUntil(lambda: len(tokens) >= 2, timeout=REPLY_TIMEOUT)
    qtbot.keyClick(window.current_tab().input, Qt.Key_Q, Qt.ControlModifier)   # Quit
    assert not window.isVisible()
    assert not window.client.is_running()
    saved = QSettings(str(settings_file), QSettings.IniFormat)
    assert saved.value("window/geometry") is not None
    assert int(saved.value("sampling/max_tokens")) == 2000


def test_theme_and_settings_are_remembered(qtbot, qapp, app_paths, settings_file):
    def make():
        client = EngineClient(app_paths, serve=serve_api)
        win = MainWindow(client, QSettings(str(settings_file), QSettings.IniFormat), qapp)
        win.show()
        return win

    win = make()
    try:
        win.set_dark_theme(True)
        assert qapp.palette().window().color().lightness() < 100
        win.sampling.top_p.setValue(0.8)
        win.resize(760, 560)   # above the panels' minimum (squeezed to it, a window may not restore exactly), below
            # the offscreen screen (800x600)
        qtbot.waitUntil(lambda: win.width() == 760)
    finally:
        win.close()
    again = make()
    try:
        assert again.dark_theme_action.isChecked()
        assert again.sampling.settings().top_p == pytest.approx(0.8)
        assert again.size() == win.size()
    finally:
        again.set_dark_theme(False)
        again.close()
        assert not again.client.is_running()


def test_controls_have_accessible_names(window):
    for widget in (window.model_picker, window.tabs, window.progress, window.current_tab().input,
                   window.current_tab().view, window.sampling.max_tokens, window.sampling.temperature,
                   window.sampling.top_p, window.sampling.seed, *window.current_tab().buttons):
        assert widget.accessibleName(), widget


class _Emitter(QObject):
    value = Signal(object)


def test_signal_emits_keep_refcounts_stable(qtbot):
    """Guards against a PySide6 build that corrupts refcounts (6.12.0 on Python 3.11 crashes with none_dealloc)."""
    emitter = _Emitter()
    received = []
    emitter.value.connect(received.append)
    gc.collect()
    before = sys.getrefcount(None), sys.getrefcount(True)
    for _ in range(200):
        emitter.value.emit(None)
        emitter.value.emit(True)
    received.clear()
    gc.collect()
    after = sys.getrefcount(None), sys.getrefcount(True)
    assert abs(after[0] - before[0]) < 50 and abs(after[1] - before[1]) < 50, (before, after)


def test_run_app_loads_the_model_and_quits(qapp, app_paths):
    """The CLI's entry point: builds everything, loads args.model, runs until the window closes."""
    import argparse

    from PySide6.QtCore import QTimer

    from larql_desktop.qt.app import LOG_FILE, SETTINGS_FILE, run_app

    seen = {}
    deadline = time.monotonic() + LOAD_TIMEOUT / 1000

    def poll():
        windows = [w for w in qapp.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if windows and (windows[0].client.model is not None or time.monotonic() > deadline):
            seen["model"] = windows[0].client.model.key if windows[0].client.model else None
            seen["client"] = windows[0].client
            seen["l3"] = windows[0].client.worker.engine.l3 if windows[0].client.worker.engine else None
            seen["captures"] = (windows[0].client.worker.engine.capture_store
                                if windows[0].client.worker.engine else None)
            seen["banner"] = windows[0].error_banner.text
            windows[0].quit_action.trigger()   # Ctrl+Q's action
        else:
            QTimer.singleShot(50, poll)

    QTimer.singleShot(0, poll)
    assert run_app(argparse.Namespace(model=DEFAULT_MODEL, threads=2, verbose=False)) == 0
    assert seen["model"] == DEFAULT_MODEL and not seen["client"].is_running()
    # The persistent L3 is on by default, in the user cache dir (under LARQL_DESKTOP_HOME), and closed on exit.
    from larql_desktop.engine.cache.l3 import SqliteL3, default_l3_path

    store = seen["l3"]
    assert isinstance(store, SqliteL3) and store.settings.enabled and seen["banner"] == ""
    assert store.path == default_l3_path(app_paths) and store.path.is_relative_to(app_paths.cache)
    assert store.path.is_file() and store._conn is None
    # INSERT's capture store too: in the user cache dir, given to the engine, closed on exit.
    captures = seen["captures"]
    assert captures is not None and captures.path == app_paths.insert_captures and captures.path.is_file()
    assert not captures.enabled
    assert (app_paths.config / SETTINGS_FILE).is_file()
    assert "loaded" in (app_paths.log / LOG_FILE).read_text()
