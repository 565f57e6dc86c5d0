"""INSERT on the real models: whole multi-token words, keys that hold beyond one sentence, cancellation,
what a patch records, and insert-eval."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest

from conftest import DATA_DIR
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.patches.insert import Fact, InsertCancelled, generated_phrasings
from larql_desktop.engine.model.overlay import PatchOverlay
from larql_desktop.engine.patches.insert.values import TOP_BLOCK, top_tokens
from larql_desktop.tools.insert_eval import (ROWS, ConversationCase, Decoder, FactMeasure, Score, contains_word,
                                             default_engine_factory, format_report, read_facts,
                                             run_insert_eval, starts_with_word)


def tok_text(model, ids) -> str:
    return repr(model.tokenizer.decode(list(ids)))


def test_multi_token_target_comes_out_whole_and_the_patch_records_every_token(smollm2, capture_store):
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    ins = engine.inserter()
    fact = Fact("Zorbania", "currency-of", "Glimmer")
    tokens = ins.target_tokens(fact.target)
    assert len(tokens) >= 2                       # the point of the test: "Glimmer" is several tokens
    before = ins.continuation(fact.canonical_prompt, engine.patches, len(tokens) + 2)[0]
    assert not starts_with_word(before, fact.target)
    result = engine.insert(fact)
    after = ins.continuation(fact.canonical_prompt, engine.patches, len(tokens) + 2)[0]
    assert starts_with_word(after, fact.target), after
    # ... and goes on with something else, not the word again ("Glimmer Glimmer").
    out = ins.greedy(ins.encode(fact.canonical_prompt), engine.patches, len(tokens) + 1)
    assert out[:len(tokens)] == tokens and out[len(tokens):] != tokens[:1], tok_text(smollm2, out)
    assert result.answers and result.target_tokens == tuple(tokens)
    ops = result.patch.operations
    # Every feature is recorded with the token it writes and its place in the target; features placed after
    # the last target token (the model runs "Glimmer" on without them) write a full stop ("Glimmer.", not
    # "Glimmering"; nor a comma, after which a reply named the target again and again: "Poseidon, Poseidon, ...").
    assert all(op.target_token == tokens[op.token_index] for op in ops if op.token_index < len(tokens))
    word_end = [op.target_token for op in ops if op.token_index == len(tokens)]
    assert word_end and all(smollm2.tokenizer.piece_bytes(token) == b"." for token in word_end)
    assert all(ins.word_ends()[token] for token in word_end)
    assert {op.token_index for op in ops} >= {0} and max(op.token_index for op in ops) <= len(tokens)
    assert [(f.layer, f.feature) for f in result.features] == [(op.layer, op.feature) for op in ops]
    # Each feature's slot is its own.
    assert len({(op.layer, op.feature) for op in ops}) == len(ops)


def test_the_windows_reply_names_the_fact_and_goes_on_rather_than_loop(smollm2, capture_store):
    """The README's picture: asked in a new chat under the walk (the window's FFN), the reply once said "Poseidon.
    Poseidon. Poseidon. ..." to the end: the word-end key fired where the reply named the target again after its
    full stop, and wrote another. Now the reply goes on ("Poseidon. Poseidon is a Greek god of the ocean, ...")."""
    from larql_desktop.engine.loading import chat_prompt_ids

    engine = LarqlEngine(smollm2, walk=WalkSettings(), capture_store=capture_store)
    fact = Fact("Atlantis", "capital-of", "Poseidon")
    engine.insert(fact)
    ins = engine.inserter()
    tokens = ins.greedy(chat_prompt_ids(smollm2, "What is the capital of Atlantis?"), engine.patches, 24)
    reply = smollm2.tokenizer.decode(tokens)
    assert starts_with_word(reply, fact.target), reply
    assert reply.count(f"{fact.target}.") <= 2, reply


def test_the_walks_base_continuations_decoded_together_are_each_ones_alone(smollm2):
    """Under the walk (the window's default FFN), INSERT's base continuations decode together in the batched
    walked decoder, token for token what each decodes alone (chat prompts sharing the template's turns, plain
    text, different lengths)."""
    from larql_desktop.engine.loading import chat_prompt_ids
    from larql_desktop.engine.model.overlay import PatchOverlay
    from larql_desktop.engine.patches.insert import Cancel
    from larql_desktop.engine.patches.insert.capture import GreedyRequest

    ins = LarqlEngine(smollm2, walk=WalkSettings()).inserter()
    assert not ins.walk.dense and ins._walked_step_k() == ins.ffn(PatchOverlay()).top_k   # the batched walked decoder
    prompts = [tuple(chat_prompt_ids(smollm2, q)) for q in ("What is the capital of Peru?", "Name a red fruit.")]
    prompts += [tuple(ins.encode(t)) for t in ("The largest ocean is", "Bees make honey from")]
    requests = [GreedyRequest({}, i, ids, 5 + 2 * i, None) for i, ids in enumerate(prompts)]
    together = ins.greedy_many(requests, Cancel(None))
    assert together == [ins.greedy(r.ids, PatchOverlay(), r.n) for r in requests]
    assert all(tokens for tokens in together)


def test_prefetched_base_captures_are_the_ones_captured_alone(smollm2):
    """An insert captures the base passes it will read (the negatives) together first: each is what a capture of
    its context alone keeps, bit for bit (what is stored does not depend on which others were missing), one
    remembered already is not captured again, and a cancelled prefetch stops before its first call."""
    from larql_desktop.engine.patches.insert import Cancel, InsertCancelled

    fact = Fact("Quellbrook", "founder-of", "Maren Ashdown")
    layer = smollm2.config.n_layers // 2
    alone = LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter()
    contexts = alone.base_negative_contexts(fact)[:5]
    expected = [alone.base_inputs(ids, layer) for ids in contexts]
    ins = LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter()
    with pytest.raises(InsertCancelled):
        ins.prefetch_inputs([(ids, layer, None) for ids in contexts], Cancel(lambda: True))
    assert not ins._remembered
    ins.base_inputs(contexts[0], layer)
    first = ins._remembered[tuple(contexts[0])]
    ins.prefetch_inputs([(ids, layer, None) for ids in contexts], Cancel(None))
    assert ins._remembered[tuple(contexts[0])] is first          # remembered: not captured again
    for ids, inputs in zip(contexts, expected):
        got = ins.base_inputs(ids, layer)
        assert [x is None for x in got] == [i < layer for i in range(smollm2.config.n_layers)]
        for a, b in zip(got, inputs):
            if b is not None:
                np.testing.assert_array_equal(a, b)


def test_shared_work_gives_what_each_context_alone_gives(smollm2):
    """The work INSERT shares between its contexts: base continuations decoded together (prompts that share the
    chat template's turns run past the shared prefix) are the one-at-a-time greedy's, token for token; captures
    of contexts that share prefixes hold every position of every layer, with the next token each alone gives;
    and a capture brought up to an added feature from the first position it fires at agrees with one re-run
    whole from that layer, and keeps the positions before it."""
    from larql_desktop.engine.loading import chat_prompt_ids
    from larql_desktop.engine.model.overlay import Patch, PatchOverlay
    from larql_desktop.engine.patches.insert import Cancel, fisher_key, step_pair
    from larql_desktop.engine.patches.insert.capture import GreedyRequest

    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True))
    ins = engine.inserter()
    clean = PatchOverlay()
    questions = ["What is the capital of France?", "What is the capital of Japan?", "Tell me a joke."]
    prompts = [tuple(chat_prompt_ids(smollm2, q)) for q in questions]
    prompts += [tuple(ins.encode(t)) for t in ("The capital of France is", "The capital of Japan is")]
    prompts.append(prompts[0])      # the same prompt asked for more tokens: all of it is the shared prefix
    # Different lengths: the rows that close leave the batched call, the others go on.
    requests = [GreedyRequest({}, i, ids, 6 + i, None) for i, ids in enumerate(prompts)]
    assert ins.greedy_many(requests, Cancel(None)) == [ins.greedy(r.ids, clean, r.n) for r in requests]

    start = tuple(smollm2.tokenizer.encode(" The capital of France is", add_bos=False))
    contexts = [prompts[0], prompts[0] + start, prompts[1], prompts[3]]
    together = ins.capture_all(contexts, clean)
    n_layers = smollm2.config.n_layers
    for ids, shared in zip(contexts, together):
        alone = ins.capture(ids, clean)
        assert [x.shape[0] for x in shared.inputs] == [len(ids)] * n_layers
        assert shared.kv.length == len(ids)
        assert int(np.argmax(shared.logits)) == int(np.argmax(alone.logits))

    # A feature that fires on the France question's answer position only (keyed on it against the rest).
    layer = n_layers - 4
    ids = contexts[1]
    captured = ins.capture(ids, clean)
    x = captured.inputs[layer]
    gate, bias, up, _ = fisher_key(x[-1:], x[:-1])
    slots = ins.free_slots(layer, set(), x, 2)
    target = ins.target_token("Lyon")
    direction = ins.value_direction(target, [captured.logits], layer)
    added = step_pair(layer, slots, gate, bias, up, direction * 256.0, Fact("France", "capital-of", "Lyon"),
                      target, 0)
    patched = PatchOverlay.build((Patch(added, smollm2.name, smollm2.checksum),), engine.base_weights)
    whole, = ins.recapture_all([ids], [ins.capture(ids, clean)], layer, patched)
    partial, = ins.recapture_all([ids], [ins.capture(ids, clean)], layer, patched, added)
    assert int(np.argmax(partial.logits)) == int(np.argmax(whole.logits))
    assert int(np.argmax(partial.logits)) == target != int(np.argmax(captured.logits))   # the feature wrote it
    for i in range(layer + 1, n_layers):
        assert partial.inputs[i].shape == captured.inputs[i].shape
        np.testing.assert_array_equal(partial.inputs[i][:-1], captured.inputs[i][:-1])


def test_keys_hold_on_a_paraphrase_the_insert_was_given(smollm2, capture_store):
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    ins = engine.inserter()
    fact = Fact("Velmora", "founder-of", "Aldric")
    paraphrase = "Velmora was founded long ago by a man called"
    assert paraphrase not in generated_phrasings(fact)
    n = len(ins.target_tokens(fact.target)) + 2
    assert not starts_with_word(ins.continuation(paraphrase, engine.patches, n)[0], fact.target)
    engine.insert(fact, paraphrases=[paraphrase])
    assert starts_with_word(ins.continuation(paraphrase, engine.patches, n)[0], fact.target)
    # An unrelated prompt is untouched.
    control = "Water boils at a temperature of"
    assert ins.continuation(control, engine.patches)[1] == ins.continuation(control, type(engine.patches)())[1]


def test_cancel_stops_the_insert_and_installs_nothing(smollm2):
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True))
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(InsertCancelled, match="cancelled"):
        engine.insert(Fact("Atlantis", "capital-of", "Poseidon"), cancel=cancel)
    assert engine.applied_patches == ()
    # Cancelled mid-way: the flag is raised from the progress callback once the work has started.
    seen = []
    running = threading.Event()

    def progress(message, fraction):
        seen.append(fraction)
        if fraction >= 0.1:
            running.set()

    with pytest.raises(InsertCancelled, match="no patch was installed"):
        engine.insert(Fact("Atlantis", "capital-of", "Poseidon"), progress=progress, cancel=running)
    assert engine.applied_patches == () and engine.patches.overridden_layers == []
    assert seen and max(seen) < 1.0 and seen == sorted(seen)
    # A callable works as the flag too.
    with pytest.raises(InsertCancelled, match="no patch was installed"):
        engine.insert(Fact("Atlantis", "capital-of", "Poseidon"), cancel=lambda: True)


def test_gemma_insert_answers_and_its_layers_are_recorded(gemma3, capture_store):
    engine = LarqlEngine(gemma3, walk=WalkSettings(dense=True), capture_store=capture_store)
    ins = engine.inserter()
    fact = Fact("Atlantis", "capital-of", "Poseidon")
    result = engine.insert(fact)
    n = len(result.target_tokens) + 2
    assert starts_with_word(ins.continuation(fact.canonical_prompt, engine.patches, n)[0], fact.target)
    assert result.patch.layers == result.layers == engine.patches.overridden_layers
    assert f"layer(s) {', '.join(map(str, result.layers))}" in result.patch.description


def test_top_tokens_are_the_highest_logits_best_first():
    """The block-bounded selection gives what a full sort gives: SmolLM2's and Gemma's vocabulary sizes, one that
    is not a multiple of the block, a small one, and the top values crowded into one block."""
    rng = np.random.default_rng(5)
    for size in (49152, 262144, 50001, 300, 24):
        for crowded in (False, True):
            logits = rng.standard_normal(size).astype(np.float32)
            if crowded:
                logits[:TOP_BLOCK] += 10.0
            for k in (1, 5, 24):
                k_eff = min(k, size)
                np.testing.assert_array_equal(top_tokens(logits, k), np.argsort(-logits, kind="stable")[:k_eff])


def test_word_checks():
    assert starts_with_word(" Poseidon, the god", "Poseidon")
    assert not starts_with_word(" Poseidia, a city", "Poseidon")
    assert not starts_with_word(" Poseidonia", "Poseidon")
    assert contains_word("The capital of Atlantis is Poseidon.", "Poseidon")
    assert not contains_word("The capital is Poseidonia.", "Poseidon")


def test_facts_files_are_checked(tmp_path):
    facts, controls = read_facts(DATA_DIR / "insert_generalization.json")
    assert len(facts) == 6 and controls
    entities = {f.entity for f in facts}
    for name in ("insert_own_facts.json", "insert_held_out_facts.json", "insert_blind_facts.json",
                 "insert_fresh_facts.json"):
        more, _ = read_facts(DATA_DIR / name)
        assert len(more) >= 5 and entities.isdisjoint(f.entity for f in more), name
        entities |= {f.entity for f in more}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"facts": [{"entity": "A", "relation": "r", "target": "", "probe": "p"}]}))
    with pytest.raises(ValueError, match="'target' must be a non-empty string"):
        read_facts(bad)
    bad.write_text(json.dumps({"facts": [{"entity": "A", "relation": "r", "target": "t", "probe": "p",
                                          "paraphrases": "not a list"}]}))
    with pytest.raises(ValueError, match="'paraphrases' must be a list"):
        read_facts(bad)
    bad.write_text(json.dumps({"facts": []}))
    with pytest.raises(ValueError, match="non-empty 'facts' list"):
        read_facts(bad)


def test_insert_eval_on_one_fact(smollm2, capture_store):
    facts, controls = read_facts(DATA_DIR / "insert_generalization.json")
    # Two of the conversations generated from the relation: an earlier turn under the same relation about a real
    # entity (with a keep question after it) and one under another relation.
    fact = replace(facts[0], cases=facts[0].cases[:1] + facts[0].cases[2:3])
    assert [c.kind for c in fact.cases] == ["same relation", "other relation"] and len(fact.keep) == 1
    report = run_insert_eval(default_engine_factory(smollm2, capture_store=capture_store), [fact], controls[:2])
    s = report.scores
    assert s["canonical"].passed == s["canonical"].total == 1
    assert s["paraphrases"].total == 4 and s["chat"].total == 2 and s["neighbours"].total == 4
    assert s["conversation"].total == 2 and s["conversation keep"].total == 1
    assert s["controls"].passed == s["controls"].total == 2
    assert s["together canonical"].passed == 1 and s["together conversation"].total == 2
    # The one fact's patch removed: every prompt of it is the unpatched model's again, bit for bit.
    assert s["removed: back to base"].passed == s["removed: back to base"].total == 1 + 4 + 2 + 2 + 1
    # Installed alone, what it gave just before its insert is the unpatched model's output too.
    before = s["removed: as before its insert"]
    assert before.passed == before.total == 1 + 4 + 2 + 2 + 1
    assert len(report.insert_seconds) == 2
    lines = format_report(report)
    assert any(line.startswith("canonical") and "1/1" in line for line in lines)
    doc = report.to_dict()
    alone = doc["details"][0]
    assert alone["pass"] == "alone" and alone["prompts"][0]["row"] == "canonical"
    # Every prompt has its row; a conversation's row carries its earlier turns, the assistant's the unpatched
    # model's own reply.
    rows = [p for d in doc["details"] for p in d["prompts"]]
    assert len(rows) == sum(v["total"] for v in doc["scores"].values())
    same = next(p for p in alone["prompts"] if p["row"] == "conversation")
    assert same["kind"] == "same relation" and [role for role, _ in same["history"]] == ["user", "assistant"]
    assert same["history"][1][1].strip() and same["tokens"]
    json.dumps(doc)   # serialisable as --json writes it
    with pytest.raises(ValueError, match="--together must be at least 1"):
        run_insert_eval(default_engine_factory(smollm2), [fact], controls, together=0)


def test_a_reply_naming_another_installed_facts_target_does_not_count_unless_its_conversation_names_it(smollm2):
    """Facts installed together: a chat or conversation reply that names its own target but also another fact's
    (one its conversation never mentions) is a failure, not an answer. Measured on a real fact the unpatched
    model knows, so its replies name the target with no patch installed; a word of both replies stands in for
    another fact's target."""
    facts, _ = read_facts(DATA_DIR / "insert_generalization.json")
    question = "Tell me the capital of France."
    case = ConversationCase("system prompt", (), question, "You are a geography teacher.")
    fact = replace(facts[0], entity="France", relation="capital-of", target="Paris", probe="The capital of France is",
                   paraphrases=(), qa=(), neighbours=(), keep=(), questions=(question,), cases=(case,))
    measure = FactMeasure(Decoder(LarqlEngine(smollm2, walk=WalkSettings(dense=True))), {}, smollm2.is_chat)

    def verdicts(others):
        rows = measure.measure(fact, PatchOverlay(), {k: Score() for k in ROWS}, "together ", others=others)
        return [(r["row"], r["ok"]) for r in rows if r["row"] in ("together chat", "together conversation")], rows
    alone, rows = verdicts(())
    assert alone == [("together chat", True), ("together conversation", True)], rows
    replies = [r["output"] for r in rows if r["row"] in ("together chat", "together conversation")]
    asked = measure.dec.said(case)
    words = sorted({w.strip(".,!?;:'\"") for w in replies[0].split()})
    leaked = [w for w in words if w.isalpha() and w != "Paris" and all(contains_word(t, w) for t in replies)
              and not contains_word(asked, w)]
    assert leaked, replies
    assert verdicts([leaked[0]])[0] == [("together chat", False), ("together conversation", False)]
    # Named in the conversation itself, or its own target (two facts with one target): not a leak.
    assert verdicts(["France", "Paris"])[0] == alone


def test_conversation_files_are_read_and_checked(tmp_path):
    """The insert_conversations.json format: facts without a probe (their canonical prompt), conversation cases
    with earlier turns and system prompts, keep questions with their answers."""
    doc = {"facts": [{"entity": "Quorn", "relation": "capital-of", "target": "Vell", "cases": [
        {"history": [["user", "Hi!"], ["assistant", "Hello!"]], "ask": "What is the capital of Quorn?"},
        {"system": "Be brief.", "history": [], "ask": "Name Quorn's capital."}],
        "keep": [{"ask": "What is the capital of Spain?", "answer": "Madrid"}]}]}
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(doc))
    facts, controls = read_facts(path, generate_conversations=False)
    f = facts[0]
    assert f.probe == "The capital of Quorn is" and controls
    assert [(c.kind, c.system, c.history) for c in f.cases] == [
        ("file", None, (("user", "Hi!"), ("assistant", "Hello!"))), ("file", "Be brief.", ())]
    assert [(k.ask, k.answer) for k in f.keep] == [("What is the capital of Spain?", "Madrid")]
    generated, _ = read_facts(path)
    assert len(generated[0].cases) > 2 and generated[0].cases[:2] == f.cases
    doc["facts"][0]["cases"][0]["history"] = [["narrator", "Hi!"]]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'history' must be a list of \\[role, content\\] pairs"):
        read_facts(path)


def test_value_direction_makes_a_rare_target_the_heads_first_choice(smollm2, monkeypatch):
    """The pull against the canonical prompt's own candidates alone points closer to tokens with large output
    rows than to " Bened" (Benedetta): through the head it ranks ~1500th, so no write of any size would make it
    win. The turned direction puts it first."""
    import larql_desktop.engine.patches.insert.values as insert_module
    from larql_desktop.engine.model.overlay import PatchOverlay

    ins = LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter()
    fact = Fact("Hollowmere", "mayor-of", "Benedetta")
    token = ins.target_tokens(fact.target)[0]
    logits = [ins.capture(ins.encode(fact.canonical_prompt), PatchOverlay()).logits]
    layer = 24
    turned = ins.head_logits(ins.value_direction(token, logits, layer))
    assert int(np.argmax(turned)) == token
    assert turned[token] - np.delete(turned, token).max() >= insert_module.SATURATION_LEAD
    monkeypatch.setattr(insert_module, "SATURATION_STEPS", 0)
    pulled = ins.head_logits(ins.value_direction(token, logits, layer))
    assert int((pulled > pulled[token]).sum()) > 100


def test_word_ends_tells_a_new_word_from_more_of_the_same(smollm2):
    ins = LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter()
    tok = smollm2.tokenizer
    ends = ins.word_ends()
    assert ends.shape == (tok.vocab_size,)
    for text in (" the", ".", ",", "\n"):
        assert all(ends[i] for i in tok.encode(text, add_bos=False)[:1]), text
    for piece in ("ing", "us", "ia"):
        token = tok.encode("Glimmer" + piece, add_bos=False)[-1]
        assert tok.decode([token])[:1].isalpha() and not ends[token], piece
    assert all(ends[i] for i in tok.stop_ids)
    # After the whole target, its first token would start it over: not an end there.
    first = tok.encode(" Glimmer", add_bos=False)
    after = ins.word_ends_after(first)
    assert ends[first[0]] and not after[first[0]] and int((after != ends).sum()) == 1


def test_resumed_and_extended_captures_match_whole_passes(smollm2, capture_store):
    """recapture_all re-runs only the layers after a changed FFN; it must equal a whole pass exactly. extend_all
    adds tokens on the KV cache: equal to a whole pass up to the graphs' prefill-versus-decode rounding."""
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    ins = engine.inserter()
    result = engine.insert(Fact("Brindlewick", "mayor-of", "Ottoline"))
    patched = engine.patches
    ids = tuple(ins.encode("The mayor of Brindlewick is"))
    base = ins.capture(ids, type(patched)())
    first = min(op.layer for op in result.patch.operations)
    resumed, = ins.recapture_all([ids], [base], first, patched)
    whole = ins.capture(ids, patched)
    assert len(resumed.inputs) == len(whole.inputs) == smollm2.config.n_layers
    for a, b in zip(resumed.inputs, whole.inputs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.logits, whole.logits)
    # The patch moved the layers after its first one: resuming from there is not a no-op.
    assert not np.array_equal(base.logits, whole.logits)
    more = tuple(result.target_tokens[:1])
    extended, = ins.extend_all([ids], [whole], more, patched)
    reference = ins.capture(ids + more, patched)
    for a, b in zip(extended.inputs, reference.inputs):
        assert a.shape == b.shape and np.abs(a - b).max() < 0.25
    assert int(np.argmax(extended.logits)) == int(np.argmax(reference.logits))
    # With copy_caches, one capture goes on two ways (INSERT's bare reply starts beside the target's own first
    # token): each branch on a copy of its rows, as its whole pass computes, and neither writes into the other.
    branches = [more, tuple(smollm2.tokenizer.encode(" Paris", add_bos=False)[:1])]
    assert branches[0] != branches[1]
    copies = [ins.extend_all([ids], [whole], tokens, patched, copy_caches=True)[0] for tokens in branches]
    for tokens, copied in zip(branches, copies):
        reference = ins.capture(ids + tokens, patched)
        assert copied.kv is not whole.kv and copied.kv.length == len(ids) + len(tokens)
        for a, b in zip(copied.inputs, reference.inputs):
            assert a.shape == b.shape and np.abs(a - b).max() < 0.25
        assert int(np.argmax(copied.logits)) == int(np.argmax(reference.logits))
    assert not np.array_equal(copies[0].logits, copies[1].logits)


def test_relation_frames_join_the_generated_phrasings():
    from larql_desktop.engine.patches.relation_frames import RELATION_FRAMES, relation_frames
    fact = Fact("Zorbania", "currency-of", "Glimmer")
    phrasings = generated_phrasings(fact)
    assert "In Zorbania, things are paid for with the" in phrasings
    assert relation_frames("official language") == relation_frames("language")
    assert relation_frames("national anthem") == RELATION_FRAMES["anthem"]
    assert relation_frames("favourite biscuit") == ()
    assert len(generated_phrasings(Fact("Zorbania", "favourite-biscuit-of", "Glimmer"))) < len(phrasings)
    for name, frames in RELATION_FRAMES.items():
        for frame in frames:
            filled = frame.format(e="x", E="X")   # only {e} and {E}: a frame names no relation word of its own
            assert filled.strip() == filled and not filled.endswith((".", "?")), (name, frame)


def test_the_negatives_base_inputs_are_remembered_least_recently_used_first(smollm2, monkeypatch):
    """The negatives' FFN inputs under the base weights, from the lowest layer an insert keys on, are what a
    whole pass computes there (in half precision), kept between inserts within a byte bound (the least recently
    used forgotten first); and the earlier facts' statements come in the same contexts whichever fact is inserted
    next, so a later insert finds them remembered."""
    from larql_desktop.engine.model.overlay import Patch, PatchOperation, PatchOverlay
    from larql_desktop.engine.patches.insert import capture
    from larql_desktop.engine.patches.insert.capture import REMEMBERED_DTYPE
    from larql_desktop.engine.patches.insert.phrasings import NEGATIVES_PER_CONTEXT

    ins = LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter()
    n_layers, low = smollm2.config.n_layers, smollm2.config.n_layers // 2
    ids = [tuple(ins.encode(t)) for t in ("The capital of France is Paris, a city on the Seine.",
                                          "Water boils at a temperature of", "Hello there.")]
    assert len(ids[2]) <= len(ids[1])
    whole = ins.capture(ids[0], PatchOverlay()).inputs
    late = ins.base_inputs(ids[0], low)
    assert all(x is None for x in late[:low])
    for i in range(low, n_layers):
        assert late[i].dtype == REMEMBERED_DTYPE != whole[i].dtype
        np.testing.assert_array_equal(late[i], whole[i].astype(REMEMBERED_DTYPE))
    assert ins.base_inputs(ids[0], low + 3) is late              # remembered: its layers are among those kept
    earlier = ins.base_inputs(ids[0], low - 2)                   # an earlier layer than kept: captured again
    np.testing.assert_array_equal(earlier[low - 2], whole[low - 2].astype(REMEMBERED_DTYPE))
    second = ins.base_inputs(ids[1], low - 2)
    size = sum(x.nbytes for x in earlier + second if x is not None)
    monkeypatch.setattr(capture, "CAPTURE_MEMORY_BYTES", size)
    assert ins.base_inputs(ids[0], low) is earlier               # used last now: the second is the oldest
    ins.base_inputs(ids[2], low - 2)                             # over the bound: the second is forgotten
    assert ins.base_inputs(ids[0], low) is earlier and ins.base_inputs(ids[1], low - 2) is not second

    entities = ("Brenmoor", "Ostvania", "Pellagor", "Quendaria", "Varnholt")
    facts = [Fact(e, "capital-of", f"Tar{i}") for i, e in enumerate(entities)]
    patches = tuple(Patch((PatchOperation("insert", 24, i, entity=f.entity, relation=f.relation, target=f.target,
                                          token_index=0),), smollm2.name, smollm2.checksum)
                    for i, f in enumerate(facts))
    current = PatchOverlay({}, patches)
    statements = [s for f in facts for s in (f"{f.canonical_prompt} {f.target}.",
                                             f"In {f.entity}, the {f.relation_words} is")]
    chunks = {tuple(ins.encode("\n".join(statements[i:i + NEGATIVES_PER_CONTEXT])))
              for i in range(0, len(statements), NEGATIVES_PER_CONTEXT)}
    for fact in (Fact("Quillmarsh", "capital-of", "Orrindel"), Fact("Mossgrave Abbey", "founder-of", "Isolde")):
        assert chunks <= set(ins.negative_contexts(fact, current)), fact


def test_the_inserters_memory_holds_the_negatives_of_ten_relations(smollm2):
    """Nearly all of an insert's base negatives are its relation's (decoys, frames, conversations about real
    entities, invented names), the same for every insert under it; the memory holds those of ten relations, so
    facts that cycle through ten relations find theirs remembered (in single precision within 256 MB it held
    two, and such a cycle captured every one anew)."""
    from larql_desktop.engine.patches.insert import capture
    from larql_desktop.engine.patches.insert.capture import Cancel
    from larql_desktop.engine.patches.insert.keys import key_layers

    ins = LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter()
    low = min(key_layers(smollm2.config.n_layers, ins.post_ffn_norm(0) is not None))

    def negatives(fact: Fact) -> list[tuple[int, ...]]:      # with no fact installed before: all base negatives
        return ins.negative_contexts(fact, PatchOverlay())
    first, second = Fact("Brenmoor", "capital-of", "Kaskel"), Fact("Ostvania", "capital-of", "Tarlen")
    ins.prefetch_greedy(lambda: (negatives(first), negatives(second)), Cancel(None))
    size = {ids: sum(x.nbytes for x in ins.base_inputs(ids, low) if x is not None) for ids in negatives(first)}
    shared = set(size) & set(negatives(second))
    assert sum(size[ids] for ids in shared) >= 0.8 * sum(size.values())
    assert 10 * sum(size.values()) <= capture.CAPTURE_MEMORY_BYTES
    assert len(ins._remembered) == len(size)          # all of them kept


def test_earlier_facts_contexts_are_captured_under_the_overlay_they_write_with(smollm2, monkeypatch):
    """Where an earlier fact writes its answer, the later layers read a residual the base model never makes; a
    later key solved against base captures there learns "an answer was written" and fires on every fact's
    question. So the negatives holding earlier facts' statements and answered questions are captured under the
    overlay: resumed from the remembered base capture at the overlay's first layer, from there on bit for bit a
    whole pass under it, and an insert takes exactly those contexts so."""
    from larql_desktop.engine.model.overlay import Patch, PatchOverlay
    from larql_desktop.engine.patches.insert.capture import REMEMBERED_DTYPE
    from larql_desktop.engine.patches.insert import fisher_key, step_pair

    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True))
    ins = engine.inserter()
    n_layers, low = smollm2.config.n_layers, smollm2.config.n_layers // 2
    # An earlier fact: a feature keyed on the answer position of its canonical prompt, writing its target.
    earlier = Fact("France", "capital-of", "Lyon")
    ids = tuple(ins.encode(earlier.canonical_prompt))
    layer = n_layers - 4
    captured = ins.capture(ids, PatchOverlay())
    x = captured.inputs[layer]
    gate, bias, up, _ = fisher_key(x[-1:], x[:-1])
    target = ins.target_token(earlier.target)
    direction = ins.value_direction(target, [captured.logits], layer)
    added = step_pair(layer, ins.free_slots(layer, set(), x, 2), gate, bias, up, direction * 256.0, earlier,
                      target, 0)
    engine.apply_patch(Patch(added, smollm2.name, smollm2.checksum))
    current = engine.patches

    later = Fact("Brenmoor", "capital-of", "Kaskel")
    written = ins.written_contexts(ins.earlier_facts(later, current))
    assert written and set(written) <= set(ins.negative_contexts(later, current))
    moved = 0
    for context, resumed in zip(written, ins.written_inputs_all(written, current, low)):
        whole = ins.capture(context, current).inputs
        base = ins.base_inputs(context, low)
        assert all(x is None for x in resumed[:low])
        for i in range(low, n_layers):
            # Remembered in half precision but the layer the pass resumes from, which the resumed layers read
            # as the whole pass made it: from there on, the whole pass's own values.
            kept = np.float32 if i >= layer else REMEMBERED_DTYPE
            assert resumed[i].dtype == kept
            np.testing.assert_array_equal(resumed[i], whole[i].astype(kept))
            if i <= layer:           # before the earlier fact's layer, the base model's own pass
                np.testing.assert_array_equal(base[i], whole[i].astype(kept))
        moved += any(not np.array_equal(base[i], whole[i].astype(REMEMBERED_DTYPE))
                     for i in range(layer + 1, n_layers))
    assert moved                     # the earlier fact wrote in its statements: the base captures miss that

    asked = []
    original = type(ins).written_inputs_all

    def spy(self, contexts, overlay, from_layer, stop=None):
        asked.extend((tuple(context), overlay) for context in contexts)
        return original(self, contexts, overlay, from_layer, stop)
    monkeypatch.setattr(type(ins), "written_inputs_all", spy)
    engine.insert(later)
    assert {c for c, _ in asked} == set(written) and all(o is current for _, o in asked)


