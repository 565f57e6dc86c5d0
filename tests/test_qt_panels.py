"""The cache monitor and the patch editor on the real default model (SmolLM2), offscreen."""
from __future__ import annotations

import csv
import json
import socket

import httpx
import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QEvent, QObject, QSettings, Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from larql_desktop.qt import qt_cache_monitor  # noqa: E402
from larql_desktop.qt.main_window import MainWindow  # noqa: E402
from larql_desktop.engine.patches.applied import AppliedPatchStore  # noqa: E402
from larql_desktop.qt.worker import EngineClient  # noqa: E402
from larql_desktop.cli import serve_api  # noqa: E402
from larql_desktop.engine.catalog import DEFAULT_MODEL  # noqa: E402
from larql_desktop.engine.model.overlay import encode_vector  # noqa: E402
from larql_desktop.qt.app import open_persistent_cache  # noqa: E402
from test_qt_app import LOAD_TIMEOUT, REPLY_TIMEOUT, loaded, send, settings_file, window  # noqa: E402,F401

INSERT_TIMEOUT = 600_000   # an insert runs many forward passes; the shared 2-core machine is slow
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
    # The KV prefix cache's figures beside the FFN tiers: both chats' prompts asked it, as the engine counts them.
    prefix = event.prefix_cache
    assert prefix is not None and prefix.lookups >= 2 and prefix.hits + prefix.misses == prefix.lookups
    assert prefix.max_bytes == loaded.client.worker.engine.prefix_cache.max_bytes
    assert qt_cache_monitor.prefix_cache_text(prefix) in monitor.summary.text()
    assert f"{prefix.reused_tokens} token{'' if prefix.reused_tokens == 1 else 's'} reused" in monitor.summary.text()

    # Regenerating in the same chat finds the reply in its own L1.
    with qtbot.waitSignal(loaded.client.reply_finished, timeout=REPLY_TIMEOUT) as again:
        loaded.regenerate_action.trigger()
    l1_hits, _ = again.args[0].stats.cache.tier("L1")
    assert l1_hits == (again.args[0].stats.tokens - 1) * n_layers


def test_insert_changes_the_probe_and_a_reply_bypasses_exactly_that_layer(loaded, qtbot, tmp_path):
    editor = loaded.patch_editor
    progress = []
    loaded.client.insert_progress.connect(lambda e: progress.append(e))
    qtbot.keyClicks(editor.entity, "Atlantis")
    qtbot.keyClicks(editor.relation, "capital-of")
    qtbot.keyClicks(editor.target, "Poseidon")
    assert editor.probe_prompt.text() == "The capital of Atlantis is"   # suggested from the fact
    qtbot.mouseClick(editor.insert_button, Qt.LeftButton)
    assert not editor.insert_button.isEnabled() and editor.progress.isVisible()
    qtbot.waitUntil(lambda: editor.last_insert is not None and not editor.busy, timeout=INSERT_TIMEOUT)
    assert progress and all(0.0 <= p.fraction <= 1.0 for p in progress)
    assert not editor.progress.isVisible() and editor.insert_button.isEnabled()
    # An insert may write several layers (one or more features per target token): all of them are patched.
    layers = loaded.client.worker.engine.patches.overridden_layers
    assert editor.last_insert.layer in layers
    probe = editor.last_probe
    assert probe.prompt == "The capital of Atlantis is"
    assert "Poseidon" in probe.patched_text and "Poseidon" not in probe.base_text
    assert probe.patched_probability > 10 * probe.base_probability
    assert editor.probe_table.item(1, 0).text().strip().startswith("Poseidon")
    assert editor.patch_list.topLevelItemCount() == 1
    assert editor.patch_list.topLevelItem(0).text(1) == ", ".join(map(str, layers))

    # A reply after resetting the statistics: the patched layer alone bypasses the cache.
    loaded.monitor.reset_button.click()
    wait_for_stats(qtbot, loaded, lambda e: e.process.calls == 0)
    _, finished = send(qtbot, loaded, "Tell me about the weather.", max_tokens=8)
    # Snapshots stream during the reply (at most every 0.1 s); wait for the one that covers all of it.
    every_call = (finished.stats.decode_tokens + 1) * loaded.client.model.n_layers   # prefill + decode calls
    event = wait_for_stats(qtbot, loaded, lambda e: e.process.calls >= every_call)
    patched = event.process.bypasses["patched"]
    assert all(patched[layer] == finished.stats.decode_tokens > 0 for layer in layers)   # every single-token call
    assert np.flatnonzero(patched).tolist() == layers
    assert event.patched_layers == tuple(layers)
    loaded.monitor.refresh(force=True)
    assert loaded.monitor.patched_bars.opts["x"].tolist() == layers
    assert f"patched {int(patched.sum())}" in loaded.current_tab().transcript.last.footer

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
    assert loaded.client.worker.engine.patches.overridden_layers == layers


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
        win = MainWindow(EngineClient(app_paths, serve=serve_api), QSettings(str(settings_file), QSettings.IniFormat), qapp)
        win.show()
        return win

    win = make()
    try:
        win.monitor.l2.capacity.setValue(1234)
        win.monitor.l1.policy.setCurrentText("lru")
        win.monitor.guard.setValue(0.999)
        win.monitor.l3_max_mb.setValue(64)
        win.monitor.l3_fp16.setChecked(True)
        win.patch_editor.entity.setText("Atlantis")
        win.server_port.setValue(9876)
        win.serve_box.setChecked(True)     # no model yet: nothing is served
        assert win.server.url is None and not win.server.starting
        assert win.serve_action.isChecked() and "waits for a model" in win.server_label.text()
    finally:
        win.close()
    again = make()
    try:
        c = again.monitor.cache_settings()
        assert c.l2.capacity == 1234 and c.l1.policy == "lru" and c.walk.cosine_guard == pytest.approx(0.999)
        assert c.l3.max_bytes == 64 << 20 and c.l3.dtype == "float16" and c.l3.enabled
        assert again.patch_editor.entity.text() == "Atlantis"
        # Serving resumes (once a model loads) because it was on when the app closed.
        assert again.serve_action.isChecked() and again.serve_box.isChecked()
        assert again.server_port.value() == 9876
        assert not again.monitor.l3_enabled.isEnabled()   # this window's client has no L3 store
    finally:
        again.close()


