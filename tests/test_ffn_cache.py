"""The FFN activation cache: the seed's properties as unit tests, then the real models."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.cache.keys import default_top_k, feature_key, is_full_k, key_features, select_features
from larql_desktop.engine.cache.stats import CacheStats
from larql_desktop.engine.cache.tiers import CacheEntry, CacheTier, HitRule, TierSettings
from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.model.generation import SamplingSettings
from greedy_runs import run_sequence


def entry(value: float, d: int = 8) -> CacheEntry:
    out = np.full(d, value, np.float32)
    return CacheEntry(out, np.ones(d, np.float32))


# ------------------------------------------------------------------------------------------ keys
def test_key_is_order_independent():
    ids = np.array([5, 1, 900, 42, 7])
    assert feature_key(ids) == feature_key(ids[::-1]) == feature_key(np.sort(ids))


def test_different_sets_give_different_keys():
    rng = np.random.default_rng(0)
    keys = {feature_key(rng.choice(1536, 64, replace=False)) for _ in range(2000)}
    assert len(keys) == 2000
    assert feature_key([1, 2, 3]) != feature_key([1, 2, 4])
    assert feature_key([1, 2, 3]) != feature_key([1, 2])


def test_select_features_by_magnitude_keeps_signed_scores():
    scores = np.array([0.1, -5.0, 3.0, -0.2, 4.0], np.float32)
    chosen = select_features(scores, 3)
    assert sorted(chosen.tolist()) == [1, 2, 4]
    assert sorted(key_features(scores, chosen, 2).tolist()) == [1, 4]
    assert key_features(scores, chosen, 3) is chosen


def test_default_k_is_the_seed_ratio_and_below_full_k():
    assert default_top_k(10240) == 8092
    assert default_top_k(1536) == 1213 and not is_full_k(1213, 1536)
    assert is_full_k(1229, 1536) and not is_full_k(1228, 1536)


# ------------------------------------------------------------------------------------------ tiers
def test_miss_then_hit():
    tier = CacheTier("L1", 2)
    assert tier.lookup(0, "k", None, None) is None
    assert tier.store(0, "k", entry(1.0))
    assert tier.lookup(0, "k", None, None).output[0] == 1.0
    keys, entries, nbytes, _, _ = tier.occupancy()
    assert keys.tolist() == [1, 0] and entries.tolist() == [1, 0] and nbytes[0] == 64


def test_layers_are_independent_and_out_of_range_is_safe():
    tier = CacheTier("L2", 3)
    tier.store(1, "k", entry(2.0))
    assert tier.lookup(0, "k", None, None) is None and tier.lookup(2, "k", None, None) is None
    assert tier.lookup(-1, "k", None, None) is None and tier.lookup(3, "k", None, None) is None
    assert tier.store(99, "k", entry(1.0)) is False


def test_drop_policy_drops_new_keys_but_never_overwrites():
    tier = CacheTier("L1", 1, TierSettings(capacity=2, policy="drop"))
    assert tier.store(0, "a", entry(1.0)) and tier.store(0, "b", entry(2.0))
    assert tier.store(0, "c", entry(3.0)) is False
    assert tier.lookup(0, "c", None, None) is None
    assert tier.store(0, "a", entry(9.0))                 # overwrite of an existing key when full
    assert tier.lookup(0, "a", None, None).output[0] == 9.0
    keys, entries, _, evictions, dropped = tier.occupancy()
    assert (keys[0], entries[0], evictions[0], dropped[0]) == (2, 2, 0, 1)


def test_lru_evicts_least_recently_used():
    tier = CacheTier("L2", 1, TierSettings(capacity=2, policy="lru"))
    tier.store(0, "a", entry(1.0))
    tier.store(0, "b", entry(2.0))
    tier.lookup(0, "a", None, None)                        # a is now the most recent
    tier.store(0, "c", entry(3.0))
    assert tier.lookup(0, "b", None, None) is None
    assert tier.lookup(0, "a", None, None) is not None and tier.lookup(0, "c", None, None) is not None
    assert tier.occupancy()[3][0] == 1


def test_byte_budget_is_respected():
    tier = CacheTier("L2", 2, TierSettings(capacity=100, policy="lru", byte_budget=64 * 3))
    for i in range(10):
        tier.store(i % 2, f"k{i}", entry(float(i)))
        assert tier.occupancy()[2].sum() <= 64 * 3
    assert tier.lookup(1, "k9", None, None) is not None     # the newest survives


def test_cosine_guard_picks_best_entry_in_bucket():
    tier = CacheTier("L1", 1)
    x1, x2 = np.array([1, 0, 0, 0], np.float32), np.array([0, 1, 0, 0], np.float32)
    tier.store(0, "k", CacheEntry(np.full(4, 1, np.float32), x1), bucket_size=4)
    tier.store(0, "k", CacheEntry(np.full(4, 2, np.float32), x2), bucket_size=4)
    guard = HitRule("cosine", tau=0.99)
    q = np.array([0.1, 1, 0, 0], np.float32)
    assert tier.lookup(0, "k", q, guard).output[0] == 2
    assert tier.lookup(0, "k", np.array([1, 1, 0, 0], np.float32), guard) is None
    assert tier.lookup(0, "k", 3 * x2, guard) is None          # same direction, three times the length
    assert tier.occupancy()[1][0] == 2


def test_absurd_tier_settings_refused():
    for kwargs, says in ((dict(capacity=0), "capacity must be between"), (dict(policy="fifo"), "eviction policy"),
                         (dict(byte_budget=0), "byte budget must be positive")):
        with pytest.raises(ValueError, match=says):
            TierSettings(**kwargs)


def test_a_steps_records_counted_together_equal_the_same_records_counted_one_by_one():
    """record_untimed counts a decode step's records kind by kind, all their layers at once: every count (per
    tier and layer, per bypass reason, full misses, calls, lookups) is what record() gives one record at a time,
    with mixed kinds and a layer recorded twice."""
    rng = np.random.default_rng(7)
    kinds = [("miss", (("L1", False), ("L2", False), ("L3", False)), None),
             ("hit", (("L1", False), ("L2", True)), None),
             ("hit", (("L1", True),), None),
             ("bypass", (), "patched"),
             ("bypass", (), "prefill"),
             ("dense", (), None)]
    records = [(int(rng.integers(6)), *kinds[int(rng.integers(len(kinds)))]) for _ in range(200)]
    records += [(2, *kinds[0]), (2, *kinds[0])]
    together, one_by_one = CacheStats(6), CacheStats(6)
    for start in range(0, len(records), 30):         # steps of 30 records
        together.record_untimed(records[start:start + 30])
    for layer, outcome, tier_results, bypass in records:
        one_by_one.record(layer, outcome, None, tier_results=tier_results, bypass=bypass)
    a, b = ({k: v for k, v in stats.snapshot({}, {}).to_dict().items() if k != "fidelity"}   # (NaN: none checked)
            for stats in (together, one_by_one))
    assert a == b and a["calls"] == len(records)
    assert a["tiers"]["L2"]["per_layer"]["hits"] == b["tiers"]["L2"]["per_layer"]["hits"]
    assert a["tiers"]["L2"]["hits"] > 0 and a["full_misses"]["per_layer"][2] >= 2


def test_eight_threads_hammering_l2_lose_no_counts_and_corrupt_nothing():
    tier = CacheTier("L2", 4, TierSettings(capacity=64, policy="lru"))
    stats = CacheStats(4)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(2000):
            layer, key = int(rng.integers(4)), int(rng.integers(100))
            found = tier.lookup(layer, key, None, None)
            if found is not None and not (found.output == key * 10 + layer).all():
                errors.append((layer, key))
            if found is None:
                tier.store(layer, key, CacheEntry(np.full(8, key * 10 + layer, np.float32), np.ones(8, np.float32)))
            stats.record(layer, "hit" if found is not None else "miss", 1e-6,
                         tier_results=(("L2", found is not None),))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = stats.snapshot({"L2": [tier]}, {"L2": True})
    assert not errors
    assert int(snap.tiers["L2"].hits.sum() + snap.tiers["L2"].misses.sum()) == 8 * 2000 == snap.calls
    keys, entries, nbytes, _, _ = tier.occupancy()
    assert (keys <= 64).all() and (entries == keys).all() and (nbytes == keys * 64).all()


# ------------------------------------------------------------------------------------------ real models
def test_repeat_hits_every_decode_lookup_and_is_bit_identical_to_cache_off(smollm2):
    ids = smollm2.encode_prompt([{"role": "user", "content": "How many legs does a spider have?"}])
    off = LarqlEngine(smollm2, l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))
    off_session = off.new_session()
    tokens_off, logits_off = run_sequence(smollm2, off_session.ffn, ids, 12)
    assert off.snapshot().bypasses["cache_off"].sum() == 12 * smollm2.config.n_layers

    engine = LarqlEngine(smollm2)
    first, second = engine.new_session(), engine.new_session()
    tokens_1, logits_1 = run_sequence(smollm2, first.ffn, ids, 12)
    tokens_2, logits_2 = run_sequence(smollm2, second.ffn, ids, 12)
    assert tokens_1 == tokens_2 == tokens_off
    assert np.array_equal(logits_1, logits_off) and np.array_equal(logits_2, logits_off)
    n = smollm2.config.n_layers
    s1, s2 = engine.session_snapshot(first), engine.session_snapshot(second)
    assert s1.tiers["L2"].hits.sum() == 0 and s1.tiers["L1"].misses.sum() == 12 * n
    # The second session's L1 is empty: every decode lookup misses L1 and hits the shared L2.
    assert s2.tiers["L1"].misses.sum() == 12 * n and s2.tiers["L2"].hits.sum() == 12 * n
    assert s1.bypasses["prefill"].sum() == n and s2.bypasses["prefill"].sum() == n
    total = engine.snapshot()
    assert total.tiers["L2"].hits.sum() == 12 * n
    assert total.tiers["L1"].entries.sum() == 2 * 12 * n


def test_regenerate_in_a_session_hits_l1(smollm2):
    engine = LarqlEngine(smollm2)
    session = engine.new_session()
    settings = SamplingSettings(max_tokens=10)
    first = [s.token_id for s in session.reply("Name three primary colors.", settings)]
    before = engine.session_snapshot(session)
    again = [s.token_id for s in session.regenerate(settings)]
    after = engine.session_snapshot(session)
    assert again == first
    n = smollm2.config.n_layers
    decode_steps = len(first) - 1
    assert after.tiers["L1"].hits.sum() - before.tiers["L1"].hits.sum() == decode_steps * n
    assert after.tiers["L1"].misses.sum() == before.tiers["L1"].misses.sum()


def test_full_k_runs_dense_and_bypasses(smollm2):
    f = smollm2.config.intermediate
    engine = LarqlEngine(smollm2, walk=WalkSettings(top_k=f))
    session = engine.new_session()
    list(session.reply("Hi", SamplingSettings(max_tokens=3)))
    snap = engine.snapshot()
    assert snap.lookups == 0 and snap.bypasses["full_k"].sum() == snap.calls > 0
    assert snap.latency["dense"].count == snap.calls


def test_dense_mode_matches_plain_dense_ffn(smollm2):
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True))
    ffn = engine.new_session().ffn
    x = np.random.default_rng(0).standard_normal((1, smollm2.config.hidden)).astype(np.float32)
    assert np.array_equal(ffn(3, x), smollm2.ffn.dense(3, x))


def test_sparse_walk_uses_exactly_k_features(smollm2):
    k = 100
    engine = LarqlEngine(smollm2, walk=WalkSettings(top_k=k))
    ffn = engine.new_session().ffn
    x = np.random.default_rng(0).standard_normal((1, smollm2.config.hidden)).astype(np.float32)
    scores = smollm2.ffn.gate_scores(0, x)
    mask, picks = ffn.mask_for(scores)
    assert mask.sum() == k and len(picks[0]) == k
    # Numpy check of the walk: only the selected features contribute.
    from larql_desktop.engine.model.transformer import NumpyDenseFfn, silu
    g, u, d = NumpyDenseFfn(smollm2.transformer).weights[0]
    sel = picks[0]
    expected = (silu(scores[0, sel]) * (u[sel] @ x[0])) @ d[:, sel].T
    got = ffn(0, x)[0]
    assert np.dot(got, expected) / (np.linalg.norm(got) * np.linalg.norm(expected)) > 0.999


def test_keys_carry_k_so_other_settings_never_hit(smollm2):
    engine = LarqlEngine(smollm2)
    session = engine.new_session()
    ids = smollm2.tokenizer.encode("The quick brown fox")
    run_sequence(smollm2, session.ffn, ids, 4)
    engine.configure(walk=WalkSettings(top_k=default_top_k(smollm2.config.intermediate) - 1))
    other = engine.new_session()
    run_sequence(smollm2, other.ffn, ids, 4)
    assert engine.session_snapshot(other).hits == 0


def test_verify_mode_measures_hit_error(smollm2):
    # The seed's feature-set hits (opt-in): approximate keys then serve approximate outputs.
    engine = LarqlEngine(smollm2, walk=WalkSettings(key_width=1, feature_set_hits=True, verify_fraction=1.0))
    session = engine.new_session()
    list(session.reply("Write a haiku about the sea.", SamplingSettings(max_tokens=12)))
    snap = engine.snapshot()
    assert snap.hits > 0, "top-1 keys should collide within one reply"
    assert snap.fidelity.checked == snap.hits
    assert snap.fidelity.min_cosine < 0.999     # approximate keys serve approximate outputs, and it shows


def test_cosine_guard_limits_hits_to_similar_residuals(smollm2):
    def hits(guard):
        engine = LarqlEngine(smollm2, walk=WalkSettings(key_width=1, cosine_guard=guard, feature_set_hits=True,
                                                        verify_fraction=1.0))
        list(engine.new_session().reply("Write a haiku about the sea.", SamplingSettings(max_tokens=12)))
        return engine.snapshot()

    loose, strict = hits(None), hits(0.999)
    assert strict.hits < loose.hits
    assert loose.fidelity.checked == loose.hits > 0        # verify_fraction=1: every hit is checked
    # The guard's hits (if any) are all near their entry's input; the loose ones need not be.
    assert strict.fidelity.checked == strict.hits
    assert (strict.fidelity.min_cosine if strict.hits else 1.0) > loose.fidelity.min_cosine


def test_bad_walk_settings_refused(smollm2):
    f = smollm2.config.intermediate
    for kwargs, says in ((dict(top_k=0), "K must be at least 1"), (dict(top_k=f + 1), f"exceeds the model's {f}"),
                         (dict(top_k=10, key_width=11), "key width 11 exceeds K=10"),
                         (dict(verify_fraction=2.0), "verify fraction"), (dict(cosine_guard=1.5), "cosine guard"),
                         (dict(max_distance=float("nan")), "maximum input distance"),
                         (dict(max_distance=-1e-3), "maximum input distance")):
        with pytest.raises(ValueError, match=says):
            LarqlEngine(smollm2, walk=WalkSettings(**kwargs))


def test_a_tiers_entries_add_no_work_to_pythons_cycle_collector():
    """A busy server's L2 holds ~120k entries; held as objects the cycle collector tracks (a CacheEntry and a
    list each), every full collection walked them all with every thread stopped (60-130 ms). Stored, updated in
    their buckets and evicted, they leave the collector's tracked objects where they were; reads give them back
    whole."""
    tier = CacheTier("L2", 4, TierSettings(capacity=1000, policy="lru"))
    namespace = ("b179c9523d0e", 16, 64, "onnx-q4")
    rng = np.random.default_rng(0)
    made = [CacheEntry(rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32),
                       np.packbits(rng.random(16) < 0.5)) for _ in range(50)]
    gc.collect()
    before = len(gc.get_objects())
    for i in range(4000):          # past capacity: evictions too
        tier.store_many([(layer, (namespace, i * 7 + layer), made[(i + layer) % 50]) for layer in range(4)],
                        bucket_size=2)
        tier.store(i % 4, (namespace, (i // 2) * 7 + i % 4), made[i % 50], bucket_size=2)   # a second in a bucket
    gc.collect()
    assert tier.occupancy()[0].tolist() == [1000] * 4
    assert len(gc.get_objects()) - before < 400         # 4,000 keys held: as tracked lists they were 4,000 more
    got = tier.lookup(3, (namespace, 3999 * 7 + 3), None, None)
    assert got is not None and np.array_equal(got.output, made[(3999 + 3) % 50].output)
    assert np.array_equal(got.features, made[(3999 + 3) % 50].features) and got.nbytes == made[0].nbytes