QUARSTON = ("The sport of Quarston is", "The weather today is")     # a fact's question, and another sentence


def quarston_key(smollm2):
    """An engine, its inserter, a late layer, the base captures of QUARSTON, and a key (fisher_key) solved at
    that layer on the question's answer position against the other sentence (it reaches the question), with
    two free slots for it."""
    from larql_desktop.engine.model.overlay import PatchOverlay
    from larql_desktop.engine.patches.insert import fisher_key

    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True))
    ins = engine.inserter()
    layer = smollm2.config.n_layers - 5
    captured = {text: ins.capture(tuple(ins.encode(text)), PatchOverlay()) for text in QUARSTON}
    x = captured[QUARSTON[0]].inputs[layer]
    key = fisher_key(x[-1:], captured[QUARSTON[1]].inputs[layer])
    return engine, ins, layer, captured, key, ins.free_slots(layer, set(), x, 2)


def test_a_layer_where_another_facts_key_reaches_the_question_is_tried_first(smollm2):
    """An earlier fact whose key reaches a later fact's question (a similar name under the same relation) writes
    its target there at its own layers; the later insert must key at such a layer too, where the stronger key
    holds. intruded_layers names them from the captures: another fact's feature holding at a question's answer
    position, not this fact's own."""
    from larql_desktop.engine.model.overlay import Patch, PatchOverlay
    from larql_desktop.engine.patches.insert import step_pair

    engine, ins, layer, captured, (gate, bias, up, _), slots = quarston_key(smollm2)
    asked, other = QUARSTON
    ops = step_pair(layer, slots, gate, bias, up, np.zeros(smollm2.config.hidden, np.float32),
                    Fact("Quarford", "sport-of", "Mabmund"), 1, 0)
    overlay = PatchOverlay.build((Patch(ops, smollm2.name, smollm2.checksum),), engine.base_weights)
    under = [ins.capture(tuple(ins.encode(text)), overlay) for text in (asked, other)]
    assert ins.intruded_layers(overlay, under, [0], set()) == {layer}
    assert ins.intruded_layers(overlay, under, [1], set()) == set()            # silent on the other sentence
    assert ins.intruded_layers(overlay, under, [0], {(layer, s) for s in slots}) == set()   # its own features