def test_panel_controls_have_accessible_names(window):
    m, p = window.monitor, window.patch_editor
    for widget in (m.charts, m.summary, m.dense, m.top_k, m.key_width, m.guard, m.verify, m.apply_button,
                   m.clear_button, m.reset_button, m.export_stats_button, m.export_charts_button,
                   m.l1.enabled, m.l1.capacity, m.l1.policy, m.l2.enabled, m.l2.capacity, m.l2.policy,
                   m.l3_enabled, m.l3_max_mb, m.l3_fp16, m.l3_where, m.clear_l3_button,
                   window.serve_box, window.server_port, window.server_label,
                   p.entity, p.relation, p.target, p.layer, p.alpha, p.insert_button, p.progress, p.probe_prompt,
                   p.probe_button, p.probe_table, p.patch_list, p.remove_button, p.save_button, p.load_button,
                   p.status):
        assert widget.accessibleName(), widget


def test_closing_mid_insert_joins_the_engine_thread(window, qtbot):  # noqa: F811
    with qtbot.waitSignal(window.client.model_loaded, timeout=REPLY_TIMEOUT):
        window.load_model("smollm2")
    editor = window.patch_editor
    progress = []
    window.client.insert_progress.connect(lambda e: progress.append(e))
    editor.entity.setText("Atlantis")
    editor.relation.setText("capital-of")
    editor.target.setText("Poseidon")
    editor.insert_button.click()
    qtbot.waitUntil(lambda: len(progress) >= 2, timeout=INSERT_TIMEOUT)
    window.quit_action.trigger()
    assert not window.isVisible() and not window.client.is_running()


