"""A decode step of the walk whose entries are not known in advance (the cache off, or a cold cache) runs in one
call of the walked decoder graph (the top-K walk at every layer); the walk then makes each layer's key, looks it
up and stores the misses. On the real models that is bit-identical to the layer-by-layer walk, stores the same
entries under the same keys and counts the same outcomes; a layer a lookup would serve, or whose selection ties,
ends the one-call part of the step there."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from larql_desktop.engine.cache.tiers import TierSettings
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache
from greedy_runs import run_sequence

OFF = TierSettings(enabled=False)
LAYERED = WalkSettings(whole_model_graph=False)
STEPS = 8


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    return request.getfixturevalue(request.param)


def _prompt(model, text):
    return model.encode_prompt([{"role": "user", "content": text}]) if model.is_chat else model.tokenizer.encode(text)


def _logged_run(engine, model, ids):
    """A greedy run in a new session of `engine`, with its lookups' keys logged."""
    session = engine.new_session()
    session.ffn.key_log = []
    tokens, logits = run_sequence(model, session.ffn, ids, STEPS)
    return session, tokens, logits


def _stored(tier, key_log):
    """The entries `tier` holds under the logged (layer, key)s, as {(layer, key): (output, residual)}."""
    found = tier.newest_many(key_log)
    return {address: (entry.output, entry.residual) for address, entry in zip(key_log, found) if entry is not None}


def test_a_cold_walk_computes_each_step_in_one_call_and_stores_what_the_layered_walk_does(model):
    ids = _prompt(model, "Describe a lighthouse at night.")
    layered = LarqlEngine(model, walk=LAYERED)
    engine = LarqlEngine(model)
    s_layered, tokens_layered, logits_layered = _logged_run(layered, model, ids)
    s_walked, tokens_walked, logits_walked = _logged_run(engine, model, ids)
    assert s_layered.ffn.stepper.steps_walked == 0 and s_walked.ffn.stepper.steps_walked == STEPS
    assert tokens_walked == tokens_layered
    assert np.array_equal(logits_walked, logits_layered)
    assert s_walked.ffn.key_log == s_layered.ffn.key_log        # the same keys, looked up in the same order
    stored_layered, stored_walked = _stored(layered.l2, s_layered.ffn.key_log), _stored(engine.l2, s_walked.ffn.key_log)
    assert len(stored_walked) == STEPS * model.config.n_layers
    assert stored_walked.keys() == stored_layered.keys()
    for address, (output, residual) in stored_layered.items():
        assert np.array_equal(stored_walked[address][0], output) and np.array_equal(stored_walked[address][1], residual)
    a, b = layered.session_snapshot(s_layered), engine.session_snapshot(s_walked)
    for tier in ("L1", "L2"):
        assert np.array_equal(a.tiers[tier].misses, b.tiers[tier].misses)
        assert a.tiers[tier].hits.sum() == b.tiers[tier].hits.sum() == 0
    assert a.lookups == b.lookups == STEPS * model.config.n_layers
    assert b.latency["miss"].count == a.latency["miss"].count


def test_the_cache_off_walk_in_one_call_is_bit_identical_to_the_layered_one(model):
    ids = _prompt(model, "Count from one to ten.")
    layered = LarqlEngine(model, walk=LAYERED, l1=OFF, l2=OFF)
    engine = LarqlEngine(model, l1=OFF, l2=OFF)
    s_layered, tokens_layered, logits_layered = _logged_run(layered, model, ids)
    s_walked, tokens_walked, logits_walked = _logged_run(engine, model, ids)
    assert s_walked.ffn.stepper.steps_walked == STEPS and s_layered.ffn.stepper.steps_walked == 0
    assert tokens_walked == tokens_layered and np.array_equal(logits_walked, logits_layered)
    a, b = layered.session_snapshot(s_layered), engine.session_snapshot(s_walked)
    assert np.array_equal(a.bypasses["cache_off"], b.bypasses["cache_off"])
    assert b.bypasses["cache_off"].sum() == STEPS * model.config.n_layers