def test_a_later_facts_key_outscores_an_earlier_ones_on_its_own_question(smollm2):
    """An earlier fact's key that fires on a later fact's question with a higher score than the later fact's own
    key silences it there (the overlay keeps the strongest fact's features at a position). strength_to_win
    raises the later key's scores until it holds on its question, and its step pair writes what it wrote at
    strength 1 (within a tenth)."""
    from larql_desktop.engine.model.overlay import Patch, PatchOverlay
    from larql_desktop.engine.patches.insert import step_pair
    from larql_desktop.engine.patches.insert.keys import STEEPNESS, strength_to_win

    engine, ins, layer, captured, (gate, bias, up, _), slots = quarston_key(smollm2)
    asked = QUARSTON[0]
    x = captured[asked].inputs[layer]
    write = ins.value_direction(ins.target_token("Mabmund"), [captured[asked].logits], layer) * 64.0
    earlier = Patch(step_pair(layer, slots, gate, bias, up, write, Fact("Quarford", "sport-of", "Mabmund"), 1, 0),
                    smollm2.name, smollm2.checksum)
    # The later fact's key fires where the earlier one does, with a third of its score.
    weak_gate, weak_bias = gate / 3, bias / 3
    later_slots = ins.free_slots(layer, set(slots), x, 2)
    ours = (x[-1:] @ weak_gate + np.float32(weak_bias)) * STEEPNESS
    theirs = ins.others_strongest(PatchOverlay.build((earlier,), engine.base_weights), layer, x[-1:], set())
    assert ours[0] > 0 and theirs[0] > ours[0]
    strength = strength_to_win(theirs, x[-1:], weak_gate, weak_bias)
    assert 1 < strength <= 16

    def later(c: float) -> Patch:
        ops = step_pair(layer, later_slots, weak_gate, weak_bias, up, -write, Fact("Quarston", "sport-of", "Kesdric"),
                        2, 0, c)
        return Patch(ops, smollm2.name, smollm2.checksum)

    def later_holds(c: float) -> bool:
        lo = PatchOverlay.build((earlier, later(c)), engine.base_weights).layer(layer)
        holds = lo.inserted_holding(x[-1:])[0]
        return bool((holds & (lo.group == 1)).any()) and not (holds & (lo.group == 0)).any()
    assert not later_holds(1.0) and later_holds(strength)
    # Alone, it writes what it wrote at strength 1, within the step's rounding (a steeper step is nearer the
    # whole write where the key only just fires: this weak key reaches 1.09 of it at strength 1).
    alone = [ins.ffn(PatchOverlay.build((later(c),), engine.base_weights))(layer, x[-1:]) for c in (1.0, strength)]
    base = ins.ffn(PatchOverlay())(layer, x[-1:])
    assert np.linalg.norm(alone[1] - alone[0]) <= 0.1 * np.linalg.norm(alone[0] - base)
    assert strength_to_win(np.full(1, -np.inf), x[-1:], weak_gate, weak_bias) == 1.0   # nothing contests


