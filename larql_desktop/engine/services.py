"""What every front-end asks of an engine, answered once: patch summaries, probes, walk requests, JSON-safe values.

The Qt worker, the HTTP routes and the command line only translate requests into these calls and render the
answers (frozen dataclasses), so each question has one implementation.
"""
from __future__ import annotations

import ipaddress
import math
import re
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from larql_desktop.engine.loading import chat_prompt_ids, conversation
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.patches.insert import QUESTIONS, Fact, fill, generated_phrasings
from larql_desktop.engine.model.overlay import PatchOverlay
from larql_desktop.engine.patches.summary import PatchSummary, patch_summaries  # noqa: F401  (front-ends call services.patch_summaries)

# Where the local HTTP API answers unless told otherwise (the app's toggle, `serve`, the load test).
DEFAULT_API_HOST = "127.0.0.1"
DEFAULT_API_PORT = 8765
PROBE_TOKENS = 8
CHAT_PROBE_TOKENS = 24      # a chat reply names the answer after a few words of its own
GENERATED_PROBES = 3        # generated phrasings probed when the user gave no paraphrases
# The conversation row's earlier turn: the same relation about a real entity (one INSERT does not train its keys
# on), answered as the unpatched model answers it. A chat that already holds such an exchange is where a reply
# copies the earlier answer ("The capital of Tarnhollow is Paris."), so the editor's "yes" must cover it.
PROBE_CONVERSATION_ENTITY = "Spain"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 in brackets or not) only reaches this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ProbeOutcome:
    """A prompt's greedy continuation and the target's probability without patches and with the applied ones."""
    prompt: str
    target: str
    base_text: str
    patched_text: str
    base_probability: float | None     # of the target's first token; None without a target
    patched_probability: float | None


def probe(engine: LarqlEngine, prompt: str, target: str = "", tokens: int = PROBE_TOKENS,
          overlay: PatchOverlay | None = None) -> ProbeOutcome:
    """Greedy continuation (and the target's probability) under no patches and under `overlay` (default: the
    engine's applied patches, read once so both halves see one state)."""
    if not prompt.strip():
        raise ValueError("the probe prompt is empty")
    after = engine.patches if overlay is None else overlay
    inserter = engine.inserter()
    token = inserter.target_token(target) if target.strip() else None
    results = []
    for state in (PatchOverlay(), after):
        text, _ = inserter.continuation(prompt, state, tokens)
        p = inserter.probability(prompt, token, state) if token is not None else None
        results.append((text, p))
    (base_text, base_p), (patched_text, patched_p) = results
    return ProbeOutcome(prompt, target, base_text, patched_text, base_p, patched_p)


def starts_with_word(continuation: str, word: str) -> bool:
    """The continuation begins with the whole word: not a prefix of it, not a longer word."""
    text = continuation.lstrip()
    if not text.startswith(word.strip()):
        return False
    rest = text[len(word.strip()):]
    return not rest or not rest[0].isalnum()


def contains_word(reply: str, word: str) -> bool:
    return re.search(r"(?<![A-Za-z0-9])" + re.escape(word.strip()) + r"(?![a-z0-9])", reply) is not None


def word_probability(engine: LarqlEngine, ids: Sequence[int], target: str, overlay: PatchOverlay) -> float:
    """Probability that the whole target word follows `ids` under `overlay`: the product over its tokens, each
    teacher-forced after the ones before it (one forward pass over the prompt and the target's first tokens)."""
    if not ids:
        raise ValueError("the prompt has no tokens")
    inserter = engine.inserter()
    targets = inserter.target_tokens(target)
    run = list(ids) + targets[:-1]
    logits = engine.model.transformer.forward(run, KvCache(engine.model.config, capacity=len(run) + 1),
                                              inserter.ffn(overlay), all_logits=True)
    rows = logits[len(ids) - 1:].astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_p = rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))
    return float(np.exp(log_p[np.arange(len(targets)), targets].sum()))


@dataclass(frozen=True)
class FactProbe:
    """One prompt of a fact's probe table, without patches and with the applied ones."""
    # canonical | paraphrase (the user's) | generated | chat | conversation (the chat question after an earlier
    # same-relation turn) | qa (a base model's Q/A)
    kind: str
    prompt: str               # what the user asks (for a chat row, the question typed in a chat)
    rendered: str             # what the model reads (for a chat row, the whole conversation through the template)
    before: str               # greedy continuation (a chat row: the reply) without patches
    after: str                # ... with the applied patches
    # Probability of the whole target word right after the prompt; for a chat row, after the question and the
    # assistant's answer begun with the canonical sentence (where a reply names the answer, not its first word).
    p_before: float
    p_after: float
    answers_before: bool      # prompts: the continuation starts with the whole target; chat: the reply names it
    answers_after: bool

    @property
    def is_reply(self) -> bool:
        """A chat reply (scored by naming the target anywhere), not a continuation (scored by starting with it)."""
        return self.kind in REPLY_KINDS


REPLY_KINDS = ("chat", "conversation")


