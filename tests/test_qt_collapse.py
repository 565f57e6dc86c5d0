"""The collapse lab and the monitor's near-miss view, driven on the real window with the real models, offscreen."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from larql_desktop.engine.analysis.collapse import COMPUTATION  # noqa: E402
from larql_desktop.engine.analysis.features import DEFAULT_TOP_N, feature_view  # noqa: E402
from larql_desktop.engine.cache.near_miss import COSINE_EDGES, OVERLAP_EDGES  # noqa: E402
from larql_desktop.engine.cache.keys import default_top_k  # noqa: E402
from test_qt_app import LOAD_TIMEOUT, REPLY_TIMEOUT, loaded, send, settings_file, window  # noqa: E402,F401
from test_qt_panels import wait_for_stats  # noqa: E402

PARAPHRASE = ("What is the capital of France?", "Tell me the capital city of France.")
UNRELATED = "Write a haiku about autumn leaves."


def start_lab(win, prompts, top_k=0) -> list[tuple[int, int, str]]:
    """Clicks Run; returns the list its progress events fill: (captured, total, the status line then)."""
    lab = win.monitor.collapse_lab
    win.monitor.chart_tabs.setCurrentWidget(lab)
    lab.prompts.setPlainText("\n".join(prompts))
    lab.top_k.setValue(top_k)
    assert lab.run_button.isEnabled() and not lab.stop_button.isEnabled()
    progress = []
    # Connected after the lab: the status line has taken the event when this runs.
    win.client.collapse_progress.connect(lambda e: progress.append((e.captured, e.total, lab.status.text())))
    lab.run_button.click()
    assert lab.busy and not lab.run_button.isEnabled() and lab.stop_button.isEnabled()
    return progress


def run_lab(qtbot, win, prompts, top_k=0):
    lab = win.monitor.collapse_lab
    progress = start_lab(win, prompts, top_k)
    qtbot.waitUntil(lambda: not lab.busy, timeout=REPLY_TIMEOUT)
    assert [(done, total) for done, total, _ in progress] == [(i + 1, len(prompts)) for i in range(len(prompts))]
    assert all(f"Captured {done} of {total} prompts" in status for done, total, status in progress)
    assert lab.run_button.isEnabled() and not lab.stop_button.isEnabled()
    return lab


def test_collapse_lab_on_smollm2_draws_table_chart_and_exports(loaded, qtbot, tmp_path):
    lab = run_lab(qtbot, loaded, [*PARAPHRASE, UNRELATED])
    report = lab.report
    info = loaded.client.model
    n, F = info.n_layers, info.intermediate
    assert report is not None and report.template == "chat" and report.model == "smollm2"
    assert report.computation == COMPUTATION
    assert report.token_ids[0] == tuple(loaded.client.worker.model.encode_prompt(
        [{"role": "user", "content": PARAPHRASE[0]}]))
    assert report.top_k == default_top_k(F) and len(report.pairs) == 3
    assert lab.pair.count() == 3 and lab.table.rowCount() == n
    # The chart and the table show the first pair; the baseline line sits at K/F.
    first = report.pairs[0]
    x, y = lab.cosine_line.getData()
    assert len(x) == n and np.allclose(y, first.column("cosine"))
    assert np.allclose(lab.overlap_line.getData()[1], first.column("overlap"))
    assert lab.baseline_line.value() == pytest.approx(report.top_k / F)
    assert lab.table.item(3, 1).text() == f"{first.layers[3].cosine:.4f}"
    # The paraphrase pair is nearer than the unrelated ones, and both stay above the random baseline.
    para, unrel = first, report.pairs[1]
    assert np.median(para.column("cosine")) > np.median(unrel.column("cosine")) + 0.1
    assert np.median(para.column("overlap")) > np.median(unrel.column("overlap"))
    assert unrel.column("overlap").min() > report.baseline - 0.02
    assert "equal keys on" in lab.status.text()
    # Choosing another pair redraws it.
    lab.pair.setCurrentIndex(1)
    assert np.allclose(lab.cosine_line.getData()[1], unrel.column("cosine"))
    # Exports.
    doc = json.loads(lab.export(tmp_path / "lab.json").read_text())
    assert len(doc["layers"]) == n and doc["layers"][0]["cosine"] == pytest.approx(first.layers[0].cosine)
    rows = list(csv.reader(lab.export(tmp_path / "lab.csv").open()))
    assert rows[0][:3] == ["pair_a", "pair_b", "layer"] and len(rows) == 1 + 3 * n
    image = QImage(str(lab.export(tmp_path / "lab.png")))
    assert not image.isNull() and image.width() >= 200
    with pytest.raises(ValueError, match="json, .csv or .png"):
        lab.export(tmp_path / "lab.txt")


def test_collapse_lab_refuses_one_prompt_and_a_bad_k(loaded, qtbot):
    lab = loaded.monitor.collapse_lab
    lab.prompts.setPlainText("Only one prompt\n\n   ")
    lab.run_button.click()
    assert not lab.busy and "at least two prompts" in loaded.error_banner.text
    assert lab.report is None
    lab.prompts.setPlainText("a\nb")
    lab.top_k.setMaximum(10_000_000)
    lab.top_k.setValue(10_000_000)          # beyond the model's features: the engine refuses
    with qtbot.waitSignal(loaded.client.error, timeout=REPLY_TIMEOUT) as error:
        lab.run_button.click()
    assert "K must be between" in error.args[0].message
    qtbot.waitUntil(lambda: not lab.busy, timeout=REPLY_TIMEOUT)
    assert lab.report is None and "Failed" in lab.status.text() and lab.run_button.isEnabled()


def test_collapse_lab_on_gemma3_uses_plain_text(window, qtbot):
    with qtbot.waitSignal(window.client.model_loaded, timeout=LOAD_TIMEOUT):
        window.load_model("gemma3-270m")
    lab = run_lab(qtbot, window, [*PARAPHRASE, UNRELATED], top_k=256)
    report = lab.report
    assert report.template == "plain" and report.top_k == 256
    assert lab.table.rowCount() == window.client.model.n_layers == len(report.pairs[0].layers)
    assert lab.baseline_line.value() == pytest.approx(256 / window.client.model.intermediate)
    assert np.median(report.pairs[0].column("cosine")) > np.median(report.pairs[1].column("cosine"))


def test_collapse_lab_stop_ends_the_run_and_keeps_the_previous_report(loaded, qtbot):
    lab = run_lab(qtbot, loaded, PARAPHRASE)
    previous = lab.report
    cosine_shown = lab.table.item(2, 1).text()
    prompts = [f"Name {n} things that are {colour}." for n in ("two", "three", "four", "five")
               for colour in ("red", "green", "blue", "yellow")]
    progress = start_lab(loaded, prompts)
    qtbot.waitUntil(lambda: len(progress) >= 1, timeout=REPLY_TIMEOUT)
    lab.stop_button.click()
    qtbot.waitUntil(lambda: not lab.busy, timeout=REPLY_TIMEOUT)
    captured = len(progress)
    assert 1 <= captured < len(prompts)               # it stopped between prompts, well before the end
    assert lab.status.text() == (f"Run cancelled after {captured} of {len(prompts)} prompts; the report shown is "
                                 "the previous run's.")
    assert lab.report is previous and lab.table.item(2, 1).text() == cosine_shown
    assert lab.pair.count() == 1
    assert lab.run_button.isEnabled() and not lab.stop_button.isEnabled()
    # The worker is free again: the next run completes.
    run_lab(qtbot, loaded, [PARAPHRASE[0], UNRELATED])
    assert lab.report is not previous and lab.report.prompts == (PARAPHRASE[0], UNRELATED)


def test_clicking_a_lab_layer_row_shows_the_feature_view_of_prompt_a_or_b(loaded, qtbot):
    lab = run_lab(qtbot, loaded, [PARAPHRASE[0], UNRELATED])
    report = lab.report
    layer = 5
    item = lab.table.item(layer, 0)
    lab.table.scrollToItem(item)
    cell = lab.table.visualItemRect(item).center()
    with qtbot.waitSignal(loaded.client.features_shown, timeout=REPLY_TIMEOUT):
        qtbot.mouseClick(lab.table.viewport(), Qt.LeftButton, pos=cell)
    features = lab.features
    table = features.table
    assert table.rowCount() == DEFAULT_TOP_N
    scores = [float(table.item(r, 1).text()) for r in range(table.rowCount())]
    assert [abs(v) for v in scores] == sorted((abs(v) for v in scores), reverse=True)   # strongest first
    view = features.view
    assert view.layer == layer == features.layer.value() and features.status.text().startswith(f"Layer {layer},")
    ids = report.token_ids[0]                         # prompt A as the lab measured it, at its last token
    assert view.position == len(ids) - 1 and view.token_id == ids[-1]
    assert view == feature_view(loaded.client.worker.engine, list(ids), layer)
    assert [int(table.item(r, 0).text()) for r in range(DEFAULT_TOP_N)] == [r.feature for r in view.rows]
    # Prompt B of the same pair, same layer.
    assert lab.feature_prompt.count() == 2
    with qtbot.waitSignal(loaded.client.features_shown, timeout=REPLY_TIMEOUT):
        lab.feature_prompt.setCurrentIndex(1)
    other = features.view
    assert other.layer == layer and other.token_id == report.token_ids[1][-1]
    assert other == feature_view(loaded.client.worker.engine, list(report.token_ids[1]), layer)
    assert [int(table.item(r, 0).text()) for r in range(DEFAULT_TOP_N)] == [r.feature for r in other.rows]


def test_near_miss_view_next_to_the_hit_rate(loaded, qtbot, tmp_path):
    monitor = loaded.monitor
    assert monitor.near_fraction.value() == 0.0          # off by default
    monitor.near_fraction.setValue(1.0)
    monitor.apply_button.click()
    qtbot.waitUntil(lambda: loaded.client.worker.engine.walk_settings.near_miss_fraction == 1.0,
                    timeout=REPLY_TIMEOUT)
    send(qtbot, loaded, "Name three rivers in Europe.", max_tokens=12)
    event = wait_for_stats(qtbot, loaded, lambda e: e.process.near_miss is not None
                           and int(e.process.near_miss.found.sum()) > 0)
    n = loaded.client.model.n_layers
    monitor.chart_tabs.setCurrentIndex(1)
    monitor.refresh(force=True)
    x, cos = monitor.near_lines["cosine"].getData()
    assert len(x) == n and np.nanmax(cos) <= 1.0 + 1e-5
    _, overlap = monitor.near_lines["overlap"].getData()
    assert np.nanmin(overlap) > 0.5 and np.nanmax(overlap) < 1.0     # near, but never the same feature set
    _, hit_rate = monitor.near_lines["hits"].getData()
    assert len(hit_rate) == n
    assert monitor.near_baseline.isVisible()
    assert monitor.near_baseline.value() == pytest.approx(default_top_k(loaded.client.model.intermediate)
                                                          / loaded.client.model.intermediate)
    assert monitor.overlap_map.image.shape == (len(OVERLAP_EDGES) - 1, n)
    assert monitor.cosine_map.image.shape == (len(COSINE_EDGES) - 1, n)
    columns = monitor.overlap_map.image.sum(axis=0)
    sampled = event.process.near_miss.found
    assert np.allclose(columns[sampled > 0], 1.0)                     # each explained layer's shares sum to 1
    assert "misses explained" in monitor.near_summary.text()
    rows = list(csv.reader(monitor.export_stats(tmp_path / "s.csv").open()))
    assert rows[0][-4:] == ["near_miss_sampled", "near_miss_mean_overlap", "near_miss_mean_cosine",
                            "near_miss_served"]
    assert sum(int(r[-4]) for r in rows[1:]) == int(loaded.monitor.model.latest.process.near_miss.sampled.sum())
    image = QImage(str(monitor.export_charts(tmp_path / "near.png")))     # the view shown: near misses
    assert not image.isNull() and image.width() >= 300


def test_monitor_reads_at_the_default_window_size(loaded, qtbot):
    send(qtbot, loaded, "Hi!", max_tokens=4)
    wait_for_stats(qtbot, loaded, lambda e: e.process.calls > 0)
    assert (loaded.width(), loaded.height()) == (1280, 860)            # no saved geometry: the default
    monitor = loaded.monitor
    for index in (0, 1):
        monitor.chart_tabs.setCurrentIndex(index)
        monitor.refresh(force=True)
        QApplication.sendPostedEvents()          # the relayout the refresh posted, delivered now
        QApplication.processEvents()
        view = monitor.chart_tabs.currentWidget()
        plots = [p for p in monitor._all_plots() if p.scene() is not None and p.getViewWidget().isVisible()]
        assert plots
        for plot in plots:
            title = plot.titleLabel.item.boundingRect().width()
            assert title <= plot.boundingRect().width() + 1, (plot._title, title, plot.boundingRect().width())
            assert plot.legend is None                                  # colour keys live in the titles
            assert plot.vb.boundingRect().height() >= 50                 # room left for the data
        assert view.isVisible()


def test_frontier_view_runs_on_the_prompts_and_draws_the_bound(loaded, qtbot):
    frontier = loaded.monitor.frontier
    loaded.monitor.chart_tabs.setCurrentWidget(frontier)
    frontier.widths.setText("x")
    frontier.run_button.click()
    assert not frontier.busy and "key widths: 'x' is not a number" in loaded.error_banner.text
    frontier.prompts.setPlainText("Name a large animal.\nName a large animal.")
    frontier.widths.setText("K")
    frontier.taus.setText("off,0.999")
    frontier.tokens.setValue(4)
    frontier.run_button.click()
    assert frontier.busy and frontier.stop_button.isEnabled() and not frontier.run_button.isEnabled()
    qtbot.waitUntil(lambda: not frontier.busy, timeout=REPLY_TIMEOUT)
    result = frontier.result
    assert result is not None and len(result.points) == 2 and [b.tau for b in result.bounds] == [0.999]
    assert frontier.table.rowCount() == 3 and frontier.table.item(2, 0).text() == "NN bound"
    assert len(frontier.design_points.data) == 2
    exact = result.points[0]                      # the repeat hits its twin's entries, every token kept
    assert exact.hit_rate > 0.4 and exact.agreement == 1.0
    bx, by = frontier.bound_line.getData()
    assert bx[0] == pytest.approx(result.bounds[0].hit_rate) and bx[0] >= result.points[1].hit_rate - 1e-9
    assert "nearest-neighbour bound: tau 0.999" in frontier.status.text()
    # A long sweep stops at the next generation when asked: at most the design under way finishes.
    frontier.widths.setText("K,64,8,1")
    frontier.taus.setText("off,0.999,0.995,0.99")
    progress = []
    loaded.client.frontier_progress.connect(lambda e: progress.append(e))
    frontier.run_button.click()
    qtbot.waitUntil(lambda: len(progress) >= 1 or not frontier.busy, timeout=REPLY_TIMEOUT)
    frontier.stop_button.click()
    designs_at_stop = len(progress)
    qtbot.waitUntil(lambda: not frontier.busy, timeout=REPLY_TIMEOUT)
    assert frontier.status.text() == "Stopped." and frontier.result is result
    assert 1 <= designs_at_stop and len(progress) <= designs_at_stop + 1 < progress[0].total
    assert frontier.run_button.isEnabled() and not frontier.stop_button.isEnabled()