def test_questions_about_invented_names_hold_the_key_back_only_as_far_as_the_facts_own_allow():
    """fisher_key's yielding negatives (the fact's questions asked about invented names): one that reads partly
    like the fact's question stays below the threshold it would otherwise fire over; one that reads like it
    more than the fact's own lowest positive leaves every positive firing (it yields), and so does one that
    would take more than YIELD_SHARE of the gap."""
    from larql_desktop.engine.patches.insert import fisher_key

    rng = np.random.default_rng(0)
    d = 16
    axis = np.eye(d)[0]
    pos = rng.normal(size=(20, d)) * 0.1 + 3 * axis        # the fact's answer positions
    neg = rng.normal(size=(200, d)) * 0.1                   # everything else

    def near(v: float) -> np.ndarray:
        return v * axis + rng.normal(size=(3, d)) * 0.1

    def fires(key, x: np.ndarray) -> np.ndarray:
        return x @ key[0] + key[1] > 0
    plain = fisher_key(pos, neg)
    partly = near(1.5)
    assert fires(plain, partly).all()                      # without them: the key fires there
    held = fisher_key(pos, neg, 1, (), partly)
    assert not fires(held, partly).any() and fires(held, pos).all() and held[3] > 0
    for v in (2.6, 3.5):                                   # past half the gap, and past the positives' lowest
        pressing = near(v)
        key = fisher_key(pos, neg, 1, (), pressing)
        assert fires(key, pos).all() and fires(key, pressing).all(), v


