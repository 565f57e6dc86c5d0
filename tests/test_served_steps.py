"""A decode step whose every layer hits runs in one call of the served decoder graph (the key trace guesses the
step's entries, the walk checks each guess against what the graph computed), or of the replay decoder graph
(no gate) while every input is its entry's bit for bit: on the real models, its output is bit-identical to the
cache-off walk, a wrong guess is never served, and the counts say what happened."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from larql_desktop.engine.cache.keys import select_mask
from larql_desktop.engine.cache.tiers import CacheEntry, TierSettings, frozen_copy
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.model.overlay import Patch, PatchOperation
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
    assert first.ffn.stepper.steps_served == 0           # nothing to follow yet: every step looked its layers up
    tokens_2, logits_2 = run_sequence(model, second.ffn, ids, 10)
    assert tokens_1 == tokens_2 == tokens_off
    assert np.array_equal(logits_1, logits_off) and np.array_equal(logits_2, logits_off)
    assert second.ffn.stepper.steps_served == 10 and second.ffn.stepper.steps_resumed == 0
    assert second.ffn.stepper.steps_replayed == 10      # an exact repeat: every input was its entry's, no gate ran
    n = model.config.n_layers
    snap = engine.session_snapshot(second)
    # Counted as the lookups would have been: L1 (empty in a new session) misses, L2 hits, L1 filled.
    assert snap.tiers["L1"].misses.sum() == snap.tiers["L2"].hits.sum() == 10 * n
    assert snap.tiers["L1"].entries.sum() == 10 * n
    assert snap.latency["hit"].count == 10 * n      # untimed: one call ran each step


def test_the_graph_says_settled_only_where_the_guessed_selection_is_the_top_k(model):
    _, _, session, kv, token, step = _primed_plan(model, "Water boils at", 3)
    selections = step.selections.copy()
    selections[4] = ~selections[4]                      # a wrong guess at one layer
    ran = model.transformer.decoder.run_served(model.transformer.embed(np.array([token])),
                                               kv.length, kv, model.transformer.rope, step.outputs, selections)
    k = session.ffn.settings.top_k
    for layer in range(model.config.n_layers):
        exact = select_mask(ran.scores[layer], k)
        assert ran.settled[layer] == (layer != 4)
        if ran.settled[layer]:
            assert np.array_equal(exact, selections[layer])


def _primed_plan(model, text: str, n_decode: int):
    """The prompt's ids, an engine whose L2 holds the walk's entries of `n_decode` greedy steps after it, a new
    session of that engine after the prompt's pass (its KV cache), the first step's token and the session's plan
    of that step."""
    ids = _prompt(model, text)
    engine = LarqlEngine(model)
    run_sequence(model, engine.new_session().ffn, ids, n_decode)
    session = engine.new_session()
    kv = KvCache(model.config)
    token = int(np.argmax(model.transformer.forward(ids, kv, session.ffn)[-1]))
    step = session.ffn.stepper.plan_step(token)
    assert step is not None and step.replay
    return ids, engine, session, kv, token, step


def _run_again(model, walk, ids, n_decode):
    """run_sequence from the prompt on, the walk's links to its last pass forgotten (it plans the first step
    again, as a new walk would)."""
    walk._step_start = None
    walk._last_step_key = None
    return run_sequence(model, walk, ids, n_decode)


def test_a_wrong_guess_is_computed_from_its_layer_on_and_changes_nothing(model):
    ids, engine, session, _, _, step = _primed_plan(model, "The capital of Italy is", 4)
    tokens_off, logits_off = run_sequence(model, LarqlEngine(model, l1=OFF, l2=OFF).new_session().ffn, ids, 4)
    walk = session.ffn
    # Poison the shared L2: layer 5's entry of the first decode step now claims another output, stored for
    # another input. A lookup would refuse it (the hit rule), so must a guess.
    entry = step.entries[5]
    forged = CacheEntry(frozen_copy(entry.output * 3.0), frozen_copy(entry.residual * 3.0))
    engine.l2.store(5, step.keys[5], forged)
    tokens, logits = _run_again(model, walk, ids, 4)
    assert tokens == tokens_off and np.array_equal(logits, logits_off)
    assert walk.stepper.steps_resumed >= 1
    snap = engine.session_snapshot(session)
    assert snap.tiers["L2"].misses[5] >= 1          # the forged entry was looked up, refused, recomputed


def test_the_replay_decoder_computes_the_served_decoders_inputs_bit_for_bit(model):
    _, _, _, kv, token, step = _primed_plan(model, "Water boils at", 3)
    decoder, h = model.transformer.decoder, model.transformer.embed(np.array([token]))
    # Both write the step's KV rows (the same values); run the served decoder on a copy of the cache.
    copy = KvCache(model.config)
    copy.reserve(kv.length + 1)
    for mine, theirs in ((copy.keys, kv.keys), (copy.values, kv.values)):
        for a, b in zip(mine, theirs):
            a[:] = b
    copy.length = kv.length
    served = decoder.run_served(h, kv.length, copy, model.transformer.rope, step.outputs, step.selections)
    replayed = decoder.run_replay(h, kv.length, kv, model.transformer.rope, step.outputs)
    assert np.array_equal(replayed.inputs.view(np.uint32), served.inputs.view(np.uint32))
    assert np.array_equal(replayed.residuals.view(np.uint32), served.residuals.view(np.uint32))
    # The premise of serving a replay without the gate: the inputs are the entries' own, bit for bit.
    assert np.array_equal(replayed.inputs.view(np.uint32), step.residuals.view(np.uint32))
    for a, b in zip(copy.keys + copy.values, kv.keys + kv.values):
        assert np.array_equal(a[:, :kv.length + 1], b[:, :kv.length + 1])


def test_an_input_one_bit_off_its_entry_ends_the_replay_and_the_served_decoder_checks_the_rest(model):
    ids, engine, session, _, _, step = _primed_plan(model, "The largest ocean on Earth is", 5)
    tokens_off, logits_off = run_sequence(model, LarqlEngine(model, l1=OFF, l2=OFF).new_session().ffn, ids, 5)
    walk = session.ffn
    # Layer 7's entry of the first decode step, as if made from an input one unit in the last place away:
    # the same output, an input the hit rule still admits, but no longer the step's input bit for bit.
    entry = step.entries[7]
    nudged = entry.residual.copy()
    nudged[0] = np.nextafter(nudged[0], np.float32(np.inf))
    engine.l2.store(7, step.keys[7], CacheEntry(entry.output, frozen_copy(nudged)))
    tokens, logits = _run_again(model, walk, ids, 5)
    assert tokens == tokens_off and np.array_equal(logits, logits_off)
    # The first step replayed layers 0-6, looked layer 7 up (served under the hit rule) and went on layer by
    # layer; the next steps ran in the served decoder, whose keys come from the scores.
    assert walk.stepper.steps_replayed == 0 and walk.stepper.steps_resumed == 1 and walk.stepper.steps_served == 4
    assert engine.session_snapshot(session).tiers["L2"].hits[7] == 5
    # A new prompt expects replays again.
    tokens, logits = run_sequence(model, walk, ids, 5)
    assert tokens == tokens_off and np.array_equal(logits, logits_off)
    assert walk.stepper.steps_replayed == 0 and walk.stepper.steps_resumed == 2      # the nudged entry is still in L2
    engine.l2.store(7, step.keys[7], entry)
    again = engine.new_session().ffn
    run_sequence(model, again, ids, 5)
    assert again.stepper.steps_replayed == 5


def test_no_step_is_served_across_settings_or_under_patches(smollm2):
    ids = _prompt(smollm2, "Tell me about the moon.")
    engine = LarqlEngine(smollm2)
    run_sequence(smollm2, engine.new_session().ffn, ids, 4)
    engine.configure(walk=replace(engine.walk_settings, top_k=engine.new_session().ffn.settings.top_k - 7))
    other = engine.new_session()
    run_sequence(smollm2, other.ffn, ids, 4)
    assert other.ffn.stepper.steps_served == 0 and engine.session_snapshot(other).hits == 0

    engine = LarqlEngine(smollm2)
    run_sequence(smollm2, engine.new_session().ffn, ids, 4)
    cfg = smollm2.config
    down = np.full(cfg.hidden, 0.01, np.float32)
    engine.apply_patch(Patch((PatchOperation("update", cfg.n_layers - 3, 7, down=down),), smollm2.name,
                             smollm2.checksum))
    patched = engine.new_session()
    run_sequence(smollm2, patched.ffn, ids, 4)
    assert patched.ffn.stepper.steps_served == 0


def test_a_regenerated_reply_in_the_app_session_is_served_whole(smollm2):
    from larql_desktop.engine.model.generation import SamplingSettings

    engine = LarqlEngine(smollm2)
    session = engine.new_session()
    settings = SamplingSettings(max_tokens=12)
    first = [s.token_id for s in session.reply("Name three primary colors.", settings)]
    again = [s.token_id for s in session.regenerate(settings)]
    assert again == first
    assert session.ffn.stepper.steps_served == len(first) - 1
    assert session.ffn.stepper.steps_replayed == len(first) - 1    # the regenerate repeats the reply bit for bit
