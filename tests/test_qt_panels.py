"""The cache monitor and the patch editor on the real default model (SmolLM2), offscreen."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402

from larql_desktop.qt.main_window import MainWindow  # noqa: E402
from larql_desktop.qt.protocol import InsertProgress  # noqa: E402
from larql_desktop.qt.worker import EngineClient  # noqa: E402
from test_qt_app import REPLY_TIMEOUT, loaded, send, settings_file, window  # noqa: E402,F401

INSERT_TIMEOUT = 120_000
PROMPT = "How many legs does a spider have?"


def latest(win):
    return win.monitor.model.latest


def wait_for_stats(qtbot, win, condition):
    """Stats arrive just after the reply that produced them; wait until the monitor's model shows them."""
    qtbot.waitUntil(lambda: latest(win) is not None and condition(latest(win)), timeout=REPLY_TIMEOUT)
    return latest(win)


def test_the_same_prompt_in_a_new_chat_hits_the_shared_l2_and_the_monitor_shows_it(loaded, qtbot):
    _, first = send(qtbot, loaded, PROMPT, max_tokens=12)
    assert first.stats.cache is not None
    assert first.stats.cache.tier("L1")[1] > 0 and first.stats.cache.tier("L2")[0] == 0   # a cold cache
    assert "FFN cache:" in loaded.current_tab().transcript.last.footer
    qtbot.keyClick(loaded.current_tab().input, Qt.Key_N, Qt.ControlModifier)
    _, second = send(qtbot, loaded, PROMPT, max_tokens=12)
    assert second.text == first.text
    l2_hits, l2_misses = second.stats.cache.tier("L2")
    n_layers = loaded.client.model.n_layers
    assert l2_hits == (second.stats.tokens - 1) * n_layers and l2_misses == 0   # every decode lookup
    assert dict(second.stats.cache.bypasses)["prefill"] == n_layers
    footer = loaded.current_tab().transcript.last.footer
    assert f"L2 {l2_hits} hits / 0 misses" in footer and "prefill" in footer

    event = wait_for_stats(qtbot, loaded, lambda e: e.process.tiers["L2"].hits.sum() == l2_hits)
    assert event.session_id == loaded.current_tab().session_id
    assert event.session.tiers["L2"].hits.sum() == l2_hits
    monitor = loaded.monitor
    monitor.refresh(force=True)
    assert monitor.layer_bars["L2 hits"].opts["height"].sum() == l2_hits
    assert monitor.entry_bars["L1"].opts["height"].sum() > 0
    assert monitor.layer_bars["misses"].opts["y0"].sum() > 0          # stacked on the hits
    assert len(monitor.model.hit_rate) > 0
    assert np.nanmax(monitor.model.hit_rate.column("L2")) > 0.5
    assert "All chats" in monitor.summary.text()

    # Regenerating in the same chat finds the reply in its own L1.
    with qtbot.waitSignal(loaded.client.reply_finished, timeout=REPLY_TIMEOUT) as again:
        loaded.regenerate_action.trigger()
    l1_hits, _ = again.args[0].stats.cache.tier("L1")
    assert l1_hits == (again.args[0].stats.tokens - 1) * n_layers


def test_insert_changes_the_probe_and_a_reply_bypasses_exactly_that_layer(loaded, qtbot, tmp_path):
    editor = loaded.patch_editor
    progress = []
    loaded.client.event.connect(lambda e: progress.append(e) if isinstance(e, InsertProgress) else None)
    qtbot.keyClicks(editor.entity, "Atlantis")
    qtbot.keyClicks(editor.relation, "capital-of")
    qtbot.keyClicks(editor.target, "Poseidon")
    assert editor.probe_prompt.text() == "The capital of Atlantis is"   # suggested from the fact
    qtbot.mouseClick(editor.insert_button, Qt.LeftButton)
    assert not editor.insert_button.isEnabled() and editor.progress.isVisible()
    qtbot.waitUntil(lambda: editor.last_insert is not None and not editor.busy, timeout=INSERT_TIMEOUT)
    assert progress and all(0.0 <= p.fraction <= 1.0 for p in progress)
    assert not editor.progress.isVisible() and editor.insert_button.isEnabled()
    layer = editor.last_insert.layer
    probe = editor.last_probe
    assert probe.prompt == "The capital of Atlantis is"
    assert "Poseidon" in probe.patched_text and "Poseidon" not in probe.base_text
    assert probe.patched_probability > 10 * probe.base_probability
    assert editor.probe_table.item(1, 0).text().strip().startswith("Poseidon")
    assert editor.patch_list.topLevelItemCount() == 1
    assert editor.patch_list.topLevelItem(0).text(1) == str(layer)

    # A reply after resetting the statistics: the patched layer alone bypasses the cache.
    loaded.monitor.reset_button.click()
    wait_for_stats(qtbot, loaded, lambda e: e.process.calls == 0)
    _, finished = send(qtbot, loaded, "Tell me about the weather.", max_tokens=8)
    event = wait_for_stats(qtbot, loaded, lambda e: e.process.calls > 0)
    patched = event.process.bypasses["patched"]
    assert patched[layer] == finished.stats.decode_tokens > 0   # every single-token call at that layer
    assert np.flatnonzero(patched).tolist() == [layer]
    assert event.patched_layers == (layer,)
    loaded.monitor.refresh(force=True)
    assert loaded.monitor.patched_bars.opts["x"].tolist() == [layer]
    assert f"patched {patched[layer]}" in loaded.current_tab().transcript.last.footer

    # Save, remove, load back.
    path = tmp_path / "atlantis.json"
    editor.patch_list.setCurrentItem(editor.patch_list.topLevelItem(0))
    editor.save_patch(0, path)
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    assert json.loads(path.read_text())["operations"][0]["target"] == "Poseidon"
    editor.remove_selected()
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    assert editor.patch_list.topLevelItemCount() == 0 and loaded.client.worker.engine.applied_patches == ()
    editor.load_file(path)
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    assert editor.patch_list.topLevelItemCount() == 1
    assert loaded.client.worker.engine.patches.overridden_layers == [layer]