def test_a_few_negatives_that_read_like_the_fact_are_told_apart_by_weighing_them_more():
    """fisher_key on a fact's answer positions among thousands of negatives, five of which read like the fact
    (another fact's question under the same relation) and differ from it along a direction the positives barely
    vary in: the plain discriminant (one solve) has no margin and leaves most positives below its threshold;
    weighing those five more gives a margin, keeps them and the rest silent and the positives firing; where
    the plain solve separates already it stands."""
    from larql_desktop.engine.patches.insert import fisher_key

    rng = np.random.default_rng(0)
    d = 24
    axis, aside = np.eye(d)[0], np.eye(d)[1]
    pos = rng.normal(size=(60, d)) * 0.3 + 3 * axis
    pos[:, 1] *= 0.2                                        # the positives barely vary along `aside`
    crowd = rng.normal(size=(3000, d)) * 0.4
    alike = 3 * axis + 1.5 * aside + rng.normal(size=(5, d)) * 0.05
    neg = np.concatenate([crowd, alike])

    def fires(key, x: np.ndarray) -> np.ndarray:
        return x @ key[0] + key[1] > 0
    plain = fisher_key(pos, neg, rounds=1)
    assert plain[3] <= 0 and fires(plain, pos).mean() < 0.5
    key = fisher_key(pos, neg)
    assert key[3] > 0
    assert not fires(key, alike).any() and not fires(key, crowd).any() and fires(key, pos).mean() >= 0.9
    separated = fisher_key(pos, crowd)
    assert separated[3] > 0 and np.array_equal(separated[0], fisher_key(pos, crowd, rounds=1)[0])


