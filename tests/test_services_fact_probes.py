"""services.fact_probes and word_probability on the real models: which prompts a fact is probed on (chat model and
base model), the whole-word probability against step-by-step forward passes, and a real INSERT on the base model."""
from __future__ import annotations

import numpy as np
import pytest

from larql_desktop.engine import services
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.session import ChatSession
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.patches.insert import QUESTIONS, Fact, fill, generated_phrasings
from larql_desktop.engine.model.overlay import PatchOverlay

FACT = Fact("Atlantis", "capital-of", "Poseidon")
QUESTION = fill(QUESTIONS[0], FACT.relation_words, FACT.entity)


@pytest.fixture(scope="module")
def gemma_inserted(gemma3, capture_store):
    """One real INSERT on the base model (module-scoped: it takes a while on a loaded machine)."""
    engine = LarqlEngine(gemma3, capture_store=capture_store)
    engine.insert(FACT)
    return engine


def test_word_probability_is_the_product_over_the_targets_tokens_teacher_forced(smollm2):
    engine = LarqlEngine(smollm2)
    inserter = engine.inserter()
    targets = inserter.target_tokens(FACT.target)
    assert len(targets) > 1                       # " Poseidon" is several tokens in SmolLM2's vocabulary
    ids = smollm2.tokenizer.encode(FACT.canonical_prompt)
    step_by_step = 1.0
    for j, token in enumerate(targets):
        logits = smollm2.transformer.forward(ids + targets[:j], KvCache(smollm2.config),
                                             inserter.ffn(PatchOverlay()))[-1].astype(np.float64)
        p = np.exp(logits - logits.max())
        step_by_step *= p[token] / p.sum()
    whole = services.word_probability(engine, ids, FACT.target, PatchOverlay())
    assert 0 < whole < inserter.probability(FACT.canonical_prompt, targets[0], PatchOverlay())
    assert whole == pytest.approx(step_by_step, rel=1e-3)


def test_a_chat_model_is_probed_on_generated_phrasings_and_the_chat_tabs_first_turn(smollm2):
    engine = LarqlEngine(smollm2)
    prompts = services.fact_prompts(engine, FACT, ["  ", ""])            # blank paraphrases: none given
    kinds = [kind for kind, *_ in prompts]
    assert kinds == ["canonical"] + ["generated"] * services.GENERATED_PROBES + ["chat", "conversation"]
    generated = [text for kind, text, _, _ in prompts if kind == "generated"]
    assert set(generated) <= set(generated_phrasings(FACT)) and FACT.canonical_prompt not in generated
    assert len(set(generated)) == len(generated)
    kind, question, rendered, ids = prompts[-2]
    assert question == QUESTION
    # Exactly what a new chat session (the template's default system prompt) sends for that question.
    session = ChatSession(smollm2)
    assert ids == chat_prompt_ids(smollm2, QUESTION) == smollm2.encode_prompt(
        session.conversation([{"role": "user", "content": QUESTION}]))
    assert smollm2.default_system_prompt in rendered and rendered.endswith("<|im_start|>assistant\n")
    # The conversation row: the same question after an earlier exchange under the same relation about a real
    # entity, answered as the unpatched model answers it; the chat row's tokens are its prefix's shape.
    kind, asked, conversation_text, conversation_ids = prompts[-1]
    earlier = fill(QUESTIONS[0], FACT.relation_words, services.PROBE_CONVERSATION_ENTITY)
    assert asked == QUESTION and earlier in conversation_text and conversation_text.endswith(
        f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    # The earlier answer is the one a chat shows: the unpatched model's reply to that question in a new chat, its
    # first sentence.
    chat = ChatSession(smollm2, ffn=engine.inserter().ffn(PatchOverlay()))
    list(chat.reply(earlier, SamplingSettings(max_tokens=32)))
    shown = chat.messages[-1]["content"].strip()
    own = engine.inserter().own_chat_reply(earlier)
    assert own and shown.startswith(own) and own in conversation_text
    assert conversation_ids == smollm2.encode_prompt(session.conversation([
        {"role": "user", "content": earlier}, {"role": "assistant", "content": own},
        {"role": "user", "content": QUESTION}]))
    # The user's paraphrases replace the generated ones (the canonical prompt and repeats only once).
    given = ["Atlantis has its capital at", FACT.canonical_prompt, "Atlantis has its capital at"]
    assert [(k, t) for k, t, _, _ in services.fact_prompts(engine, FACT, given)][:-2] == [
        ("canonical", FACT.canonical_prompt), ("paraphrase", "Atlantis has its capital at")]


def test_without_patches_every_row_is_unchanged(smollm2):
    engine = LarqlEngine(smollm2)
    rows = services.fact_probes(engine, FACT, ["Atlantis has its capital at"])
    assert [r.kind for r in rows] == ["canonical", "paraphrase", "chat", "conversation"]
    assert [r.is_reply for r in rows] == [False, False, True, True]
    for r in rows:
        assert r.after == r.before and r.p_after == r.p_before and r.answers_after == r.answers_before
        assert 0.0 <= r.p_before <= 1.0 and r.before.strip()
    assert not rows[0].answers_before                    # the base model does not know this fact
    # The chat row's P(target) is read where the reply names the answer: after the assistant begins with the
    # canonical sentence, not at the reply's first token.
    answer_at = chat_prompt_ids(smollm2, QUESTION) + smollm2.tokenizer.encode(FACT.canonical_prompt, add_bos=False)
    assert rows[-2].p_before == services.word_probability(engine, answer_at, FACT.target, PatchOverlay())


def test_a_base_model_gets_a_qa_prompt_and_the_insert_answers_on_its_canonical_prompt(gemma_inserted):
    engine = gemma_inserted
    assert not engine.model.is_chat
    rows = services.fact_probes(engine, FACT)
    kinds = [r.kind for r in rows]
    assert kinds[0] == "canonical" and kinds[-1] == "qa" and "chat" not in kinds
    qa = rows[-1]
    assert qa.prompt == qa.rendered == f"Q: {QUESTION}\nA:"
    canonical = rows[0]
    assert canonical.answers_after and not canonical.answers_before
    assert canonical.after.lstrip().startswith(FACT.target) and canonical.p_after > 10 * canonical.p_before
    assert all(0.0 <= p <= 1.0 for r in rows for p in (r.p_before, r.p_after))
    # Probing under an explicit overlay reads that state, not the engine's.
    unpatched = services.fact_probes(engine, FACT, overlay=PatchOverlay())
    assert all(r.after == r.before for r in unpatched) and unpatched[0].before == canonical.before