def test_a_layer_a_lookup_would_serve_ends_the_one_call_part_of_the_step(model):
    ids = _prompt(model, "What do bees make?")
    engine = LarqlEngine(model)
    first, _, logits_first = _logged_run(engine, model, ids)
    n, middle = model.config.n_layers, model.config.n_layers // 3
    kept = [(layer, key) for layer, key in first.ffn.key_log if layer == middle]
    entries = engine.l2.newest_many(kept)
    engine.clear_caches()                           # L2 and the key trace: no step can be planned
    engine.l2.store_many([(layer, key, entry) for (layer, key), entry in zip(kept, entries)])
    second, _, logits_second = _logged_run(engine, model, ids)
    # Every step: layers before `middle` from the walked call, `middle` served by L2, the rest layer by layer.
    assert second.ffn.stepper.steps_walked == 0 and second.ffn.stepper.steps_served == 0
    assert np.array_equal(logits_second, logits_first)     # a hit for the very input it was made from
    snap = engine.session_snapshot(second)
    hits = snap.tiers["L2"].hits
    assert hits[middle] == STEPS and hits.sum() == STEPS
    assert snap.tiers["L1"].misses.sum() == STEPS * n
    assert snap.tiers["L2"].misses.sum() == STEPS * (n - 1)


def test_a_tie_at_the_k_th_place_leaves_the_layer_to_the_walk(model):
    ids = _prompt(model, "Name a colour.")
    engine = LarqlEngine(model)
    session = engine.new_session()
    walk, transformer = session.ffn, model.transformer
    kv = KvCache(model.config)
    token = int(np.argmax(transformer.forward(ids, kv, walk)[-1]))
    assert walk.stepper.plan_step(token) is None
    ran = transformer.decoder.run_walked(transformer.embed(np.array([token])), kv.length, kv, transformer.rope,
                                         walk.settings.top_k)
    assert ran.settled.all()              # real scores: no tie at the K-th place
    settled = ran.settled.copy()
    settled[5] = False                    # as the graph says for a tie: its TopK's choice may not be the walk's
    walk.key_log = []
    assert walk.stepper.settle_walked_step(replace(ran, settled=settled)) == 5
    assert [layer for layer, _ in walk.key_log] == list(range(5))
    assert len(_stored(engine.l2, walk.key_log)) == 5
    snap = engine.session_snapshot(session)
    assert snap.tiers["L2"].misses[:5].sum() == 5 and snap.tiers["L2"].misses[5:].sum() == 0


def test_with_the_cache_off_a_tie_at_the_k_th_place_also_leaves_the_layer_to_the_walk(model):
    """The walked decoder selects by threshold, which at a tie holds every tied feature: the step keeps the
    layers before it (counted as the cache-off walk's), and the walk computes that layer with its own rule."""
    ids = _prompt(model, "Name a colour.")
    engine = LarqlEngine(model, l1=OFF, l2=OFF)
    session = engine.new_session()
    walk, transformer = session.ffn, model.transformer
    kv = KvCache(model.config)
    token = int(np.argmax(transformer.forward(ids, kv, walk)[-1]))
    ran = transformer.decoder.run_walked(transformer.embed(np.array([token])), kv.length, kv, transformer.rope,
                                         walk.settings.top_k)
    assert ran.settled.all() and (ran.selections.sum(axis=1) == walk.settings.top_k).all()
    settled = ran.settled.copy()
    settled[7] = False                    # as the graph says for a tie
    before = engine.session_snapshot(session).bypasses["cache_off"].copy()
    walked = walk.stepper.steps_walked
    assert walk.stepper.settle_walked_step(replace(ran, settled=settled)) == 7
    counted = engine.session_snapshot(session).bypasses["cache_off"] - before
    assert counted[:7].tolist() == [1] * 7 and counted[7:].sum() == 0
    assert walk.stepper.steps_walked == walked            # not a whole step
