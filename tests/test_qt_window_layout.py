"""The window's layout and the monitor's reach, on the real window and the real SmolLM2, offscreen: at 1280x800 and
1920x1080 the fact probe reads (every column as wide as its header, the continuations in full in the detail pane),
no dock scrolls sideways (also while an INSERT runs), View > Reset layout puts the panels back, the docks keep their
places between launches, and an OpenAI client chatting through the app's server moves the cache monitor."""
from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
openai = pytest.importorskip("openai")

from PySide6.QtCore import QSettings, Qt  # noqa: E402
from PySide6.QtWidgets import QAbstractScrollArea, QDockWidget  # noqa: E402

from larql_desktop.cli import serve_api  # noqa: E402
from larql_desktop.qt.main_window import MainWindow  # noqa: E402
from larql_desktop.qt.protocol import FactProbed, InsertCancelled, InsertProgress, ProbeFact  # noqa: E402
from larql_desktop.qt.qt_patch_editor import FACT_PROBE_COLUMNS, header_text_width  # noqa: E402
from larql_desktop.qt.worker import EngineClient  # noqa: E402
from test_qt_app import REPLY_TIMEOUT, loaded, settings_file, window  # noqa: E402,F401
from test_qt_panels import wait_for_stats  # noqa: E402

SIZES = ((1280, 800), (1920, 1080))
PARAPHRASES = ("Atlantis has its capital at",)


def sideways_scrolled(win) -> list[str]:
    """Each dock raised in turn: the scroll areas in it showing a horizontal scroll bar."""
    found = []
    for dock in win.findChildren(QDockWidget):
        dock.raise_()
        win.app.processEvents()
        for area in dock.findChildren(QAbstractScrollArea):
            if area.isVisible() and area.horizontalScrollBar().isVisible():
                found.append(f"{dock.windowTitle()}: {area.accessibleName() or type(area).__name__}")
    return found


def narrow_fact_columns(editor) -> list[str]:
    header = editor.fact_table.horizontalHeader()
    return [f"{name} {header.sectionSize(c)} px" for c, name in enumerate(FACT_PROBE_COLUMNS)
            if header.sectionSize(c) < header_text_width(header, name)]


def test_at_1280x800_and_1920x1080_the_fact_probe_reads_and_nothing_scrolls_sideways(loaded, qtbot):
    win, editor = loaded, loaded.patch_editor
    # A real fact probe of a fact (no INSERT needed: before and after are then the same continuations).
    editor.last_fact = ProbeFact(0, "Atlantis", "capital-of", "Poseidon", PARAPHRASES)
    editor._update_enabled()
    with qtbot.waitSignal(win.client.event, timeout=REPLY_TIMEOUT,
                          check_params_cb=lambda e: isinstance(e, FactProbed)) as probed:
        qtbot.mouseClick(editor.fact_probe_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    rows = probed.args[0].rows
    assert len(rows) >= 3 and editor.fact_table.rowCount() == len(rows)   # any number of rows, all shown
    assert [editor.fact_table.item(r, 1).text() for r in range(len(rows))] == [" ".join(r.prompt.split("\n"))
                                                                              for r in rows]
    for width, height in SIZES:
        win.resize(width, height)
        win.reset_layout()
        qtbot.waitUntil(lambda: win.width() == width and win.height() == height)
        assert sideways_scrolled(win) == []
        win.patch_editor_dock.raise_()
        win.app.processEvents()
        assert editor.isVisible() and narrow_fact_columns(editor) == []
        # The detail pane has the selected row's prompt and both continuations, whole.
        for r in (0, len(rows) - 1):
            editor.fact_table.selectRow(r)
            shown = " ".join(editor.fact_detail_text.split())
            for text in (rows[r].prompt, rows[r].before, rows[r].after):
                assert " ".join(text.split()) in shown

    # While an INSERT runs (progress bar, message, Cancel button), the patch editor still fits its dock.
    win.resize(*SIZES[0])
    win.reset_layout()
    win.patch_editor_dock.raise_()
    editor.entity.setText("Atlantis")
    editor.relation.setText("capital-of")
    editor.target.setText("Poseidon")
    with qtbot.waitSignal(win.client.event, timeout=REPLY_TIMEOUT,
                          check_params_cb=lambda e: isinstance(e, InsertProgress)):
        qtbot.mouseClick(editor.insert_button, Qt.LeftButton)
    assert editor.cancel_button.isVisible() and editor.progress.isVisible()
    win.app.processEvents()
    assert not editor.scroll.horizontalScrollBar().isVisible()
    cancel = editor.cancel_button.mapTo(editor.scroll.viewport(), editor.cancel_button.rect().topRight())
    assert 0 < cancel.x() <= editor.scroll.viewport().width()          # the button is whole, not cut off
    with qtbot.waitSignal(win.client.event, timeout=REPLY_TIMEOUT,
                          check_params_cb=lambda e: isinstance(e, InsertCancelled)):
        qtbot.mouseClick(editor.cancel_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)


def test_docks_keep_their_places_between_launches_and_reset_layout_restores_them(qtbot, qapp, app_paths,
                                                                                settings_file):  # noqa: F811
    def open_window() -> MainWindow:
        win = MainWindow(EngineClient(app_paths, threads=1), QSettings(str(settings_file), QSettings.IniFormat),
                         qapp)
        win.show()
        return win

    win = open_window()
    try:
        assert win.dockWidgetArea(win.monitor_dock) == Qt.BottomDockWidgetArea
        win.addDockWidget(Qt.LeftDockWidgetArea, win.token_dock)      # the user moves one and hides another
        win.chats_dock.hide()
        assert win.dockWidgetArea(win.token_dock) == Qt.LeftDockWidgetArea
    finally:
        win.close()
    win = open_window()
    try:
        assert win.dockWidgetArea(win.token_dock) == Qt.LeftDockWidgetArea and win.chats_dock.isHidden()
        view_menu = next(a.menu() for a in win.menuBar().actions() if a.text() == "&View")
        assert win.reset_layout_action in view_menu.actions()
        win.reset_layout_action.trigger()
        assert win.dockWidgetArea(win.token_dock) == Qt.RightDockWidgetArea and not win.chats_dock.isHidden()
        assert win.tabifiedDockWidgets(win.patch_editor_dock)                # tabbed with the other right panels
        assert win.dockWidgetArea(win.monitor_dock) == Qt.BottomDockWidgetArea
    finally:
        win.close()


def test_an_openai_request_through_the_apps_server_refreshes_the_monitor(loaded, qtbot):
    win = loaded
    win.server_port.setValue(0)
    win.serve_box.setChecked(True)
    qtbot.waitUntil(lambda: win.server.url is not None, timeout=30_000)
    idle_calls = wait_for_stats(qtbot, win, lambda e: True).process.calls
    client = openai.OpenAI(base_url=f"{win.server.url}/v1", api_key="any", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                           max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens >= 1
    # The window sat idle: only the engine's activity event can have asked for this snapshot.
    event = wait_for_stats(qtbot, win, lambda e: e.process.calls > idle_calls)
    assert event.process.calls == win.client.worker.engine.snapshot().calls