@pytest.mark.parametrize("content, message", [
    ("{ not json", "not valid JSON"),
    ('{"version": 99, "operations": []}', "unsupported patch version"),
])
def test_a_malformed_patch_file_shows_an_error_and_applies_nothing(loaded, qtbot, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    editor = loaded.patch_editor
    with qtbot.waitSignal(loaded.client.error, timeout=REPLY_TIMEOUT) as error:
        editor.load_file(path)
    assert message in error.args[0].message
    assert message in loaded.error_banner.text and loaded.error_banner.isVisible()
    assert message in editor.status.text() and not editor.busy
    assert editor.patch_list.topLevelItemCount() == 0
    assert loaded.client.worker.engine.applied_patches == ()


def test_exports_write_statistics_and_charts(loaded, qtbot, tmp_path):
    send(qtbot, loaded, "Hi!", max_tokens=6)
    wait_for_stats(qtbot, loaded, lambda e: e.process.calls > 0)
    monitor = loaded.monitor
    doc = json.loads(monitor.export_stats(tmp_path / "stats.json").read_text())
    assert doc["process"]["calls"] > 0 and "L2" in doc["process"]["tiers"]
    assert doc["settings"]["walk"]["dense"] is False
    rows = list(csv.reader(monitor.export_stats(tmp_path / "stats.csv").open()))
    assert rows[0][:2] == ["layer", "patched"] and len(rows) == 1 + loaded.client.model.n_layers
    png = monitor.export_charts(tmp_path / "charts.png")
    image = QImage(str(png))
    assert not image.isNull() and image.width() >= 300 and image.height() >= 100


def test_dense_mode_and_refused_settings(loaded, qtbot):
    monitor = loaded.monitor
    monitor.dense.setChecked(True)
    monitor.apply_button.click()
    _, finished = send(qtbot, loaded, "Hi!", max_tokens=4)
    cache = finished.stats.cache
    assert cache.dense_calls > 0 and all(h == m == 0 for _, h, m in cache.tiers)
    assert "dense FFN" in loaded.current_tab().transcript.last.footer
    monitor.dense.setChecked(False)
    monitor.top_k.setValue(100)
    monitor.key_width.setValue(200)          # k' > K: the engine refuses, nothing changes
    with qtbot.waitSignal(loaded.client.error, timeout=REPLY_TIMEOUT) as error:
        monitor.apply_button.click()
    assert "key width" in error.args[0].message and "Cache settings" in loaded.error_banner.text
    assert loaded.client.worker.engine.walk_settings.dense is True


def test_cache_settings_are_remembered(qtbot, qapp, app_paths, settings_file):  # noqa: F811
    def make():
        win = MainWindow(EngineClient(app_paths), QSettings(str(settings_file), QSettings.IniFormat), qapp)
        win.show()
        return win

    win = make()
    try:
        win.monitor.l2.capacity.setValue(1234)
        win.monitor.l1.policy.setCurrentText("lru")
        win.monitor.guard.setValue(0.999)
        win.patch_editor.entity.setText("Atlantis")
    finally:
        win.close()
    again = make()
    try:
        c = again.monitor.cache_settings()
        assert c.l2.capacity == 1234 and c.l1.policy == "lru" and c.walk.cosine_guard == pytest.approx(0.999)
        assert again.patch_editor.entity.text() == "Atlantis"
    finally:
        again.close()


def test_panel_controls_have_accessible_names(window):
    m, p = window.monitor, window.patch_editor
    for widget in (m.charts, m.summary, m.dense, m.top_k, m.key_width, m.guard, m.verify, m.apply_button,
                   m.clear_button, m.reset_button, m.export_stats_button, m.export_charts_button,
                   m.l1.enabled, m.l1.capacity, m.l1.policy, m.l2.enabled, m.l2.capacity, m.l2.policy,
                   p.entity, p.relation, p.target, p.layer, p.alpha, p.insert_button, p.progress, p.probe_prompt,
                   p.probe_button, p.probe_table, p.patch_list, p.remove_button, p.save_button, p.load_button,
                   p.status):
        assert widget.accessibleName(), widget


def test_closing_mid_insert_joins_the_engine_thread(window, qtbot):  # noqa: F811
    with qtbot.waitSignal(window.client.model_loaded, timeout=REPLY_TIMEOUT):
        window.load_model("smollm2")
    editor = window.patch_editor
    progress = []
    window.client.event.connect(lambda e: progress.append(e) if isinstance(e, InsertProgress) else None)
    editor.entity.setText("Atlantis")
    editor.relation.setText("capital-of")
    editor.target.setText("Poseidon")
    editor.insert_button.click()
    qtbot.waitUntil(lambda: len(progress) >= 2, timeout=INSERT_TIMEOUT)
    window.quit_action.trigger()
    assert not window.isVisible() and not window.client.is_running()