def test_the_persistent_l3_is_attached_and_serves_a_repeated_prompt_after_a_restart(qtbot, qapp, app_paths,
                                                                                   settings_file):  # noqa: F811
    """The app's own L3 (open_persistent_cache, as run_app opens it): a new window and engine thread on the same
    home find the first window's FFN outputs on disk."""
    def start():
        store, warning = open_persistent_cache(app_paths)
        assert warning is None and store is not None and store.path.is_relative_to(app_paths.cache)
        win = MainWindow(EngineClient(app_paths, threads=2, l3=store),
                         QSettings(str(settings_file), QSettings.IniFormat), qapp)
        win.show()
        win.activateWindow()
        with qtbot.waitSignal(win.client.model_loaded, timeout=LOAD_TIMEOUT):
            win.load_model(DEFAULT_MODEL)
        return win, store

    win, store = start()
    try:
        assert win.client.worker.engine.l3 is store and win.monitor.l3_enabled.isEnabled()
        store.clear()   # other tests share this home's L3
        _, first = send(qtbot, win, PROMPT, max_tokens=10)
        n_layers = win.client.model.n_layers
        lookups = (first.stats.tokens - 1) * n_layers
        assert first.stats.cache.tier("L3") == (0, lookups)               # missed, and written back
        event = wait_for_stats(qtbot, win, lambda e: e.process.tiers["L3"].entries.sum() >= lookups)
        assert event.l3_status["backend"] == "sqlite" and event.settings.l3.enabled
        assert event.process.full_misses.sum() == lookups                 # every lookup computed the FFN
        win.monitor.refresh(force=True)
        assert win.monitor.entry_bars["L3"].opts["height"].sum() >= lookups
        assert win.monitor.layer_bars["misses"].opts["height"].sum() == lookups
        assert "L3 (on, sqlite)" in win.monitor.summary.text()
    finally:
        win.close()
        store.close()
    assert not win.client.is_running()

    win, store = start()
    try:
        win.new_chat()   # the first window's chat reopened with the app; the repeat goes to a fresh chat
        _, second = send(qtbot, win, PROMPT, max_tokens=10)
        assert second.text == first.text
        cache = second.stats.cache
        assert cache.tier("L3") == (lookups, 0)                           # every decode lookup, from disk
        assert cache.tier("L1") == cache.tier("L2") == (0, lookups)
        event = wait_for_stats(qtbot, win, lambda e: e.process.tiers["L3"].hits.sum() == lookups)
        assert event.process.full_misses.sum() == 0
        monitor = win.monitor
        monitor.refresh(force=True)
        assert monitor.layer_bars["L3 hits"].opts["height"].sum() == lookups
        assert monitor.layer_bars["misses"].opts["height"].sum() == 0
        assert np.nanmax(monitor.model.hit_rate.column("L3")) > 0.5
        assert "L3 (on, sqlite)" in monitor.summary.text() and "L3 100%" in monitor.summary.text()

        # Turning L3 off: the next chat neither reads nor writes it.
        monitor.l3_enabled.setChecked(False)
        monitor.apply_button.click()
        qtbot.keyClick(win.current_tab().input, Qt.Key_N, Qt.ControlModifier)
        _, third = send(qtbot, win, "Name a colour.", max_tokens=6)
        assert third.stats.cache.tier("L3") == (0, 0) and not store.settings.enabled
        monitor.l3_enabled.setChecked(True)
        monitor.apply_button.click()

        # Clearing the persistent cache empties the file's table.
        monitor.clear_l3_button.click()
        wait_for_stats(qtbot, win, lambda e: e.process.tiers["L3"].entries.sum() == 0
                       and e.process.tiers["L2"].entries.sum() == 0)
        assert store.total_bytes() == 0 and store.settings.enabled
    finally:
        win.close()
        store.close()
    assert not win.client.is_running()


def test_a_broken_l3_location_is_a_warning_and_the_app_runs_without_it(app_paths, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    store, warning = open_persistent_cache(app_paths, f"sqlite:{blocker / 'l3.sqlite3'}")
    try:
        assert warning and "L3" in warning
    finally:
        if store is not None:
            store.close()
    store, warning = open_persistent_cache(app_paths, "nonsense")
    assert store is None and "could not be opened" in warning
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"this is not a database" * 100)
    store, warning = open_persistent_cache(app_paths, f"sqlite:{corrupt}")
    try:
        assert store is not None and "moved aside" in warning
        assert (tmp_path / "corrupt.sqlite3.corrupt").is_file()
    finally:
        store.close()


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/v1/health", timeout=2.0)
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError):
        # Accepted while shutting down, then closed unanswered or reset: not gone yet, ask again.
        return False
    return False


