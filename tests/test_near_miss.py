"""Near-miss explanation: sampled misses find their nearest stored entry by feature overlap and by cosine."""
from __future__ import annotations

import numpy as np
import pytest

from larql_desktop.engine.cache.near_miss import NearMissCounts, feature_bits, nearest
from larql_desktop.engine.cache.tiers import CacheEntry, CacheTier
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.generation import SamplingSettings


def _entry(rng, d, ids, F):
    return CacheEntry(rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32),
                      feature_bits(np.asarray(ids), F))


def test_nearest_by_popcount_and_cosine_matches_brute_force():
    rng = np.random.default_rng(3)
    F, K, d = 200, 50, 16
    sets = [rng.choice(F, K, replace=False) for _ in range(12)]
    entries = [_entry(rng, d, ids, F) for ids in sets]
    x = entries[5].residual + 0.05 * rng.standard_normal(d).astype(np.float32)
    out = rng.standard_normal(d).astype(np.float32)
    mine = rng.choice(F, K, replace=False)
    found = nearest(3, x, out, feature_bits(mine, F), K, entries, tau=0.99)
    want_overlap = max(len(set(mine) & set(s)) for s in sets) / K
    cos = [float(e.residual @ x / np.linalg.norm(e.residual) / np.linalg.norm(x)) for e in entries]
    assert found.candidates == 12 and found.layer == 3
    assert found.overlap == pytest.approx(want_overlap)
    assert found.cosine == pytest.approx(max(cos), abs=1e-6)
    assert found.served == (max(cos) >= 0.99)
    best = entries[int(np.argmax(cos))]
    assert found.error == pytest.approx(np.linalg.norm(out - best.output) / np.linalg.norm(out), rel=1e-5)
    assert nearest(3, x, out, feature_bits(mine, F), K, [], 0.99) is None


def test_counts_histograms_and_namespaces():
    tier = CacheTier("L1", 2)
    tier.store(1, ("ns-a", 1), CacheEntry(np.ones(4, np.float32), np.ones(4, np.float32)))
    tier.store(1, ("ns-b", 2), CacheEntry(np.ones(4, np.float32), np.ones(4, np.float32)))
    assert len(tier.entries_of(1, "ns-a")) == 1 and tier.entries_of(0, "ns-a") == [] == tier.entries_of(9, "x")
    counts = NearMissCounts(2)
    rng = np.random.default_rng(0)
    e = [_entry(rng, 8, [0, 1, 2, 3], 16)]
    counts.record(1, nearest(1, e[0].residual, e[0].output, feature_bits(np.array([0, 1, 4, 5]), 16), 4, e, 0.9))
    counts.record(1, None)
    snap = counts.snapshot()
    assert snap.sampled.tolist() == [0, 2] and snap.empty.tolist() == [0, 1]
    assert snap.overlap_hist[1].sum() == 1 and snap.overlap_hist[1, 10] == 1      # 0.5 falls in [0.50, 0.55)
    assert snap.served.tolist() == [0, 1] and snap.mean_served_error[1] == pytest.approx(0.0, abs=1e-6)
    assert snap.mean_overlap[1] == pytest.approx(0.5) and np.isnan(snap.mean_overlap[0])
    doc = snap.to_dict()
    assert doc["per_layer"]["mean_overlap"][0] is None
    assert doc["recent_median_overlap"] == pytest.approx(0.5) and doc["recent"] == 1