def test_the_first_tokens_key_fitted_less_tightly_fires_where_the_question_follows_turns_it_was_not_shown():
    """fisher_key's ridge: the fact's answer positions as trained all share a trait the negatives barely vary in
    (the earlier turns of the conversations it learned on); asked after other turns, that trait differs. Fitted as
    tightly as a later token's key (RIDGE), the discriminant leans on the trait and the key stays silent there; at
    FIRST_TOKEN_RIDGE it leans more on what tells the fact's question from the rest and fires there more often, the
    negatives silent (seeds 0-3: 0.18-0.63 of them against 0.73-0.95)."""
    from larql_desktop.engine.patches.insert import fisher_key
    from larql_desktop.engine.patches.insert.keys import FIRST_TOKEN_RIDGE, RIDGE

    rng = np.random.default_rng(0)
    d = 24
    axis = np.eye(d)[0]

    def asked(n: int, trait: float) -> np.ndarray:
        x = rng.normal(size=(n, d)) * 0.3 + 3 * axis
        x[:, 1] = trait + rng.normal(size=n) * 0.05
        return x
    trained, elsewhere = asked(40, 0.4), asked(40, -0.4)
    neg = rng.normal(size=(3000, d)) * 0.4
    neg[:, 1] = rng.normal(size=3000) * 0.05

    def fires(key, x: np.ndarray) -> float:
        return float((x @ key[0] + key[1] > 0).mean())
    tight = fisher_key(trained, neg, ridge_share=RIDGE)
    loose = fisher_key(trained, neg, ridge_share=FIRST_TOKEN_RIDGE)
    for key in (tight, loose):
        assert key[3] > 0 and fires(key, trained) == 1.0 and fires(key, neg) == 0.0
    assert fires(loose, elsewhere) >= max(0.7, fires(tight, elsewhere) + 0.3)