def test_the_http_api_toggle_serves_the_chats_engine(loaded, qtbot):  # noqa: F811
    win = loaded
    # A port that is taken: the error is shown and the toggle goes back off.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        win.server_port.setValue(taken.getsockname()[1])
        win.serve_box.setChecked(True)
        qtbot.waitUntil(lambda: not win.serve_action.isChecked(), timeout=30_000)
    assert "HTTP API: could not serve" in win.error_banner.text and win.server.url is None
    win.error_banner.clear()

    win.server_port.setValue(0)                       # any free port
    win.serve_action.trigger()                        # Server > Serve HTTP API
    qtbot.waitUntil(lambda: win.server.url is not None, timeout=30_000)
    url = win.server.url
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert win.serve_box.isChecked() and url in win.server_label.text() and not win.server_port.isEnabled()
    served_engine = win.client.worker.engine

    # The same prompt in two chats: the API reports the chats' shared L2.
    send(qtbot, win, PROMPT, max_tokens=8)
    qtbot.keyClick(win.current_tab().input, Qt.Key_N, Qt.ControlModifier)
    _, second = send(qtbot, win, PROMPT, max_tokens=8)
    l2_hits = second.stats.cache.tier("L2")[0]
    assert l2_hits > 0
    event = wait_for_stats(qtbot, win, lambda e: e.process.tiers["L2"].hits.sum() == l2_hits)
    with httpx.Client(base_url=url, timeout=30.0) as http:
        stats = http.get("/v1/cache-stats").json()
        assert stats["tiers"]["L2"]["hits"] == l2_hits and stats["calls"] == event.process.calls
        assert stats["tiers"]["L2"]["entries"] == int(event.process.tiers["L2"].entries.sum())
        # A walk request goes through the very same L2: an input the API saw once hits the second time.
        x = np.random.default_rng(3).standard_normal(win.client.model.hidden).astype(np.float32).tolist()
        a = http.post("/v1/walk-ffn", json={"layer": 4, "residual": x}).json()
        b = http.post("/v1/walk-ffn", json={"layer": 4, "residual": x}).json()
        assert (a["cache"], b["cache"], b["tier"]) == ("miss", "hit", "L2")
    wait_for_stats(qtbot, win, lambda e: True)
    assert win.client.worker.engine.snapshot().tiers["L2"].hits.sum() == l2_hits + 1

    # API clients change the statistics and the patches while the window sits idle: it follows them.
    idle_calls = win.client.worker.engine.snapshot().calls
    with httpx.Client(base_url=url, timeout=30.0) as http:
        http.post("/v1/walk-ffn", json={"layer": 5, "residual": x})
        d = win.client.model.hidden
        vec = encode_vector(np.ones(d, np.float32))
        doc = {"version": 1, "base_model": win.client.worker.engine.model.name,
               "base_checksum": win.client.worker.engine.model.checksum, "description": "from the API",
               "operations": [{"op": "insert", "layer": 3, "feature": 7, "entity": "e", "relation": "r",
                               "target": "t", "gate": vec, "up": vec, "down": vec}]}
        assert http.post("/v1/patches", json=doc).status_code == 201
    wait_for_stats(qtbot, win, lambda e: e.process.calls > idle_calls and e.patched_layers == (3,))
    qtbot.waitUntil(lambda: win.patch_editor.patch_list.topLevelItemCount() == 1, timeout=10_000)
    assert win.patch_editor.patch_list.topLevelItem(0).text(1) == "3"
    with httpx.Client(base_url=url, timeout=30.0) as http:
        patch_id = http.get("/v1/patches").json()["patches"][0]["id"]
        assert win.patch_editor.patches[0].id == patch_id
        assert http.delete(f"/v1/patches/{patch_id}").status_code == 200
    qtbot.waitUntil(lambda: win.patch_editor.patch_list.topLevelItemCount() == 0, timeout=10_000)

    # Toggling off stops it.
    win.serve_box.setChecked(False)
    assert win.server.url is None and not win.serve_action.isChecked() and win.server_port.isEnabled()
    qtbot.waitUntil(lambda: _refused(url), timeout=10_000)   # the engine thread stops it

    # On again, then another model load: the server moves to the new engine.
    win.serve_box.setChecked(True)
    qtbot.waitUntil(lambda: win.server.url is not None, timeout=30_000)
    old_url, old_engine = win.server.url, win.client.worker.engine
    assert old_engine is served_engine
    with qtbot.waitSignal(win.client.model_loaded, timeout=LOAD_TIMEOUT):
        win.load_model(DEFAULT_MODEL)
    # Port 0: the new engine's server answers on a new port once the worker has moved it.
    qtbot.waitUntil(lambda: win.server.url not in (None, old_url), timeout=30_000)
    assert win.client.worker.engine is not old_engine and _refused(old_url)
    url = win.server.url
    assert httpx.get(f"{url}/v1/cache-stats").json()["calls"] == 0

    # Closing the window stops it before the engine thread is joined.
    win.close()
    assert not win.client.is_running() and win.server.url is None
    assert _refused(url)


