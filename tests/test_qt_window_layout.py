"""The window's layout and the monitor's reach, on the real window and the real SmolLM2, offscreen: at 1280x800 and
1920x1080 the fact probe reads (every column as wide as its header, the continuations in full in the detail pane),
no dock scrolls sideways (also while an INSERT runs), View > Reset layout puts the panels back, the docks keep their
places between launches, and an OpenAI client chatting through the app's server moves the cache monitor."""
from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
openai = pytest.importorskip("openai")

from PySide6.QtCore import QSettings, Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402
from PySide6.QtWidgets import QAbstractScrollArea, QDockWidget, QTabBar  # noqa: E402

from larql_desktop.cli import serve_api  # noqa: E402
from larql_desktop.qt.main_window import MainWindow  # noqa: E402
from larql_desktop.qt.qt_cache_monitor import MIN_TIME_SPAN_S  # noqa: E402
from larql_desktop.qt.protocol import ProbeFact  # noqa: E402
from larql_desktop.qt.qt_patch_editor import FACT_PROBE_COLUMNS, header_text_width  # noqa: E402
from larql_desktop.qt.worker import EngineClient  # noqa: E402
from test_qt_app import REPLY_TIMEOUT, loaded, send, settings_file, window  # noqa: E402,F401
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
    with qtbot.waitSignal(win.client.fact_probed, timeout=REPLY_TIMEOUT) as probed:
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
    with qtbot.waitSignal(win.client.insert_progress, timeout=REPLY_TIMEOUT):
        qtbot.mouseClick(editor.insert_button, Qt.LeftButton)
    assert editor.cancel_button.isVisible() and editor.progress.isVisible()
    win.app.processEvents()
    assert not editor.scroll.horizontalScrollBar().isVisible()
    cancel = editor.cancel_button.mapTo(editor.scroll.viewport(), editor.cancel_button.rect().topRight())
    assert 0 < cancel.x() <= editor.scroll.viewport().width()          # the button is whole, not cut off
    with qtbot.waitSignal(win.client.insert_cancelled, timeout=REPLY_TIMEOUT):
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


MIN_CHART_WIDTH = 250   # px: the six live charts at 1280x800 (beside the settings column they were ~160)


def test_at_1280x800_the_monitor_charts_have_the_docks_width_and_its_settings_a_tab(loaded, qtbot, tmp_path):
    win, monitor = loaded, loaded.monitor
    win.resize(1280, 800)
    win.reset_layout()
    qtbot.waitUntil(lambda: (win.width(), win.height()) == (1280, 800))
    send(qtbot, win, "Hi!", max_tokens=4)                    # one short reply: the case whose axis read 14.6..15.2
    wait_for_stats(qtbot, win, lambda e: e.process.calls > 0)
    monitor.chart_tabs.setCurrentWidget(monitor.charts)
    monitor.refresh(force=True)
    win.app.processEvents()
    live = (monitor.hit_plot, monitor.latency_plot, monitor.fidelity_plot, monitor.layer_plot,
            monitor.entries_plot, monitor.memory_plot)
    widths = [round(plot.boundingRect().width()) for plot in live]
    assert min(widths) >= MIN_CHART_WIDTH, widths
    # The time axis: seconds since the model loaded, at least MIN_TIME_SPAN_S wide, ticks on whole seconds, and
    # the three time charts share it.
    lo, hi = monitor.hit_plot.vb.viewRange()[0]
    assert hi - lo >= MIN_TIME_SPAN_S and lo <= monitor.model.hit_rate.t[0] and hi >= monitor.model.hit_rate.t[-1]
    for plot in live[1:3]:
        assert plot.vb.viewRange()[0] == pytest.approx([lo, hi])
    axis = monitor.hit_plot.getAxis("bottom")
    ticks = [v for _, values in axis.tickValues(lo, hi, axis.width()) for v in values]
    assert ticks and all(float(v).is_integer() for v in ticks), ticks

    # The settings and actions: a tab of the monitor, reached by its tab, whole and working.
    tab_bar = monitor.chart_tabs.findChild(QTabBar)
    settings_tab = monitor.chart_tabs.indexOf(monitor.settings_page)
    qtbot.mouseClick(tab_bar, Qt.LeftButton, pos=tab_bar.tabRect(settings_tab).center())
    assert monitor.chart_tabs.currentWidget() is monitor.settings_page
    win.app.processEvents()
    for widget in (monitor.dense, monitor.top_k, monitor.key_width, monitor.guard, monitor.verify,
                   monitor.near_fraction, monitor.near_tau, monitor.l1.capacity, monitor.l2.policy,
                   monitor.apply_button, monitor.reset_button, monitor.clear_button, monitor.export_stats_button,
                   monitor.export_charts_button):
        assert widget.isVisible() and widget.isEnabled(), widget.accessibleName()
    assert not monitor.controls_area.horizontalScrollBar().isVisible()
    monitor.verify.setValue(0.25)
    qtbot.mouseClick(monitor.apply_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.client.worker.engine.walk_settings.verify_fraction == 0.25, timeout=REPLY_TIMEOUT)
    # "Export charts" from the settings tab saves the chart view shown last (the live charts), not the form.
    image = QImage(str(monitor.export_charts(tmp_path / "charts.png")))
    assert monitor.chart_view is monitor.charts
    assert image.convertToFormat(QImage.Format_RGB32) == monitor.charts.grab().toImage().convertToFormat(
        QImage.Format_RGB32)