def fact_prompts(engine: LarqlEngine, fact: Fact, paraphrases: Sequence[str] = ()) -> list[tuple[str, str, str, list[int]]]:
    """(kind, prompt, rendered, token ids) of the prompts a fact is probed on: its canonical prompt, the user's
    paraphrases (else a spread of the generated phrasings) and one question: through the chat template with the
    template's default system prompt, as a new chat tab sends it, or as a "Q: ... A:" prompt for a base model;
    for a chat model also the same question after an earlier turn about a real entity under the same relation
    (PROBE_CONVERSATION_ENTITY, answered with the unpatched model's own chat reply)."""
    model = engine.model
    encode = model.tokenizer.encode
    question = fill(QUESTIONS[0], fact.relation_words, fact.entity.strip())
    qa = f"Q: {question}\nA:"
    canonical = fact.canonical_prompt
    rows = [("canonical", canonical)]
    given = [p.strip() for p in paraphrases if isinstance(p, str) and p.strip()]
    if given:
        rows += [("paraphrase", p) for p in dict.fromkeys(given) if p != canonical]
    else:
        skip = {canonical, qa}
        others = list(dict.fromkeys(p for p in generated_phrasings(fact) if p not in skip))
        # A spread over the list rather than its first few, which differ from the canonical prompt by one word.
        picks = np.linspace(0, len(others) - 1, min(GENERATED_PROBES, len(others))).astype(int).tolist()
        rows += [("generated", others[i]) for i in dict.fromkeys(picks)]
    out = [(kind, text, text, encode(text)) for kind, text in rows]
    if model.is_chat:
        out.append(("chat", question, model.render_prompt(conversation(model, [{"role": "user",
                                                                                 "content": question}])),
                    chat_prompt_ids(model, question)))
        # The earlier turn as a chat holds it: the unpatched model's own reply to that question, which need not
        # restate it ("El Pilar de la Estrella ..." to "What is the mayor of Spain?"). A reply in the canonical
        # statement's form ("The mayor of Spain is ...") made the row say "yes" where the chat did not.
        earlier = fill(QUESTIONS[0], fact.relation_words, PROBE_CONVERSATION_ENTITY)
        messages = conversation(model, [
            {"role": "user", "content": earlier},
            {"role": "assistant", "content": engine.inserter().own_chat_reply(earlier)},
            {"role": "user", "content": question}])
        out.append(("conversation", question, model.render_prompt(messages), model.encode_prompt(messages)))
    elif qa not in {text for _, text in rows}:
        out.append(("qa", qa, qa, encode(qa)))
    return out


def fact_probes(engine: LarqlEngine, fact: Fact, paraphrases: Sequence[str] = (), tokens: int = PROBE_TOKENS,
                chat_tokens: int = CHAT_PROBE_TOKENS, overlay: PatchOverlay | None = None) -> tuple[FactProbe, ...]:
    """The fact's probe table: each of `fact_prompts` continued greedily and scored for the whole target word,
    without patches and under `overlay` (default: the engine's applied patches, read once so every row sees one
    state). Prompts get at least the target's length plus two tokens, so a whole multi-token word can show."""
    after = engine.patches if overlay is None else overlay
    inserter = engine.inserter()
    tokenizer = engine.model.tokenizer
    n = max(tokens, len(inserter.target_tokens(fact.target)) + 2)
    answer_start = tokenizer.encode(fact.canonical_prompt, add_bos=False)
    probes = []
    for kind, prompt, rendered, ids in fact_prompts(engine, fact, paraphrases):
        chat = kind in REPLY_KINDS
        answers = contains_word if chat else starts_with_word
        scored = list(ids) + answer_start if chat else ids
        halves = []
        for state in (PatchOverlay(), after):
            text = tokenizer.decode(inserter.greedy(ids, state, chat_tokens if chat else n))
            halves.append((text, word_probability(engine, scored, fact.target, state), answers(text, fact.target)))
        (before, p_before, ok_before), (patched, p_after, ok_after) = halves
        probes.append(FactProbe(kind, prompt, rendered, before, patched, p_before, p_after, ok_before, ok_after))
    return tuple(probes)


@dataclass(frozen=True)
class WalkAnswer:
    """One layer's walk FFN on given normed FFN inputs, as the HTTP API reports it."""
    layer: int
    top_k: int
    positions: int
    outcome: str | None               # hit | miss | bypass | dense | none (features only)
    tier: str | None
    bypass_reason: str | None
    output: np.ndarray | None         # (T, d)
    features: list[np.ndarray] | None
    scores: list[np.ndarray] | None
    seconds: float


def walk_ffn(engine: LarqlEngine, layer: int, x: np.ndarray, top_k: int | None, full_output: bool = True) -> WalkAnswer:
    """Run one layer's walk for a client (no L1; the shared L2 and L3). Raises ValueError for a bad request."""
    cfg = engine.model.config
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} is out of range 0..{cfg.n_layers - 1}")
    k = engine.walk_settings.sizes(cfg.intermediate)[0] if top_k is None else top_k
    if not 1 <= k <= cfg.intermediate:
        raise ValueError(f"top_k {k} is out of range 1..{cfg.intermediate}")
    if x.ndim != 2 or x.shape[1] != cfg.hidden:
        raise ValueError(f"residual rows must have the model's hidden size {cfg.hidden}")
    started = time.perf_counter()
    walk = engine.request_walk(k)
    if not full_output:
        # The gate KNN as the walk sees it: under INSERT patches, with the overrides that hold their slots.
        knn = walk.gate_knn(layer, x)
        return WalkAnswer(layer, k, x.shape[0], "none", None, None, None, [ids for ids, _ in knn],
                          [s for _, s in knn], time.perf_counter() - started)
    out = walk(layer, x)
    engine.note_activity("api")
    return WalkAnswer(layer, k, x.shape[0], walk.last_outcome, walk.last_tier, walk.last_bypass, out, None, None,
                      time.perf_counter() - started)


def finite_json(value):
    """JSON has no NaN: statistics that are undefined (no fidelity checks yet) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value