def test_an_insert_can_be_cancelled_and_applies_nothing(loaded, qtbot):
    editor = loaded.patch_editor
    editor.entity.setText("Atlantis")
    editor.relation.setText("capital-of")
    editor.target.setText("Poseidon")
    # Cancel at the first progress report: the INSERT stops at its next step.
    loaded.client.insert_progress.connect(lambda e: editor.cancel_insert())
    with qtbot.waitSignal(loaded.client.insert_cancelled, timeout=INSERT_TIMEOUT):
        qtbot.mouseClick(editor.insert_button, Qt.LeftButton)
        assert editor.cancel_button.isVisible()
    qtbot.waitUntil(lambda: not editor.busy, timeout=10_000)
    assert editor.last_insert is None and "cancelled" in editor.progress_label.text()
    assert not editor.cancel_button.isVisible() and editor.insert_button.isEnabled()
    assert loaded.client.worker.engine.applied_patches == () and editor.patch_list.topLevelItemCount() == 0


def test_applied_patches_come_back_when_the_app_starts_again(qtbot, qapp, app_paths, settings_file, tmp_path):  # noqa: F811
    store = AppliedPatchStore(tmp_path / "patches")

    def open_window():
        win = MainWindow(EngineClient(app_paths, threads=2, applied=store),
                         QSettings(str(settings_file), QSettings.IniFormat), qapp)
        win.show()
        with qtbot.waitSignal(win.client.model_loaded, timeout=LOAD_TIMEOUT):
            win.load_model(DEFAULT_MODEL)
        return win

    win = open_window()
    try:
        engine = win.client.worker.engine
        d = engine.model.config.hidden
        doc = {"version": 1, "base_model": engine.model.name, "base_checksum": engine.model.checksum,
               "description": "kept between launches",
               "operations": [{"op": "update", "layer": 2, "feature": 9,
                               "down": encode_vector(np.full(d, 0.01, np.float32))}]}
        path = tmp_path / "kept.json"
        path.write_text(json.dumps(doc))
        win.patch_editor.load_file(path)
        qtbot.waitUntil(lambda: win.patch_editor.patch_list.topLevelItemCount() == 1, timeout=REPLY_TIMEOUT)
        patch_id = win.patch_editor.patches[0].id
    finally:
        win.close()
    again = open_window()
    try:
        qtbot.waitUntil(lambda: again.patch_editor.patch_list.topLevelItemCount() == 1, timeout=REPLY_TIMEOUT)
        assert again.patch_editor.patches[0].id == patch_id and again.patch_editor.patches[0].name == "kept"
        assert [p.id for p in again.client.worker.engine.applied_patches] == [patch_id]
        checksum = again.client.worker.engine.model.checksum
    finally:
        again.close()
    # A damaged list is set aside with a message; the app starts without it and keeps running.
    store.path_for(checksum).write_text("{ not json")
    third = MainWindow(EngineClient(app_paths, threads=2, applied=store),
                       QSettings(str(settings_file), QSettings.IniFormat), qapp)
    third.show()
    try:
        with qtbot.waitSignal(third.client.error, timeout=LOAD_TIMEOUT) as error:
            third.load_model(DEFAULT_MODEL)
        assert "could not be read" in error.args[0].message and "Restoring patches" == error.args[0].context
        assert store.path_for(checksum).with_suffix(".corrupt").is_file()
        qtbot.waitUntil(lambda: third.client.worker.engine is not None, timeout=LOAD_TIMEOUT)
        assert third.client.worker.engine.applied_patches == ()
    finally:
        third.close()


class _PaintCounter(QObject):
    """Counts the paint events a widget receives."""

    def __init__(self, widget):
        super().__init__()
        self.paints = 0
        widget.installEventFilter(self)

    def eventFilter(self, watched, event):
        if event.type() == QEvent.Paint:
            self.paints += 1
        return False


