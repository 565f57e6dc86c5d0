"""The Qt layer's plain-Python parts: stats wording, transcripts, stored settings, the request/snapshot types."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from larql_desktop.engine.model.generation import SamplingSettings, TokenStep
from larql_desktop.qt.protocol import SendPrompt, TokenEvent
from larql_desktop.qt.reply_stats import (COMPLETE, LENGTH, STOPPED, CacheCounts, ReplyStats, ReplyStatsBuilder,
                                          format_cache_counts, format_load_progress, format_reply_stats)
from larql_desktop.qt.transcript import USER, Transcript


def steps(n: int, stop: bool):
    out = [TokenStep(10, "a", 0, 0.5, 12, False)]
    out += [TokenStep(11 + i, "b", i + 1, 0.1, 1, False) for i in range(n - 1)]
    if stop:
        out.append(TokenStep(2, "", n, 0.1, 1, True))
    return out


def test_stats_count_reply_tokens_and_decode_rate():
    builder = ReplyStatsBuilder()
    for step in steps(5, stop=True):
        builder.add(step)
    stats = builder.finish(builder.natural_outcome())
    assert stats.outcome == COMPLETE
    assert stats.tokens == 5 and stats.prompt_tokens == 12 and stats.prefill_seconds == 0.5
    assert stats.decode_tokens == 5 and stats.tokens_per_second == pytest.approx(10.0)
    assert format_reply_stats(stats) == "5 tokens · 10.0 tok/s · prefill 0.50 s (12 prompt tokens)"


def test_stats_without_a_stop_token_hit_the_length_limit():
    builder = ReplyStatsBuilder()
    for step in steps(3, stop=False):
        builder.add(step)
    assert builder.natural_outcome() == LENGTH
    assert format_reply_stats(builder.finish(LENGTH)).endswith("reached max tokens")


def test_a_one_token_reply_has_no_rate():
    stats = ReplyStats(1, 4, 0.2, 0, 0.0, STOPPED)
    assert math.isnan(stats.tokens_per_second)
    assert format_reply_stats(stats) == "1 token · – tok/s · prefill 0.20 s (4 prompt tokens) · stopped"


def test_load_progress_wording_clamps_the_fraction():
    assert format_load_progress("Exporting", 0.256) == "Exporting (26%)"
    assert format_load_progress("Done", 1.7) == "Done (100%)"


def test_transcript_finishing_adds_a_held_back_tail():
    transcript = Transcript()
    transcript.add_user("hi")
    transcript.start_reply()
    assert transcript.streaming and not transcript.can_regenerate
    transcript.append("caf")
    missing = transcript.finish_reply("café", ReplyStats(2, 3, 0.1, 1, 0.1, COMPLETE))
    assert missing == "é" and transcript.last.text == "café"
    assert transcript.can_regenerate and "tok/s" in transcript.last.footer
    transcript.drop_last_reply()
    assert [t.role for t in transcript.turns] == [USER]
    transcript.drop_last_reply()   # only replies are dropped
    assert [t.role for t in transcript.turns] == [USER] and transcript.last.text == "hi"


def test_requests_and_snapshots_are_frozen():
    request = SendPrompt(1, 2, "hello", SamplingSettings())
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'text'"):
        request.text = "changed"
    event = TokenEvent.from_step(1, 2, TokenStep(5, "x", 0, 0.1, 3, False))
    assert (event.request_id, event.session_id, event.token_id, event.text) == (1, 2, 5, "x")
    assert SendPrompt(1, 2, "a", SamplingSettings()) == SendPrompt(1, 2, "a", SamplingSettings())   # cancel not compared


def test_plain_modules_of_the_qt_package_do_not_import_qt():
    code = ("import sys; import larql_desktop.qt.protocol, larql_desktop.qt.reply_stats, "
            "larql_desktop.qt.transcript, larql_desktop.qt.cache_monitor_model, larql_desktop.qt.engine_jobs, "
            "larql_desktop.qt.lab_jobs; "
            "print(any(m.startswith('PySide6') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_request_has_a_label_and_a_handler_and_every_answer_a_signal_of_its_own(tmp_path):
    """The protocol is typed end to end: requests are named to the user by their label (errors are routed by id),
    the worker's one table handles every request (the labs' too), and each answer has its own client signal."""
    pytest.importorskip("PySide6")
    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.qt import protocol
    from larql_desktop.qt.worker import EngineClient, EngineWorker

    types = [t for t in vars(protocol).values() if isinstance(t, type) and dataclasses.is_dataclass(t)
             and t.__module__ == protocol.__name__]
    requests = [t for t in types if "label" in vars(t)]
    streams = {protocol.ModelInfo, protocol.ReplyStarted, protocol.TokenEvent, protocol.ReplyFinished,
               protocol.ErrorReport, protocol.CacheStatsEvent}   # each with a signal of its own already
    assert len(requests) >= 20 and all(isinstance(t.label, str) and t.label for t in requests)
    assert set(types) == set(requests) | set(protocol.ANSWERS) | streams   # nothing unrouted
    assert not set(requests) & set(protocol.ANSWERS)
    worker = EngineWorker(AppPaths(tmp_path / "d", tmp_path / "c", tmp_path / "l", tmp_path / "g"))
    assert set(worker._handlers) == set(requests)
    assert not hasattr(worker, "register_handler")
    names = list(protocol.ANSWERS.values())
    assert len(set(names)) == len(names)
    client_signals = {name for name in names if isinstance(getattr(EngineClient, name, None), type(EngineClient.error))}
    assert client_signals == set(names)
    assert not isinstance(getattr(EngineClient, "answer", None), type(EngineClient.error))   # no catch-all signal


def test_stored_sampling_falls_back_to_defaults():
    pytest.importorskip("PySide6")
    from larql_desktop.qt.qt_sampling_panel import stored_sampling

    assert stored_sampling({"max_tokens": "64", "temperature": "0.7", "top_p": "0.9", "seed": "-1"}) == \
        SamplingSettings(64, 0.7, 0.9, None)
    assert stored_sampling({"max_tokens": "junk", "seed": "5"}) == SamplingSettings(seed=5)
    assert stored_sampling({"top_p": "7"}) == SamplingSettings()


def test_cache_counts_wording():
    counts = CacheCounts((("L1", 0, 330), ("L2", 330, 0), ("L3", 0, 0)), (("prefill", 30),))
    assert format_cache_counts(counts) == \
        "FFN cache: L1 0 hits / 330 misses · L2 330 hits / 0 misses · 30 bypasses (prefill 30)"
    assert counts.tier("L2") == (330, 0) and counts.tier("L9") == (0, 0)
    assert format_cache_counts(CacheCounts(dense_calls=360)) == "dense FFN: 360 calls, no cache"
    stats = ReplyStats(5, 12, 0.5, 5, 0.5, COMPLETE, counts)
    first, second = format_reply_stats(stats).split("\n")
    assert first.startswith("5 tokens · 10.0 tok/s") and second.startswith("FFN cache:")


def _snapshot(n, l1=(0, 0), l2=(0, 0), calls=0, recent=(), patched=0):
    import numpy as np

    from larql_desktop.engine.cache.stats import BYPASS_REASONS, FidelitySummary, LatencySummary, OUTCOMES, StatsSnapshot, TIERS, TierSnapshot

    def tier(name, hm):
        z = np.zeros(n, np.int64)
        return TierSnapshot(name, True, np.full(n, hm[0]), np.full(n, hm[1]), z, z + 1, z + 512, z, z)

    counts = {"L1": l1, "L2": l2}
    bypasses = {r: np.zeros(n, np.int64) for r in BYPASS_REASONS}
    bypasses["patched"][1] = patched
    # Lookups that missed both tiers: L2's misses, plus L1 misses L2 never saw (L2 off for them).
    full = np.full(n, l2[1] + max(l1[1] - l2[0] - l2[1], 0), np.int64)
    return StatsSnapshot(calls, calls, {t: tier(t, counts.get(t, (0, 0))) for t in TIERS}, bypasses,
                         {o: LatencySummary(0, 0, 0, 0) for o in OUTCOMES},
                         FidelitySummary(0, float("nan"), float("nan"), 0.0, 0.0), tuple(recent), full)


def _event(snapshot, engine_id=1, t=0.0, patched=()):
    from larql_desktop.engine.core import CacheSettings
    from larql_desktop.qt.protocol import CacheStatsEvent

    return CacheStatsEvent(engine_id, t, 1, snapshot, snapshot, patched, CacheSettings(), 3)


def test_monitor_model_turns_snapshots_into_interval_rates_and_latencies():
    import numpy as np

    from larql_desktop.qt.cache_monitor_model import MonitorModel, cache_counts

    model = MonitorModel(capacity=4)
    model.ingest(_event(_snapshot(3, l1=(0, 2), l2=(0, 2), calls=6, recent=((1.0, 0, "miss", 0.001),)), t=10.0))
    model.ingest(_event(_snapshot(3, l1=(0, 4), l2=(2, 2), calls=12,
                                  recent=((1.0, 0, "miss", 0.001), (2.0, 0, "hit", 0.0001))), t=11.0))
    assert model.hit_rate.t.tolist() == [0.0, 1.0]
    assert model.hit_rate.column("L2").tolist() == [0.0, 1.0] and model.hit_rate.column("L1").tolist() == [0.0, 0.0]
    hits = model.latency_us.column("hit")
    assert np.isnan(hits[0]) and hits[1] == pytest.approx(100.0)   # only calls new since the last event
    assert np.isnan(model.latency_us.column("miss")[1])   # no new misses in that interval
    layers = model.per_layer()
    assert layers["L2 hits"].tolist() == [2, 2, 2] and layers["misses"].tolist() == [2, 2, 2]
    for i in range(6):   # the history keeps its capacity
        model.ingest(_event(_snapshot(3, calls=20 + i), t=12.0 + i))
    assert len(model.hit_rate) == 4 and model.hit_rate.t[-1] == pytest.approx(7.0)
    model.ingest(_event(_snapshot(3, calls=1), engine_id=2, t=50.0))   # a new model: fresh histories
    assert len(model.hit_rate) == 1 and model.hit_rate.t[0] == 0.0
    snap = _snapshot(3, l1=(1, 4), l2=(3, 1))
    counts = cache_counts(_snapshot(3, l1=(0, 2)), snap)
    assert counts.tier("L1") == (3, 6) and counts.tier("L2") == (9, 3)


def test_stats_exports_are_valid_json_and_one_csv_row_per_layer():
    import csv
    import io
    import json

    from larql_desktop.qt.cache_monitor_model import CSV_COLUMNS, stats_csv, stats_json

    event = _event(_snapshot(3, l2=(5, 1), calls=9, patched=4), patched=(1,))
    doc = json.loads(stats_json(event))   # NaN fidelity became null: strict JSON
    assert doc["process"]["fidelity"]["mean_cosine"] is None and doc["patched_layers"] == [1]
    rows = list(csv.DictReader(io.StringIO(stats_csv(event))))
    assert len(rows) == 3 and tuple(rows[0]) == CSV_COLUMNS
    assert [r["patched"] for r in rows] == ["0", "1", "0"] and rows[1]["bypass_patched"] == "4"
    assert rows[0]["L2_hits"] == "5"


def test_exact_full_misses_per_layer_feed_the_monitor_bars():
    import dataclasses

    from larql_desktop.engine.cache.stats import CacheStats
    from larql_desktop.qt.cache_monitor_model import MonitorModel

    stats = CacheStats(3)
    stats.record(0, "miss", 0.001, tier_results=(("L1", False), ("L2", False), ("L3", False)))
    stats.record(0, "hit", 0.001, tier_results=(("L1", False), ("L2", False), ("L3", True)))
    stats.record(2, "miss", 0.001, tier_results=(("L1", False),))            # L2 off: L1 was the only tier
    stats.record(1, "bypass", 0.001, bypass="prefill")
    snap = stats.snapshot({}, {"L1": True})
    assert snap.full_misses.tolist() == [1, 0, 1]
    assert snap.to_dict()["full_misses"] == {"total": 2, "per_layer": [1, 0, 1]}
    model = MonitorModel()
    model.ingest(_event(dataclasses.replace(snap, calls=4)))
    assert model.per_layer()["misses"].tolist() == [1, 0, 1]
    stats.reset()
    assert stats.snapshot({}, {}).full_misses.tolist() == [0, 0, 0]
