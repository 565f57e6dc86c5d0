"""INSERT in real conversations and for several facts at once (issue 33), on SmolLM2: the fact answers after an
earlier turn under the same relation about a real entity (whose answer the reply would otherwise copy) while that
conversation's question about another real entity keeps its reply; facts installed together each answer, and
removing one patch restores every prompt bit for bit; bad requests are refused and change nothing."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DATA_DIR

from larql_desktop.engine.analysis.reply_pass import run_reply_pass
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.patches.insert import Fact
from larql_desktop.engine.model.overlay import PatchOverlay
from larql_desktop.engine.services import contains_word, starts_with_word
from larql_desktop.tools.insert_eval import Decoder, read_facts

FIRST = Fact("Tarnhollow", "capital-of", "Gildmere")
SECOND = Fact("Mossgrave Abbey", "founder-of", "Isolde")
SAME_RELATION = Fact("Quillmarsh", "capital-of", "Orrindel")     # FIRST's relation: the keys' nearest rival
CONTROL = "Water boils at a temperature of"
REPLY_TOKENS = 40
# The exchange of issue 33's report: after it, the reply named the earlier answer ("The capital of Tarnhollow is
# Paris.") while a new chat named the inserted one.
EARLIER = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is Paris."}]


@pytest.fixture(scope="module")
def first_inserted(smollm2, capture_store):
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    result = engine.insert(FIRST)
    return engine, result


def reply(engine, messages, overlay) -> tuple[str, list[int]]:
    ins = engine.inserter()
    tokens = ins.greedy(engine.model.encode_prompt(messages), overlay, REPLY_TOKENS)
    return engine.model.tokenizer.decode(tokens), tokens


def all_logits(engine, text: str, overlay: PatchOverlay) -> np.ndarray:
    ids = engine.model.tokenizer.encode(text)
    return engine.model.transformer.forward(ids, KvCache(engine.model.config, capacity=len(ids) + 1),
                                            engine.inserter().ffn(overlay), all_logits=True)


def test_a_fact_answers_after_an_earlier_same_relation_turn_and_the_neighbour_keeps_its_reply(first_inserted):
    engine, _ = first_inserted
    asked = EARLIER + [{"role": "user", "content": "What is the capital of Tarnhollow?"}]
    before, _ = reply(engine, asked, PatchOverlay())
    after, _ = reply(engine, asked, engine.patches)
    assert not contains_word(before, FIRST.target) and contains_word(after, FIRST.target), (before, after)
    assert f"{FIRST.target} {FIRST.target}" not in after              # written once, whole
    # In the same conversation, the question about a real entity is answered as without the patch.
    neighbour = EARLIER + [{"role": "user", "content": "What is the capital of Austria?"}]
    assert reply(engine, neighbour, engine.patches)[1] == reply(engine, neighbour, PatchOverlay())[1]


def test_a_fact_answers_after_a_same_relation_turn_the_model_answered_in_its_own_words(first_inserted):
    """The earlier turn as a chat holds it: the unpatched model's own reply, which need not restate the question and
    sets a template the next reply copies ("El Diablo, the capital of Mexico." made the reply to the fact's question
    "El Diablo, the capital of Mexico." again). About countries INSERT's own conversations never ask about: the old
    inserter, which saw only statements ("The capital of France is Paris."), answered none of these four (with
    Argentina for Colombia, before INSERT's own conversations asked about Argentina)."""
    engine, _ = first_inserted
    ins = engine.inserter()
    answered = []
    for country in ("Spain", "Mexico", "Portugal", "Colombia"):
        earlier = f"What is the capital of {country}?"
        asked = [{"role": "user", "content": earlier}, {"role": "assistant", "content": ins.own_chat_reply(earlier)},
                 {"role": "user", "content": "What is the capital of Tarnhollow?"}]
        before, _ = reply(engine, asked, PatchOverlay())
        after, _ = reply(engine, asked, engine.patches)
        assert not contains_word(before, FIRST.target), before
        answered.append(contains_word(after, FIRST.target))
    assert sum(answered) >= 3, answered


def test_neighbours_asked_after_the_fact_in_the_same_conversation_keep_their_replies(first_inserted):
    """The fact's own question asked and answered (with the target) earlier in the conversation, then real
    entities under the same relation: each reply is the unpatched model's, token for token, given the same turns.
    The key must fire on the fact's entity, not on the relation's question with that entity somewhere in context."""
    engine, _ = first_inserted
    asked = EARLIER + [{"role": "user", "content": "What is the capital of Tarnhollow?"}]
    answer, _ = reply(engine, asked, engine.patches)
    assert contains_word(answer, FIRST.target), answer       # the earlier turn holds the inserted answer
    history = asked + [{"role": "assistant", "content": answer.strip()}]
    moved = []
    for neighbour in ("Austria", "Portugal", "Norway"):
        question = history + [{"role": "user", "content": f"What is the capital of {neighbour}?"}]
        after, tokens = reply(engine, question, engine.patches)
        before, base_tokens = reply(engine, question, PatchOverlay())
        if tokens != base_tokens:
            moved.append((neighbour, before, after))
    assert not moved, moved


def test_a_real_entitys_question_after_the_models_own_reply_keeps_its_reply(smollm2, capture_store):
    """insert-eval's conversation rows for a held-out fact (tests/data): after an earlier turn under the fact's
    relation about a real country, answered as the model answers ("El Salvador, also known as La España de
    Salarón, ..."), the fact's question names its target and another real country's question is answered token
    for token as without the patch. Before INSERT learned on the words of the model's own replies, its key scored
    well above its threshold at that reply's " de" and the reply about Greece turned at its 8th token."""
    facts, _ = read_facts(DATA_DIR / "insert_blind_facts.json")
    fact = next(f for f in facts if f.entity == "Ystrana")
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    engine.insert(fact.fact)
    dec = Decoder(engine)
    case = next(c for c in fact.cases if c.kind == "same relation")
    assert contains_word(dec.decode(dec.conversation(case, engine.patches)), fact.target)
    ask = fact.keep[0].ask
    assert dec.conversation(case, engine.patches, ask=ask) == dec.conversation(case, PatchOverlay(), ask=ask)


def test_facts_installed_together_each_answer_and_removing_one_restores_the_rest_bit_for_bit(first_inserted,
                                                                                             capture_store):
    engine, first = first_inserted
    engine = LarqlEngine(engine.model, walk=WalkSettings(dense=True), capture_store=capture_store)
    engine.apply_patch(first.patch)
    ins = engine.inserter()
    prompts = (FIRST.canonical_prompt, SECOND.canonical_prompt, CONTROL)
    first_only = {p: all_logits(engine, p, engine.patches) for p in prompts}
    second = engine.insert(SECOND)
    together = engine.patches
    assert [p.id for p in together.patches] == [first.patch.id, second.patch.id]
    for fact in (FIRST, SECOND):
        n = len(ins.target_tokens(fact.target)) + 2
        assert starts_with_word(ins.continuation(fact.canonical_prompt, together, n)[0], fact.target), fact
    # The second patch moved its own prompt: the restore below is not trivially true.
    assert not np.array_equal(all_logits(engine, SECOND.canonical_prompt, together),
                              first_only[SECOND.canonical_prompt])
    engine.remove_patch(second.patch.id)
    for p in prompts:
        np.testing.assert_array_equal(all_logits(engine, p, engine.patches), first_only[p])
    # Removing the first instead leaves exactly what the second alone gives.
    engine.apply_patch(second.patch)
    engine.remove_patch(first.patch.id)
    alone = PatchOverlay.build((second.patch,), engine.base_weights)
    assert engine.patches.epoch == alone.epoch
    for p in prompts:
        np.testing.assert_array_equal(all_logits(engine, p, engine.patches), all_logits(engine, p, alone))


def test_bad_inserts_are_refused_with_a_reason_and_change_nothing(first_inserted):
    engine, first = first_inserted
    epoch, applied = engine.patches.epoch, engine.applied_patches
    with pytest.raises(ValueError, match="non-empty entity"):
        engine.insert(Fact(" ", "capital-of", "Gildmere"))
    with pytest.raises(ValueError, match="too long"):
        engine.insert(Fact("Tarnhollow", "capital-of", "G" * 201))
    with pytest.raises(ValueError, match="layer must be within"):
        engine.insert(Fact("Tarnhollow", "mayor-of", "Oswin"), layer=engine.model.config.n_layers)
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        engine.insert(Fact("Tarnhollow", "mayor-of", "Oswin"), alpha=float("nan"))
    with pytest.raises(ValueError, match="already applied"):
        engine.apply_patch(first.patch)
    assert engine.patches.epoch == epoch and engine.applied_patches == applied


def test_two_facts_under_one_relation_each_answer_and_only_their_own_key_writes(first_inserted, capture_store):
    """Two invented facts of one relation installed one after the other: each question, asked fresh, and the later
    fact's asked after the earlier fact's question was asked and answered, names its own target; and at every
    position its reply is sampled from, only the asked fact's features hold their slots (the later key was solved
    with the earlier fact's questions and answers among what it must leave alone; where keys of both fire at one
    layer, the stronger fact writes alone). (The earlier fact asked after the later one's exchange still copies
    the later target from the context: issue 33's closing note.)"""
    engine, first = first_inserted
    engine = LarqlEngine(engine.model, walk=WalkSettings(dense=True), capture_store=capture_store)
    engine.apply_patch(first.patch)
    later = engine.insert(SAME_RELATION)
    own = {FIRST: set(first.patch.features), SAME_RELATION: set(later.patch.features)}

    def question(fact: Fact) -> dict:
        return {"role": "user", "content": f"What is the capital of {fact.entity}?"}
    answered_first = [question(FIRST), {"role": "assistant", "content": f"The capital of {FIRST.entity} is {FIRST.target}."}]
    for asked, other, messages in ((FIRST, SAME_RELATION, [question(FIRST)]),
                                   (SAME_RELATION, FIRST, [question(SAME_RELATION)]),
                                   (SAME_RELATION, FIRST, answered_first + [question(SAME_RELATION)])):
        answer, tokens = reply(engine, messages, engine.patches)
        assert contains_word(answer, asked.target) and not contains_word(answer, other.target), (messages, answer)
        # Every position the reply was sampled from: the asked fact's features write there, the other's none.
        ids = engine.model.encode_prompt(messages)
        at = list(range(len(ids) - 1, len(ids) + len(tokens) - 1))
        fired = run_reply_pass(engine, ids + tokens[:-1], at).fired_features
        holding = {(layer, f) for layer, per_position in enumerate(fired) for features in per_position
                   for f in features}
        assert holding and holding <= own[asked], (asked, holding)
    # The earlier fact's patch removed (the later one stays): its question, asked fresh, after its exchange or as
    # its canonical prompt, reads as in the base model, no answer written, and the later key stays silent there
    # too, so every reply is the unpatched model's again, token for token.
    engine.remove_patch(first.patch.id)
    base = PatchOverlay()
    ins = engine.inserter()
    for messages in ([question(FIRST)], answered_first + [question(FIRST)]):
        answer, tokens = reply(engine, messages, engine.patches)
        assert tokens == reply(engine, messages, base)[1], (messages, answer)
    canonical = ins.encode(FIRST.canonical_prompt)
    assert ins.greedy(canonical, engine.patches, REPLY_TOKENS) == ins.greedy(canonical, base, REPLY_TOKENS)


def test_a_word_counts_as_completed_only_where_each_conversation_the_reply_starts_in_completes_it(first_inserted):
    from larql_desktop.engine.patches.insert.values import WIN_SHARE, lead, spread

    engine, _ = first_inserted
    ins = engine.inserter()
    # Twenty questions, one of them left out of the spread of contexts a completion is judged on and unlike the
    # rest; a next token "completes" unless it is that one's, as a conversation failed where the model ran the
    # target on ("Starfall" -> "Starfallen") while the plain phrasings ended it.
    left_out = next(i for i in range(20) if i not in spread(20))
    texts = [f"What is {a} plus {b}?" for a, b in zip(range(20), range(20, 40))]
    texts[left_out] = "Write the word 'banana' in capital letters."
    questions = [engine.model.encode_prompt([{"role": "user", "content": text}]) for text in texts]
    overlay = PatchOverlay()
    captured = ins.capture_all(questions, overlay)
    nexts = [int(np.argmax(c.logits)) for c in captured]
    winning = {t for i, t in enumerate(nexts) if i != left_out}

    def completes(also, margin=0.0):
        def clearly(logits):
            top = int(np.argmax(logits))
            return top in winning and lead(logits, top) >= margin
        return ins.completes(questions, captured, [], lambda t: t in winning, clearly, overlay, 1, also)
    assert nexts[left_out] not in winning
    alone = completes(())
    assert alone >= WIN_SHARE                  # the spread alone never sees the context that fails
    assert completes([left_out]) == 0.0        # bound to complete there too, it does not
    assert completes([left_out + 1]) == alone  # one that completes changes nothing
    # A bound context whose next token wins, but by less than the margin asked, does not count as completed:
    # an unseen conversation a little unlike it may not (the step installs a key of its own instead).
    hair = lead(captured[left_out + 1].logits, nexts[left_out + 1])
    assert hair > 0
    # (Halved and doubled: `completes` re-runs the position on its KV, whose int8-quantised activations round a
    # little unlike the capture's.)
    assert completes([left_out + 1], margin=hair / 2) == alone
    assert completes([left_out + 1], margin=hair * 2) == 0.0


def test_a_later_tokens_key_stays_silent_where_its_first_token_begins_another_name(first_inserted):
    """The target's first token (" G" of " G|ild|mere") written where another relation's answer or a name starts:
    what follows is the unpatched model's, token for token. The second token's key is for this entity's answer,
    not for every " G" in a name's place (two facts together once turned "The current mayor of Greece is El|ena
    Kara." into "El|oria K|esette.": each fact's second-token key)."""
    engine, _ = first_inserted
    ins = engine.inserter()
    targets = ins.target_tokens(FIRST.target)
    assert len(targets) > 1
    # After the fact's own question the patched model does go on with the target.
    assert ins.greedy(ins.encode(FIRST.canonical_prompt) + targets[:1], engine.patches, 1) == targets[1:2]
    chat = [engine.model.encode_prompt([{"role": "user", "content": question}])
            + engine.model.tokenizer.encode(answer, add_bos=False)
            for question, answer in (("Who is the mayor of Vienna?", "The mayor of Vienna is"),
                                     ("Who founded Chile?", "Chile was founded by"))]
    plain = [ins.encode(text) for text in ("The leader of the club is", "His name was", "The poem was written by",
                                           "The town is called", "The language of Peru is")]
    moved = []
    for ids in chat + plain:
        primed = list(ids) + targets[:1]
        after, before = ins.greedy(primed, engine.patches, 3), ins.greedy(primed, PatchOverlay(), 3)
        if after != before:
            moved.append((engine.model.tokenizer.decode(primed[-8:]), before, after))
    assert not moved, moved


def test_another_entitys_reply_under_the_relation_is_left_alone_past_its_answer(smollm2, capture_store):
    """The model's own reply to the relation's question about invented names: past the words where it names its
    answer, every position is a slot of another entity's reply where the key must stay silent (facts under one
    relation wrote their targets into each other's replies: "... the current Mayor of Kelmere, England. She is
    the Alina ..."). No inserted feature takes its slot there. (This fact's keys, solved without those
    negatives, took 2 and 4 of those positions.)"""
    from larql_desktop.engine.loading import chat_prompt_ids
    from larql_desktop.engine.patches.insert.phrasings import (COPULA, INVENTED_ENTITIES, INVENTED_REPLIES,
                                                               REPLY_ANSWER_TOKENS)

    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    fact = Fact("Cormere", "river-of", "Isona")
    engine.insert(fact)
    ins = engine.inserter()
    tokenizer = engine.model.tokenizer
    contexts = ins.invented_reply_contexts(fact)
    assert len(contexts) == INVENTED_REPLIES
    for name, (ids, first) in zip(INVENTED_ENTITIES, contexts):
        question = tuple(chat_prompt_ids(engine.model, f"What is the river of {name}?"))
        assert ids[:len(question)] == question and len(question) < first < len(ids)
        # The reply's answer (up to its copula and a few words on) is not among them.
        assert COPULA.search(tokenizer.decode(list(ids[len(question):first - REPLY_ANSWER_TOKENS])))
        fired = run_reply_pass(engine, list(ids), range(first, len(ids))).fired
        assert not fired.any(), tokenizer.decode(list(ids[first:]))


def test_a_fact_keyed_against_a_similar_earlier_name_leaves_other_questions_in_chats_alone(smollm2, capture_store):
    """Two facts under one relation whose names read alike: the later key is solved with the earlier fact's
    question as a hard negative it must be boosted against. Boosted too far, its direction was those few rows
    alone, and it wrote its target's first token at the start of replies to other relations' questions about a
    real country (after a system prompt, or after an earlier turn under that relation). Each fact answers its
    own prompt; the other questions keep their replies. (What this pair still gets wrong: one of the two chat
    questions is answered with the other name; the closing note of issue 33 gives it.)"""
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=capture_store)
    earlier, later = Fact("Quarford", "sport-of", "Mabmund"), Fact("Quarston", "sport-of", "Tamira")
    engine.insert(earlier)
    engine.insert(later)
    ins = engine.inserter()
    for fact in (earlier, later):
        said = engine.model.tokenizer.decode(ins.greedy(ins.encode(fact.canonical_prompt), engine.patches, 4))
        assert starts_with_word(said, fact.target), (fact, said)
    system = {"role": "system", "content": "You are a geography teacher. Answer briefly."}
    spain = [{"role": "user", "content": "What is the founder of Spain?"}]
    spain.append({"role": "assistant", "content": reply(engine, spain, PatchOverlay())[0].strip()})
    cases = [[system, {"role": "user", "content": f"What is the {relation} of Greece?"}]
             for relation in ("founder", "author", "anthem")]
    cases.append(spain + [{"role": "user", "content": "What is the founder of Greece?"}])
    moved = []
    for messages in cases:
        after, tokens = reply(engine, messages, engine.patches)
        before, base_tokens = reply(engine, messages, PatchOverlay())
        if tokens != base_tokens:
            moved.append((messages[-1]["content"], before, after))
    assert not moved, moved