def _deliver_pending_paints(counter, quiet_rounds: int = 5, limit: int = 1000) -> None:
    """Deliver posted events (update requests, relayouts, zero-time timers) until several rounds in a row paint
    nothing more: the paints a change causes, counted without waiting on the clock."""
    quiet = 0
    for _ in range(limit):
        before = counter.paints
        QApplication.sendPostedEvents()
        QApplication.processEvents()
        quiet = quiet + 1 if counter.paints == before else 0
        if quiet >= quiet_rounds:
            return
    raise AssertionError(f"the charts kept painting ({counter.paints} paints)")


def test_a_refresh_of_the_monitor_reaches_the_screen_in_one_paint_of_its_charts(loaded, qtbot):
    # While a reply streams the monitor redraws every few seconds, and a paint of its six charts takes the GUI
    # thread tens of ms from the decode beside it. A refresh settles the plots' ranges and axes before Qt paints,
    # and neither an axis nor the summary above the charts shrinks back (a relayout repaints every chart): the
    # refresh after a reply used to take 3-5 paints in a row.
    monitor = loaded.monitor
    monitor.timer.stop()                    # the test refreshes by hand, at known moments
    counter = _PaintCounter(monitor.charts.viewport())
    heights = []

    def paints_of_a_refresh_after(action, painted: bool = True) -> int:
        """Run `action`, wait for the statistics it brings, refresh once: the chart view's paints that followed."""
        version = monitor.model.version
        action()
        qtbot.waitUntil(lambda: monitor.model.version > version, timeout=REPLY_TIMEOUT)
        _deliver_pending_paints(counter)
        before = counter.paints
        monitor.refresh()
        if painted:
            qtbot.waitUntil(lambda: counter.paints > before, timeout=REPLY_TIMEOUT)   # the refresh is painted...
        _deliver_pending_paints(counter)                                              # ...and what follows it
        heights.append(monitor.charts.height())
        return counter.paints - before

    paints = [paints_of_a_refresh_after(lambda prompt=prompt: send(qtbot, loaded, prompt, max_tokens=8))
              for prompt in ("Hi!", "Name a colour.", "Name a bird.", "Name a tree.", "Name a fish.")]
    # The first refreshes grow the axes and the summary to their text (a relayout); then one paint per refresh.
    assert paints[-3:] == [1, 1, 1], paints
    # A new chat's statistics have a line fewer: the summary keeps its room, so the charts keep their size.
    new_chat = paints_of_a_refresh_after(
        lambda: qtbot.keyClick(loaded.current_tab().input, Qt.Key_N, Qt.ControlModifier), painted=False)
    assert new_chat <= 1 and len(set(heights[-4:])) == 1, (new_chat, heights)


def test_while_a_reply_streams_the_charts_redraw_within_their_share_of_the_gui_thread(loaded, qtbot, monkeypatch):
    # Each redraw of the charts takes the GUI thread 30-250 ms depending on the host, taken from the decode that
    # shares its cores: while a reply streams, redraws are spaced so that they cost at most STREAMING_CPU_SHARE
    # of the thread, as measured on the redraws themselves. With the fixed floor lifted (50 Hz), the budget
    # alone spaces them.
    monkeypatch.setattr(qt_cache_monitor, "STREAMING_REFRESH_HZ", 50.0)
    monitor = loaded.monitor
    send(qtbot, loaded, "Hi!", max_tokens=4)
    batches = []
    loaded.client.tokens.connect(batches.append)
    try:
        send(qtbot, loaded, "Write a long story about a lighthouse keeper and the sea.", max_tokens=120)
    finally:
        loaded.client.tokens.disconnect(batches.append)
    cost = monitor.redraw_cost
    assert cost > 0 and batches                       # measured on a redraw while a reply streamed
    # The spacing follows from the measured cost: the budget's share of the thread, between the floor and the
    # ceiling. (How many redraws a reply gets is a rate, so a timing fact of the host: not asserted here.)
    interval = monitor.streaming_interval()
    assert interval == pytest.approx(
        min(qt_cache_monitor.STREAMING_MAX_INTERVAL_S, max(1 / 50.0, cost / qt_cache_monitor.STREAMING_CPU_SHARE)))
    qtbot.waitUntil(lambda: monitor._drawn == monitor.model.version, timeout=REPLY_TIMEOUT)   # then drawn at once