def test_off_by_default_costs_nothing(smollm2):
    engine = LarqlEngine(smollm2)
    session = engine.new_session()
    list(session.reply("Say hi.", SamplingSettings(max_tokens=4)))
    assert session.ffn.near_miss is None
    entries = session.l1.entries_of(5, session.ffn.namespace())
    assert entries and all(e.features is None for e in entries)
    assert int(engine.session_snapshot(session).near_miss.sampled.sum()) == 0
    with pytest.raises(ValueError, match="near-miss fraction"):
        WalkSettings(near_miss_fraction=1.5)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_sampled_misses_on_a_real_session(name, request):
    model = request.getfixturevalue(name)
    engine = LarqlEngine(model, walk=WalkSettings(near_miss_fraction=1.0, near_miss_tau=0.99))
    session = engine.new_session()
    sampler = session.ffn.near_miss
    sampler.budget = 10.0        # explain every miss here: the invariants below are checked on all of them
    text = "The cat sat on the mat. " * 3 if not model.is_chat else "Repeat: the cat sat on the mat."
    list(session.reply(text, SamplingSettings(max_tokens=12 if model.is_chat else 24)))
    snap = engine.session_snapshot(session)
    nm = snap.near_miss
    n = model.config.n_layers
    misses = snap.full_misses
    assert nm.sampled.tolist() == misses.tolist()          # fraction 1: every miss explained
    assert int(nm.found.sum()) > 0
    recent = np.array([r[1:] for r in nm.recent], dtype=float)     # overlap, cosine, served, error
    # A miss under exact full-K keys had no stored entry with its feature set: the nearest overlap is < 1,
    # which also shows the miss's own new entry is left out of the search.
    assert np.all(recent[:, 0] < 1.0) and np.all(recent[:, 0] > 0.5)
    assert np.all(recent[:, 1] <= 1.0 + 1e-5) and np.all(recent[:, 1] > -1.0)
    # Served needs an entry at cosine >= tau (and norms within 5%, which the nearest entry may miss), so a served
    # miss's nearest cosine is >= tau; one below tau was never served.
    assert np.all(recent[recent[:, 2] == 1, 1] >= 0.99)
    assert int(nm.served.sum()) == int(recent[:, 2].sum())
    assert nm.tau == 0.99 and nm.overlap_hist.shape == (n, 20)
    # Process-wide statistics see the same explanations; entries carry their bitsets.
    assert int(engine.snapshot().near_miss.sampled.sum()) == int(nm.sampled.sum())
    entry = session.l1.entries_of(n - 1, session.ffn.namespace())[0]
    assert entry.features is not None and int(np.bitwise_count(entry.features).sum()) == session.ffn.settings.top_k
    assert "near_miss" in snap.to_dict()
    if not model.is_chat:
        # The base model repeats the sentence: each repeat sits at a new position, so exact keys never hit, yet
        # a cosine guard at 0.99 would have served some of those misses from the earlier repeat.
        assert snap.hits == 0 and int(nm.served.sum()) > 0


def test_time_budget_caps_the_cost(smollm2):
    engine = LarqlEngine(smollm2, walk=WalkSettings(near_miss_fraction=1.0))
    session = engine.new_session()
    sampler = session.ffn.near_miss
    # A budget of nothing: whatever this host's speed, the first explanation spends it all and every later
    # sampled miss is skipped (the default, 5% of the misses' own time, would make the count a timing fact).
    sampler.budget = 0.0
    list(session.reply("Tell me about rivers.", SamplingSettings(max_tokens=16)))
    nm = engine.session_snapshot(session).near_miss
    assert sampler.skipped_for_budget > 0                       # the budget, not the fraction, limited it
    assert int(nm.sampled.sum()) == 1 < int(engine.session_snapshot(session).full_misses.sum())
    assert sampler.spent == sampler.longest                     # the one explanation that may overshoot it


def test_chat_cli_explains_misses_and_reports_their_cost(smollm2, tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "stats.json"
    result = subprocess.run([sys.executable, "-m", "larql_desktop", "chat", "--ffn", "walk", "--explain-misses", "1.0",
                             "--max-tokens", "8", "--json", str(out), "Tell me about rivers."],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "misses explained" in result.stderr and "of the misses' own time" in result.stderr
    doc = json.loads(out.read_text())
    assert doc["near_miss"]["sampled"] > 0 and len(doc["near_miss"]["per_layer"]["sampled"]) == smollm2.config.n_layers
