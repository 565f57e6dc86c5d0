"""A decode step whose every layer hits runs in one call of the served decoder graph (the key trace guesses the
step's entries, the walk checks each guess against what the graph computed): on the real models, its output is
bit-identical to the cache-off walk, a wrong guess is never served, and the counts say what happened."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from larql_desktop.engine.cache.keys import select_mask
from larql_desktop.engine.cache.tiers import CacheEntry, TierSettings, _frozen
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.patches.overlay import Patch, PatchOperation
from greedy_runs import run_sequence

OFF = TierSettings(enabled=False)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    return request.getfixturevalue(request.param)


def _prompt(model, text):
    return model.encode_prompt([{"role": "user", "content": text}]) if model.is_chat else model.tokenizer.encode(text)


def test_a_repeated_generation_is_served_whole_and_bit_identical_to_the_cache_off_walk(model):
    ids = _prompt(model, "Name the planets of the solar system.")
    off = LarqlEngine(model, l1=OFF, l2=OFF).new_session()
    tokens_off, logits_off = run_sequence(model, off.ffn, ids, 10)

    engine = LarqlEngine(model)
    first, second = engine.new_session(), engine.new_session()
    tokens_1, logits_1 = run_sequence(model, first.ffn, ids, 10)
    assert first.ffn.steps_served == 0           # nothing to follow yet: every step looked its layers up
    tokens_2, logits_2 = run_sequence(model, second.ffn, ids, 10)
    assert tokens_1 == tokens_2 == tokens_off
    assert np.array_equal(logits_1, logits_off) and np.array_equal(logits_2, logits_off)
    assert second.ffn.steps_served == 10 and second.ffn.steps_resumed == 0
    n = model.config.n_layers
    snap = engine.session_snapshot(second)
    # Counted as the lookups would have been: L1 (empty in a new session) misses, L2 hits, L1 filled.
    assert snap.tiers["L1"].misses.sum() == snap.tiers["L2"].hits.sum() == 10 * n
    assert snap.tiers["L1"].entries.sum() == 10 * n
    assert snap.latency["hit"].count == 10 * n      # untimed: one call ran each step


def test_the_graph_says_settled_only_where_the_guessed_selection_is_the_top_k(model):
    ids = _prompt(model, "Water boils at")
    engine = LarqlEngine(model)
    run_sequence(model, engine.new_session().ffn, ids, 3)
    walk = engine.new_session().ffn
    kv = KvCache(model.config)
    logits = model.transformer.forward(ids, kv, walk)[-1]
    step = walk.plan_step(int(np.argmax(logits)))
    assert step is not None
    selections = step.selections.copy()
    selections[4] = ~selections[4]                      # a wrong guess at one layer
    ran = model.transformer.decoder.run_served(model.transformer.embed(np.array([int(np.argmax(logits))])),
                                               kv.length, kv, model.transformer.rope, step.outputs, selections)
    k = walk.settings.top_k
    for layer in range(model.config.n_layers):
        exact = select_mask(ran.scores[layer], k)
        assert ran.settled[layer] == (layer != 4)
        if ran.settled[layer]:
            assert np.array_equal(exact, selections[layer])


def test_a_wrong_guess_is_computed_from_its_layer_on_and_changes_nothing(model):
    ids = _prompt(model, "The capital of Italy is")
    off = LarqlEngine(model, l1=OFF, l2=OFF).new_session()
    tokens_off, logits_off = run_sequence(model, off.ffn, ids, 4)
    engine = LarqlEngine(model)
    run_sequence(model, engine.new_session().ffn, ids, 4)
    # Poison the shared L2: layer 5's entry of the first decode step now claims another output, stored for
    # another input. A lookup would refuse it (the hit rule), so must a guess.
    session = engine.new_session()
    walk = session.ffn
    kv = KvCache(model.config)
    first = int(np.argmax(model.transformer.forward(ids, kv, walk)[-1]))
    step = walk.plan_step(first)
    assert step is not None
    entry = step.entries[5]
    forged = CacheEntry(_frozen(entry.output * 3.0), _frozen(entry.residual * 3.0))
    engine.l2.store(5, step.keys[5], forged)
    walk._step_start = None
    walk._last_step_key = None
    tokens, logits = run_sequence(model, walk, ids, 4)
    assert tokens == tokens_off and np.array_equal(logits, logits_off)
    assert walk.steps_resumed >= 1
    snap = engine.session_snapshot(session)
    assert snap.tiers["L2"].misses[5] >= 1          # the forged entry was looked up, refused, recomputed


def test_no_step_is_served_across_settings_or_under_patches(smollm2):
    ids = _prompt(smollm2, "Tell me about the moon.")
    engine = LarqlEngine(smollm2)
    run_sequence(smollm2, engine.new_session().ffn, ids, 4)
    engine.configure(walk=replace(engine.walk_settings, top_k=engine.new_session().ffn.settings.top_k - 7))
    other = engine.new_session()
    run_sequence(smollm2, other.ffn, ids, 4)
    assert other.ffn.steps_served == 0 and engine.session_snapshot(other).hits == 0

    engine = LarqlEngine(smollm2)
    run_sequence(smollm2, engine.new_session().ffn, ids, 4)
    cfg = smollm2.config
    down = np.full(cfg.hidden, 0.01, np.float32)
    engine.apply_patch(Patch((PatchOperation("update", cfg.n_layers - 3, 7, down=down),), smollm2.name,
                             smollm2.checksum))
    patched = engine.new_session()
    run_sequence(smollm2, patched.ffn, ids, 4)
    assert patched.ffn.steps_served == 0


def test_a_regenerated_reply_in_the_app_session_is_served_whole(smollm2):
    from larql_desktop.engine.model.generation import SamplingSettings

    engine = LarqlEngine(smollm2)
    session = engine.new_session()
    settings = SamplingSettings(max_tokens=12)
    first = [s.token_id for s in session.reply("Name three primary colors.", settings)]
    again = [s.token_id for s in session.regenerate(settings)]
    assert again == first
    assert session.ffn.steps_served == len(first) - 1
