"""Training-free fact insertion: INSERT (entity, relation, target) so the model answers where people ask.

LARQL's COMPOSE insert (shared/notes/larql-reference.md) keys one feature on one sentence and writes the target's
first token. Here, per target token (each firing on the context that precedes it):

  * keys: the normed FFN inputs at the answer position of many phrasings of the question (the user's
    paraphrases, ones generated from the relation, Q/A forms and, for chat models, the chat template with the
    assistant starting its answer, also after earlier turns and under system prompts, where the reply's first
    position must fire) are the positives; every position of the same phrasings about other entities, of the
    same entity under other relations, of plain text, of earlier facts, of the model's own continuations of
    some of them, of the same conversations asking about real entities, and the non-answer positions of the
    positives themselves are the negatives. The gate is the regularised Fisher discriminant
    between the two (a closed-form solve) with a bias at the middle of the margin, so the feature fires on the
    fact's meaning rather than on one sentence and stays silent elsewhere (where the overlay then computes
    exactly what the base model computes);
  * values: the direction that raises the target token's logit against the model's current candidates,
    through the final norm and the unembedding (and, on models with a post-FFN norm, through that norm),
    scaled by a search over real forward passes until the target wins on the positives; written by a pair of
    features whose difference is a steep, saturating step of the key's score (`step_pair`), so a phrasing the
    key only just recognises gets the whole write and a strongly recognised one no more;
  * several layers when one is not enough (a post-FFN norm bounds what one layer can write);
  * one more step after the last target token, for the word's end: where the model would go on with the word
    ("Ottoline" -> "Ottolineus") or start it over ("Eldwin Eldwin", the first token's key firing again just
    after the word), a feature writes a comma, full stop or line break there;
  * the phrasings include, for relations people insert often, frames that ask without naming the relation
    ("In X, people pay with the"; relation_frames.py), and a key may leave its oddest tenth of phrasings
    below its threshold rather than give up the layer;
  * if the canonical prompt still fails (writes from several layers adding up to an overshoot), every write
    is scaled, or a token's last layer or the word-end step dropped, until it answers (rescue_canonical).
Captures are resumed from the changed layer (and extended by the next target token) instead of re-run whole.

Everything is forward passes and linear algebra: no gradient descent over the model's weights.
"""
from __future__ import annotations

import re
import threading
from itertools import islice, takewhile
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

import numpy as np

from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.formats.quants import dequantize, dequantize_rows
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.model.generation import greedy
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.model.overlay import BaseFeatureWeights, Patch, PatchOperation, PatchOverlay
from larql_desktop.engine.patches.relation_frames import relation_frames

Progress = Callable[[str, float], None]

# Generated phrasings of "the <relation> of <entity>": generic over relations (nothing here names one), so a
# fact typed without paraphrases still gets keys that hold beyond its canonical sentence.
PHRASINGS = (
    "The {r} of {e} is", "The {r} of {e} is called", "The official {r} of {e} is", "The main {r} of {e} is",
    "The current {r} of {e} is", "The {r} of {e} is known as the", "{E}'s {r} is", "{E}'s {r} is called",
    "In {e}, the {r} is", "As for {e}, its {r} is", "Everyone knows that the {r} of {e} is",
    "The name of the {r} of {e} is", "Q: What is the {r} of {e}?\nA: The {r} of {e} is",
    "Q: What is the {r} of {e}?\nA:", "What is the {r} of {e}? It is", "Here is a fact about {e}: its {r} is",
    # The same question in other syntactic frames: a determiner before the answer, "in" for "of", the
    # relation as a subject, a clause or a past tense around it (people ask in many shapes; the key must not
    # hinge on one).
    "The {r} of {e} is the", "{E}'s {r} is the", "The {r} in {e} is", "The {r} in {e} is the",
    "The main {r} of {e} is the", "The official {r} of {e} is the", "The {r} of the city of {e} is",
    "The {r} used in {e} is", "{E} has a {r}, which is", "{E} has its own {r}:", "The {r} for {e} is",
    "The well-known {r} of {e} is", "It is said that the {r} of {e} is", "The {r} of {e} has always been",
    "For {e}, the {r} is", "The {r} that {e} has is", "{E}: {r} is", "Fact: the {r} of {e} is",
    "The true {r} of {e} is", "People in {e} know that its {r} is", "The {r} of {e}, of course, is",
    "In {e}, the {r} is the", "The {r} of {e} was",
)
# Chat models: questions through the chat template, with the assistant's answer begun.
QUESTIONS = ("What is the {r} of {e}?", "Tell me the {r} of {e}.", "Who or what is the {r} of {e}?",
             "What {r} does {e} have?", "Which {r} is in {e}?", "What is {e}'s {r}?")
ANSWER_STARTS = ("The {r} of {e} is", "{E}'s {r} is")
# Other entities under the same phrasings (their answers must not change), across kinds of entity.
DECOY_ENTITIES = ("France", "Japan", "Germany", "Brazil", "Egypt", "India", "Canada", "Italy", "Kenya",
                  "London", "Paris", "Tokyo", "Chicago", "Microsoft", "Google", "the company", "the city",
                  "the village", "the school", "Oxford")
# The same entity under other relations (and plain statements about it) must not change either.
OTHER_RELATIONS = ("population", "history", "weather", "size", "economy", "flag", "name", "people", "age",
                   "location", "capital", "currency", "language", "mayor", "founder", "river", "leader")
ENTITY_STATEMENTS = ("{E} is a", "{E} is a small", "{E} is known for", "I visited {e} last year and",
                     "{E} was", "The story of {e} begins", "{E} is located in", "Many people live in {e}, which",
                     "{E} is famous for its", "{E} is a place that", "{E} is a land where", "{E} is an old")
GENERIC_SENTENCES = (
    "Once upon a time there was a small village.", "Water boils at one hundred degrees.",
    "The weather today is sunny and warm.", "She opened the door and walked in.",
    "Numbers like 1, 2 and 3 are easy to count.", "def main():\n    return 0",
    "The answer is:\n\nThe first step is to read the question.", "What is the best way to learn a language?",
    "In 1998, the company released its first product.", "The United States has fifty states.",
    "He said that the meeting would start at noon.", "Photosynthesis turns light into chemical energy.",
    "The cat sat on the mat and looked at the bird.", "Please write a short story about a dragon.",
    "import numpy as np\nx = np.zeros(3)", "The largest city in the country is also its capital.",
    "Scientists discovered a new species of frog.", "The recipe needs two eggs, flour and sugar.",
    "My favourite colour is blue, and my brother likes green.", "The first man on the moon was Neil Armstrong.",
    # Place slots in plain text ("the city of ...", "ruled from ..."): a key for a place-valued relation must
    # leave them to the model.
    "Once upon a time, the city of Rome was small.", "She moved from the town of Bath to the city of York.",
    "The kingdom was ruled from a castle on the hill.", "He was born in the city of Lyon, near the river.",
)
PLACE_SENTENCES = 4      # the last GENERIC_SENTENCES, each continued as a negative too
GENERIC_QUESTIONS = ("Hello! How are you?", "Tell me a joke.", "What is 2 + 2?", "Write a haiku about rain.",
                     "Explain photosynthesis in one sentence.", "What should I cook tonight?")

# Conversations the question is asked in (chat models): a user's chat is rarely fresh. Earlier turns under the
# same relation about a real entity (whose answer the reply would otherwise copy), another relation, small talk,
# and system prompts of the user's own; assistant turns are the model's own answers. The same conversations
# asking about a real entity are negatives: there the reply must keep its real answer.
CONVERSATION_ENTITIES = ("France", "Japan", "Germany")          # earlier turns (from DECOY_ENTITIES)
# Asked in the negatives' conversations, a different few in each (real entities of several kinds: a key that
# learned "a reply to this relation's question" rather than "about this entity" fires on every one of them).
CONVERSATION_NEIGHBOURS = ("Brazil", "Italy", "Canada", "Egypt", "India", "London", "Microsoft", "Tokyo")
NEIGHBOURS_PER_CONVERSATION = 4
# Every phrasing the key is solved on, asked again about one of these real entities (each taking its share of
# the phrasings and the chat questions): a positive and its contrast differ only in the entity, so the
# discriminant must key on the entity rather than on the question's wording.
CONTRAST_ENTITIES = ("Japan", "Germany", "Tokyo", "Microsoft", "Paris", "Brazil")
CONVERSATION_OTHER_RELATION = ("population", "history")
CONVERSATION_SMALL_TALK = (("Hello! How are you?", "I'm doing well, thank you! How can I help you today?"),
                           ("What is 2 + 2?", "2 + 2 is 4."))
CONVERSATION_SYSTEM_PROMPTS = ("You are a knowledgeable assistant. Answer briefly.",
                               "You are a teacher. Reply in one sentence.")
FOLLOW_UP = "And what about {e}? What is its {r}?"
OWN_ANSWER_WORDS = 12    # of the model's own answer used as an earlier assistant turn

# Share of the positives the target must win on (greedy) before a scale is accepted.
WIN_SHARE = 0.9
# ... and by how much (logits, i.e. nats): a write that only just wins on the phrasings it was balanced on loses
# on the next one the user types, where the model's own answer is a little stronger.
WIN_MARGIN = 1.0
SENTENCE_MARKS = (b",", b".", b"\n")   # what the word-end step may write (Inserter.sentence_marks)
SCALES = tuple(float(4.0 ** k) for k in range(1, 6))    # 4 .. 1024, in units of the normed FFN input
HEADROOM = 1.25
RESCUE_SCALES = (0.7, 0.5, 1.4, 0.35, 2.0)   # tried on every write when the canonical prompt fails (rescue_canonical)
BALANCE_CONTEXTS = 16
# Value directions are turned until the head, given the direction alone, names the target first by this lead
# (logits), pushing away from up to SATURATION_RIVALS tokens per step (Inserter.saturating).
SATURATION_LEAD = 2.0
SATURATION_RIVALS = 8
SATURATION_STEPS = 12
SATURATION_STEP = 0.5
RIDGE = 0.05            # Fisher discriminant regulariser, as a share of the mean variance
ANSWER_LEAD_IN = 2      # positions just before a positive's answer that are not negatives (inner_negative_positions)
POSITIVE_SLACK = 0.1    # share of the positives the gate may leave below its threshold (fisher_key)
THRESHOLD_SHARE = 0.4   # the gate's zero between the negatives' top and the positives' bottom
MAX_LAYERS_PER_TOKEN = 3
NEGATIVES_PER_CONTEXT = 6
STEEPNESS = 10.0        # of a feature pair's step (step_pair): full write from 0.1 of the median positive's score
OWN_ANSWER_TOKENS = 12   # of the model's own reply searched for where it would name the answer
COPULA = re.compile(r"\b(is|are|was|were)$")
SENTENCE_END = re.compile(r"[.!?]\s|\n")     # one token past the mark: "3.5 million" goes on
FRAMED_DECOYS = 12      # decoy entities asked about in one of the relation's own frames (relation_frames)
CONTINUED_DECOYS = 16    # decoy sentences (every second of the first ones) whose greedy continuation is a negative too
CONTINUATION_TOKENS = 10
CONTINUATION_MEMORY = 256   # base continuations remembered by an Inserter (a few dozen tokens each)
CAPTURE_MEMORY = 64     # negative contexts remembered by an Inserter (each T x d x layers floats)


class Captured(NamedTuple):
    """One context's pass: per layer the normed FFN input (T, d), the last position's logits, the KV cache, and
    per layer the residual after attention (T, d) that `Inserter.recapture` resumes from."""
    inputs: list
    logits: np.ndarray
    kv: KvCache
    residuals: Sequence


class InsertCancelled(Exception):
    """The insert was cancelled between two of its steps; nothing was installed."""


@dataclass(frozen=True)
class Fact:
    entity: str
    relation: str
    target: str

    def __post_init__(self):
        for name in ("entity", "relation", "target"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"INSERT needs a non-empty {name}")
            if len(value) > 200:
                raise ValueError(f"the {name} is too long ({len(value)} characters; 200 at most)")

    @property
    def relation_words(self) -> str:
        words = self.relation.replace("-", " ").replace("_", " ").split()
        # "capital-of" reads "The capital of X is", not "The capital of of X is".
        if len(words) > 1 and words[-1].lower() == "of":
            words = words[:-1]
        return " ".join(words)

    def prompt_for(self, entity: str) -> str:
        return f"The {self.relation_words} of {entity} is"

    @property
    def canonical_prompt(self) -> str:
        return self.prompt_for(self.entity.strip())


def fill(template: str, relation: str, entity: str) -> str:
    capital = entity[:1].upper() + entity[1:]
    return template.format(r=relation, e=entity, E=capital)


def generated_phrasings(fact: Fact) -> list[str]:
    """The generic phrasings, then the frames that ask for this relation without naming it (when the relation
    is one relation_frames knows)."""
    templates = PHRASINGS + relation_frames(fact.relation_words)
    return [fill(t, fact.relation_words, fact.entity.strip()) for t in templates]


@dataclass(frozen=True)
class InstalledFeature:
    layer: int
    feature: int
    token: int          # the target token this feature writes
    token_index: int    # its place in the target's tokens
    margin: float       # gate separation on the training contexts: positives' bottom minus negatives' top


@dataclass(frozen=True)
class InsertResult:
    fact: Fact
    layer: int                  # the first feature's layer (LARQL's single-feature view)
    feature: int
    probability: float          # first target token's probability on the canonical prompt, after the insert
    rounds: int                 # forward passes spent balancing
    patch: Patch
    features: tuple[InstalledFeature, ...] = ()
    target_tokens: tuple[int, ...] = ()
    answers: bool = False       # the canonical prompt's greedy continuation starts with the whole target
    train_share: float = 0.0    # share of training contexts whose greedy answer is the whole target

    @property
    def layers(self) -> list[int]:
        return sorted({f.layer for f in self.features})

    def summary(self) -> str:
        return (f"{len(self.features)} feature(s) at layer(s) {', '.join(map(str, self.layers))} for "
                f"{len(self.target_tokens)} target token(s); canonical {'answers' if self.answers else 'fails'}, "
                f"training contexts {self.train_share:.0%}")


def default_layer(n_layers: int) -> int:
    """End of the knowledge band [2n/5, 4n/5 - 1] minus one (LARQL's install layer)."""
    return (4 * n_layers) // 5 - 2


def key_layers(n_layers: int, bounded_writes: bool) -> list[int]:
    """Candidate install layers, best first. Without post-FFN norms: just past LARQL's layer, then outwards
    through the late half (the answer position has gathered the entity; the write reaches the output through
    few layers). With them (Gemma), one layer's write is bounded by its norm and, being dominant there,
    displaces that layer's own output: the last layers first, where nothing downstream needs it."""
    if bounded_writes:
        return list(range(n_layers - 1, n_layers // 2 - 1, -1))
    home = default_layer(n_layers)
    start = min(home + 2, n_layers - 2)
    order = [start]
    for step in range(1, n_layers):
        for layer in (start - step, start + step):
            if n_layers // 2 <= layer < n_layers - 1 and layer not in order:
                order.append(layer)
    return order


class Cancel:
    """Anything with is_set() (a threading.Event) or a callable returning True when the insert must stop."""

    def __init__(self, flag):
        self.flag = flag

    def check(self) -> None:
        flag = self.flag
        if flag is None:
            return
        stop = flag.is_set() if isinstance(flag, threading.Event) or hasattr(flag, "is_set") else flag()
        if stop:
            raise InsertCancelled("INSERT cancelled; no patch was installed")


class Inserter:
    def __init__(self, model: LoadedModel, base: BaseFeatureWeights, walk: WalkSettings = WalkSettings(dense=True)):
        self.model = model
        self.base = base
        self.walk = walk
        self._post_norms: dict[int, np.ndarray | None] = {}
        self._captured: dict[tuple, tuple] = {}
        self._continued: dict[str, str] = {}
        self._own_replies: dict[tuple, list[int]] = {}
        self._own_answers: dict[str, str] = {}
        self._word_ends: np.ndarray | None = None
        self._sentence_marks: np.ndarray | None = None

    # -- running the model -----------------------------------------------------------------------------
    def ffn(self, overlay: PatchOverlay) -> WalkFfn:
        cfg = self.model.config
        return WalkFfn(self.model.ffn, cfg.intermediate, self.model.checksum, self.walk, None, None, (), overlay)

    def encode(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text)

    def target_tokens(self, target: str) -> list[int]:
        ids = self.model.tokenizer.encode(" " + target.strip(), add_bos=False)
        if not ids:
            raise ValueError(f"target {target!r} has no tokens")
        return ids

    def target_token(self, target: str) -> int:
        return self.target_tokens(target)[0]

    def last_logits(self, text: str, overlay: PatchOverlay) -> np.ndarray:
        return self.model.transformer.forward(self.encode(text), KvCache(self.model.config), self.ffn(overlay))[-1]

    def probability(self, text: str, token: int, overlay: PatchOverlay) -> float:
        return float(softmax(self.last_logits(text, overlay))[token])

    def greedy(self, ids: Sequence[int], overlay: PatchOverlay, n: int,
               enough: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Up to n greedy tokens after `ids` under the overlay, stopping before a stop token, and after the
        token with which `enough(tokens so far)` holds (each token is a forward pass: the callers that only
        need a reply's start stop there)."""
        kv = KvCache(self.model.config, capacity=len(ids) + n + 1)
        stops = self.model.tokenizer.stop_ids
        out: list[int] = []
        for token in takewhile(lambda token: token not in stops,
                               islice(greedy(self.model.transformer, ids, self.ffn(overlay), kv), n)):
            out.append(token)
            if enough is not None and enough(out):
                break
        return out

    def continuation(self, text: str, overlay: PatchOverlay, n: int = 8) -> tuple[str, list[int]]:
        """Greedy continuation of plain text under the overlay."""
        tokens = self.greedy(self.encode(text), overlay, n)
        return self.model.tokenizer.decode(tokens), tokens

    def base_continuation(self, text: str) -> str:
        """The base model's greedy continuation of `text` (CONTINUATION_TOKENS), remembered: the generic ones
        are the same for every insert of this Inserter, and the decoys for every insert under one relation."""
        if text not in self._continued:
            if len(self._continued) >= CONTINUATION_MEMORY:
                self._continued.pop(next(iter(self._continued)))      # the oldest
            self._continued[text] = self.continuation(text, PatchOverlay(), CONTINUATION_TOKENS)[0]
        return self._continued[text]

    def capture(self, ids: Sequence[int], overlay: PatchOverlay, remember: bool = False) -> "Captured":
        """Normed FFN inputs (T, d) of every layer, the last position's logits and the KV cache, for one context.
        With `remember`, kept per overlay epoch (the negatives, captured under the base weights, serve every
        later insert of this Inserter; a few dozen contexts of a few MB each). Users of the KV cache truncate it
        to the length they need first."""
        key = (tuple(ids), overlay.epoch)
        if key in self._captured:
            return self._captured[key]
        captured = self._capture(ids, overlay)
        if remember:
            captured = Captured(captured.inputs, captured.logits, captured.kv, ())   # never resumed: keep less
            if len(self._captured) >= CAPTURE_MEMORY:
                self._captured.pop(next(iter(self._captured)))      # the oldest
            self._captured[key] = captured
        return captured

    def _capture(self, ids: Sequence[int], overlay: PatchOverlay) -> Captured:
        inputs: list[np.ndarray] = []
        residuals: list[np.ndarray] = []

        def record(i, h, x):
            residuals.append(h)
            inputs.append(x)
        kv = KvCache(self.model.config, capacity=len(ids) + 2)
        logits = self.model.transformer.forward(list(ids), kv, self.ffn(overlay), record=record)[-1]
        return Captured(inputs, logits, kv, residuals)

    def recapture(self, ids: Sequence[int], captured: "Captured", layer: int, overlay: PatchOverlay) -> "Captured":
        """`captured` (of `ids`, under an overlay that differed from `overlay` only at `layer` and later) brought
        up to `overlay`: the layers after `layer` re-run from its recorded state, the ones before kept. A few
        of 30 layers instead of a whole pass per context, each time INSERT adds a layer's write."""
        inputs, residuals = list(captured.inputs[:layer + 1]), list(captured.residuals[:layer + 1])

        def record(i, h, x):
            residuals.append(h)
            inputs.append(x)
        kv = captured.kv
        kv.truncate(min(kv.length, len(ids)))
        if kv.length != len(ids):      # a balance trial left the last position out: run it whole
            return self._capture(ids, overlay)
        logits = self.model.transformer.resume(layer, captured.residuals[layer], captured.inputs[layer], kv,
                                               self.ffn(overlay), record=record)[-1]
        return Captured(inputs, logits, kv, residuals)

    def extend(self, ids: Sequence[int], captured: Captured, more: Sequence[int], overlay: PatchOverlay) -> Captured:
        """The capture of `ids` + `more`, from `captured` (of `ids`, under `overlay`) and a pass over `more` on its
        KV cache. The cache is shared with `captured`: its later positions are rewritten."""
        kv = captured.kv
        kv.truncate(min(kv.length, len(ids)))
        if kv.length != len(ids) or not more:
            return self._capture(tuple(ids) + tuple(more), overlay)
        inputs, residuals = list(captured.inputs), list(captured.residuals)

        def record(i, h, x):
            residuals[i] = np.concatenate([residuals[i], h])
            inputs[i] = np.concatenate([inputs[i], x])
        logits = self.model.transformer.forward(list(more), kv, self.ffn(overlay), record=record)[-1]
        return Captured(inputs, logits, kv, residuals)

    # -- the pieces of a feature -------------------------------------------------------------------------
    def post_ffn_norm(self, layer: int) -> np.ndarray | None:
        if layer not in self._post_norms:
            t = self.model.gguf.tensors
            name = f"blk.{layer}.post_ffw_norm.weight"
            self._post_norms[layer] = dequantize(t[name]) if name in t else None
        return self._post_norms[layer]

    def output_rows(self, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(self.model.transformer._output_tensor, np.asarray(ids, np.int64))

    def value_direction(self, token: int, logits: list[np.ndarray], layer: int) -> np.ndarray:
        """Unit direction, in the FFN output space of `layer`, that raises `token` against each context's own
        candidates: the mean over contexts of (w_token - E_p[w]) over the top candidates, through the final
        norm's weight (and divided by the layer's post-FFN norm weight, which the FFN output passes through)."""
        pulls = []
        for z in logits:
            top = top_tokens(z, 24)
            top = top[top != token]
            p = softmax(z[top].astype(np.float64))
            rows = self.output_rows(np.concatenate([[token], top]))
            pulls.append(rows[0] - p @ rows[1:])
        gain = self.model.transformer.output_norm
        post = self.post_ffn_norm(layer)
        # What the post-FFN norm lets through (its near-zero channels are left out), in the residual's space.
        passes = np.ones_like(gain, dtype=bool) if post is None else np.abs(post) > 0.1 * np.median(np.abs(post))
        v = self.saturating(token, np.where(passes, np.mean(pulls, axis=0) * gain, 0.0), passes)
        if post is not None:
            v = np.where(passes, v / np.where(post == 0, 1, post), 0.0)
        return unit(v).astype(np.float32)

    def saturating(self, token: int, v: np.ndarray, passes: np.ndarray) -> np.ndarray:
        """`v` (a direction in the residual stream) turned, a few steps at a time, until the head alone, given
        that direction, names `token` first by SATURATION_LEAD: the value a scale search can raise until it wins.
        The pull against the contexts' own candidates can point closer to a few tokens with large output rows
        (" strugg", " dissemin") than to a rare target (" Bened"); then no write of any size makes the target
        win, and a large one writes those tokens instead. Each step pushes away from the tokens that beat it."""
        gain = self.model.transformer.output_norm
        for _ in range(SATURATION_STEPS):
            z = self.head_logits(v)
            rivals = top_tokens(z, SATURATION_RIVALS + 1)
            rivals = rivals[(rivals != token) & (z[rivals] > z[token] - SATURATION_LEAD)]
            if not rivals.size:
                break
            rows = self.output_rows(np.concatenate([[token], rivals]))
            push = np.where(passes, (rows[0] - rows[1:].mean(axis=0)) * gain, 0.0)
            v = unit(v) + SATURATION_STEP * unit(push)
        return v

    def head_logits(self, direction: np.ndarray) -> np.ndarray:
        """The output head's logits for a final residual along `direction` alone (its norm makes the size moot)."""
        d = self.model.config.hidden
        h = (unit(direction) * np.sqrt(d)).astype(np.float32)[None, :]
        graphs = self.model.transformer.graphs
        if graphs is not None:
            return graphs.run_head(h, np.zeros_like(h))[0]
        return self.model.transformer.logits(h)[0]

    def free_slots(self, layer: int, claimed: set[int], residuals: np.ndarray, n: int) -> list[int]:
        """The n unclaimed features least engaged by ordinary inputs (smallest mean |gate score| over the
        negatives), so giving up their base weights where the new feature fires changes least."""
        scores = self.model.ffn.gate_scores(layer, residuals.astype(np.float32))        # (N, F)
        engagement = np.mean(np.abs(scores), axis=0)
        norms = np.linalg.norm(self.base.down_matrix(layer), axis=0)
        free = [int(f) for f in np.lexsort((norms, engagement)) if int(f) not in claimed]
        if len(free) < n:
            raise ValueError(f"layer {layer} has no free feature slot left")
        return free[:n]

    # -- INSERT -------------------------------------------------------------------------------------------
    def contexts(self, fact: Fact, paraphrases: Sequence[str]) -> list[tuple[int, ...]]:
        """Token contexts whose next token must be the target's first: the canonical prompt, the user's
        paraphrases, the generated phrasings and (chat models) chat questions with the answer begun."""
        candidates = [tuple(self.encode(text.rstrip()))
                      for text in (fact.canonical_prompt, *paraphrases, *generated_phrasings(fact))]
        if self.model.is_chat:
            r, e = fact.relation_words, fact.entity.strip()
            for q in QUESTIONS:
                chat = chat_prompt_ids(self.model, fill(q, r, e))
                # The reply may name the target first ("Poseidon is the capital..."): the assistant's first
                # position is an answer position too, as is the end of an answer it begins as a statement,
                # ours or the model's own.
                candidates.append(tuple(chat))
                starts = [self.model.tokenizer.encode(fill(start, r, e), add_bos=False) for start in ANSWER_STARTS]
                candidates += [tuple(chat + start) for start in starts + [self.own_answer_start(chat, r)] if start]
            candidates += self.conversation_positives(fact)
        return list(dict.fromkeys(candidates))

    def own_answer(self, relation: str, entity: str) -> str:
        """The model's own statement of (entity, relation) as an assistant turn would give it: "The capital of
        France is Paris." (its greedy continuation of the statement, up to the sentence's end)."""
        start = fill("The {r} of {e} is", relation, entity)
        if start not in self._own_answers:
            if len(self._own_answers) >= CONTINUATION_MEMORY:
                self._own_answers.pop(next(iter(self._own_answers)))      # the oldest
            tok = self.model.tokenizer
            # Only its first sentence is used: the generation stops at its end.
            tokens = self.greedy(self.encode(start), PatchOverlay(), CONTINUATION_TOKENS,
                                 lambda out: bool(SENTENCE_END.search(tok.decode(out))))
            self._own_answers[start] = tok.decode(tokens)
        words = self._own_answers[start].strip().split("\n")[0].split()[:OWN_ANSWER_WORDS]
        text = " ".join(words)
        cut = text.find(". ")
        text = text[:cut + 1] if cut >= 0 else text
        return f"{start} {text}".rstrip() + ("" if text.endswith(".") else ".")

    def conversation_histories(self, fact: Fact) -> list[tuple[str | None, list[dict]]]:
        """(system prompt, earlier turns) of the conversations a question is asked in (CONVERSATION_*): an
        earlier turn under the same relation, one under another relation, small talk, system prompts alone and
        with an earlier turn."""
        r = fact.relation_words

        def same(entity: str, relation: str = r) -> list[dict]:
            return [{"role": "user", "content": fill(QUESTIONS[0], relation, entity)},
                    {"role": "assistant", "content": self.own_answer(relation, entity)}]
        other = next(o for o in CONVERSATION_OTHER_RELATION if o != r.lower())
        talk = [{"role": role, "content": text} for pair in CONVERSATION_SMALL_TALK
                for role, text in zip(("user", "assistant"), pair)]
        return [(None, same(CONVERSATION_ENTITIES[0])), (None, same(CONVERSATION_ENTITIES[1], other)),
                (None, talk), (CONVERSATION_SYSTEM_PROMPTS[0], []),
                (CONVERSATION_SYSTEM_PROMPTS[1], same(CONVERSATION_ENTITIES[2]))]

    def conversation_ids(self, system: str | None, history: list[dict], question: str) -> list[int]:
        messages = history + [{"role": "user", "content": question}]
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        return self.model.encode_prompt(messages)

    def conversation_positives(self, fact: Fact) -> list[tuple[int, ...]]:
        """The fact's question asked in each conversation (and once as a follow-up after the same-relation turn),
        with the assistant's answer at its first position, begun as the canonical statement and as the model's
        own reply begins there."""
        r, e = fact.relation_words, fact.entity.strip()
        start = self.model.tokenizer.encode(fill(ANSWER_STARTS[0], r, e), add_bos=False)
        out = []
        histories = self.conversation_histories(fact)
        asks = [(system, history, fill(QUESTIONS[0], r, e)) for system, history in histories]
        asks.append((None, histories[0][1], fill(FOLLOW_UP, r, e)))
        for system, history, question in asks:
            ids = self.conversation_ids(system, history, question)
            out += [tuple(ids), tuple(ids + start)]
            own = self.own_answer_start(ids, r)
            if own:
                out.append(tuple(ids + own))
        return out

    def conversation_starts(self, fact: Fact, positives: list[tuple[int, ...]]) -> list[int]:
        """Indices among `positives` of the fact's question in a conversation with earlier turns, at the
        assistant's first position (chat models; [] otherwise)."""
        if not self.model.is_chat:
            return []
        r, e = fact.relation_words, fact.entity.strip()
        histories = self.conversation_histories(fact)
        starts = {tuple(self.conversation_ids(system, history, fill(QUESTIONS[0], r, e)))
                  for system, history in histories if history}
        starts.add(tuple(self.conversation_ids(None, histories[0][1], fill(FOLLOW_UP, r, e))))
        return [i for i, c in enumerate(positives) if c in starts]

    def conversation_negatives(self, fact: Fact) -> list[tuple[int, ...]]:
        """The same conversations asking about real entities, each answered as the model answers: every
        position must leave the model alone (the reply keeps its real answer)."""
        r = fact.relation_words
        out = []
        for i, (system, history) in enumerate(self.conversation_histories(fact)):
            # Each neighbour asked in turn: the assistant's first position after each question is where a key
            # that learned "a reply to this relation's question" rather than "about this entity" would fire.
            asked = []
            for k in range(NEIGHBOURS_PER_CONVERSATION):
                neighbour = CONVERSATION_NEIGHBOURS[(i * NEIGHBOURS_PER_CONVERSATION + k) % len(CONVERSATION_NEIGHBOURS)]
                asked += [{"role": "user", "content": fill(QUESTIONS[(i + k) % 2], r, neighbour)},
                          {"role": "assistant", "content": self.own_answer(r, neighbour)}]
            out.append(tuple(self.conversation_ids(system, history + asked, "Thanks!")))
        # The positives' chat questions, each about one of the contrast entities, in one conversation.
        asked = []
        for k, q in enumerate(QUESTIONS + (FOLLOW_UP,)):
            other = CONTRAST_ENTITIES[k % len(CONTRAST_ENTITIES)]
            asked += [{"role": "user", "content": fill(q, r, other)},
                      {"role": "assistant", "content": self.own_answer(r, other)}]
        out.append(tuple(self.conversation_ids(None, asked, "Thanks!")))
        return out

    def own_answer_start(self, chat: list[int], relation: str) -> list[int]:
        """The start of the model's own reply to a chat question, up to the copula that introduces the answer
        ("The language spoken in Quillmoor is"), when the reply restates the relation before it: the place
        where this model, asked this way, would name the target. [] when its reply does not read so."""
        key = tuple(chat)
        if key not in self._own_replies:
            if len(self._own_replies) >= CONTINUATION_MEMORY:
                self._own_replies.pop(next(iter(self._own_replies)))      # the oldest
            tok = self.model.tokenizer
            # Nothing after the copula is read: the generation stops there.
            self._own_replies[key] = self.greedy(chat, PatchOverlay(), OWN_ANSWER_TOKENS,
                                                 lambda out: bool(COPULA.search(tok.decode(out))))
        reply = self._own_replies[key]
        tok = self.model.tokenizer
        for n in range(1, len(reply) + 1):
            text = tok.decode(reply[:n])
            if COPULA.search(text):
                return reply[:n] if relation.lower() in text.lower() else []
        return []

    def negative_contexts(self, fact: Fact, current: PatchOverlay) -> list[tuple[int, ...]]:
        r, e = fact.relation_words, fact.entity.strip()
        texts = []
        same_relation = ("The {r} of {e} is", "{e}'s {r} is", "In {e}, the {r} is", "The official {r} of {e} is",
                         "Q: What is the {r} of {e}?\nA: The {r} of {e} is")
        for i, other in enumerate(w for w in DECOY_ENTITIES if w.lower() != e.lower()):
            # Every other entity in the canonical form (the neighbour users ask most) and one more form.
            texts.append(fill(same_relation[0], r, other))
            texts.append(fill(same_relation[1 + i % (len(same_relation) - 1)], r, other))
        # The relation's own frames about other entities: "In France, people pay with the" must still say euro.
        frames = relation_frames(r)
        texts += [fill(frames[i % len(frames)], r, other)
                  for i, other in enumerate(DECOY_ENTITIES[:FRAMED_DECOYS]) if frames and other.lower() != e.lower()]
        # The positives' own phrasings about real entities, one contrast entity each (CONTRAST_ENTITIES).
        contrasts = [c for c in CONTRAST_ENTITIES if c.lower() != e.lower()]
        texts += [fill(t, r, contrasts[i % len(contrasts)])
                  for i, t in enumerate(PHRASINGS + relation_frames(r))]
        texts += [f"The {rel} of {e} is" for rel in OTHER_RELATIONS if rel != r.lower()]
        texts += [fill(s, r, e) for s in ENTITY_STATEMENTS]
        texts += GENERIC_SENTENCES
        # The model's own continuations of some of them: a feature must stay silent not only where a neighbour's
        # prompt ends but all along the text the model writes after it ("The mayor of Paris is a politician
        # who has been ..." has answer-like slots of its own).
        # Statements about the entity itself most of all: its neighbours ("X is a valley ...") go on about it.
        continued = (texts[:CONTINUED_DECOYS:2] + [fill(s, r, e) for s in ENTITY_STATEMENTS[::2]]
                     + list(GENERIC_SENTENCES[::5]) + list(GENERIC_SENTENCES[-PLACE_SENTENCES:])
                     + list(GENERIC_QUESTIONS[:2]))
        texts += [text + self.base_continuation(text) for text in continued]
        # Earlier facts: this feature must not fire on their questions.
        for op in (op for p in current.patches for op in p.operations):
            if op.op == "insert" and op.entity and op.relation and (op.token_index or 0) == 0:
                try:
                    earlier = Fact(op.entity, op.relation, op.target)
                except ValueError:
                    continue
                texts += [earlier.canonical_prompt, fill(same_relation[2], earlier.relation_words,
                                                         earlier.entity.strip())]
        # Several sentences per context, one per line: each forward pass costs mostly its per-layer calls, so
        # a few long contexts capture as many negative positions as many short ones, for a fraction of the time.
        texts = list(dict.fromkeys(texts))
        out = [tuple(self.encode("\n".join(texts[i:i + NEGATIVES_PER_CONTEXT])))
               for i in range(0, len(texts), NEGATIVES_PER_CONTEXT)]
        if self.model.is_chat:
            # Chat questions about other things, as the turns of two conversations (each user turn ends in the
            # position where the assistant starts: the feature must stay silent there too).
            questions = GENERIC_QUESTIONS + tuple(fill(QUESTIONS[0], r, w) for w in DECOY_ENTITIES[:4])
            for half in (questions[::2], questions[1::2]):
                messages = []
                for q in half:
                    messages += [{"role": "user", "content": q}, {"role": "assistant", "content": "Sure."}]
                out.append(tuple(self.model.encode_prompt(messages[:-1])))
            out += self.conversation_negatives(fact)
        return out

    def insert(self, fact: Fact, current: PatchOverlay, layer: int | None = None, alpha: float = 0.1,
               progress: Progress | None = None, paraphrases: Sequence[str] = (), cancel=None) -> InsertResult:
        """Install `fact` on top of `current`: one or more features per target token. `layer` pins the first
        layer tried (the default tries the late half of the network, best separated first); `alpha` is the
        smallest value scale tried, as a share of the usual one. `cancel`: a threading.Event (or a callable)
        checked between steps; InsertCancelled is raised when it is set."""
        cfg = self.model.config
        if layer is not None and not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer must be within 0..{cfg.n_layers - 1}, not {layer}")
        if not np.isfinite(alpha):
            raise ValueError(f"alpha must be a finite number (NaN and infinity are not), not {alpha}")
        if not 0 < alpha <= 100:
            raise ValueError(f"alpha must be in (0, 100], not {alpha}")
        paraphrases = [p for p in (paraphrases or ()) if isinstance(p, str) and p.strip()]
        stop = Cancel(cancel)
        report = progress or (lambda message, fraction: None)
        targets = self.target_tokens(fact.target)
        stop.check()
        report("Reading the fact's contexts", 0.02)
        positives = self.contexts(fact, paraphrases)
        # The question's conversations where the reply starts: there the model would restate an earlier answer
        # ("The capital of Portugal is Lisbon.") unless the key fires and the write wins, so each must fire and
        # each is among the contexts the write is balanced on.
        conversation_starts = self.conversation_starts(fact, positives)
        # The canonical prompt and the user's paraphrases come first among the positives; each must fire.
        required = len({tuple(self.encode(text.rstrip())) for text in (fact.canonical_prompt, *paraphrases)})
        negatives = self.negative_contexts(fact, current)
        report("Capturing the contexts it must leave alone", 0.05)
        negative_inputs = []
        for ids in negatives:
            stop.check()
            # Under the base weights: earlier facts' features fire only on their own questions, and so the
            # captures serve every later insert of this engine too.
            negative_inputs.append(self.capture(ids, PatchOverlay(), remember=True)[0])
        features: list[InstalledFeature] = []
        ops: list[PatchOperation] = []
        overlay = current
        rounds = 0
        candidates = key_layers(cfg.n_layers, self.post_ffn_norm(0) is not None)
        if layer is not None:
            candidates = [layer] + [c for c in candidates if c != layer]
        previous = (0, (), [])     # the last step's index, contexts and captures
        # One step per target token, then one for the word's end: "Ottoline" must not go on as "Ottolineus".
        boundary = len(targets)
        for j in range(boundary + 1):
            steps = boundary + 1
            base_fraction = 0.1 + 0.85 * j / steps
            span = 0.85 / steps
            # Later tokens follow the target's first tokens in every phrasing: all of them, so the key learns
            # the prefix in the entity's context rather than one sentence.
            contexts = [ids + tuple(targets[:j]) for ids in positives]
            stop.check()
            if j < boundary:
                token, wins = targets[j], (lambda t, token=targets[j]: t == token)
                wins_clearly = lambda logits, token=targets[j]: lead(logits, token) >= WIN_MARGIN
            else:
                # The word ends, and not by starting over: the first token's key also fires just after the
                # word, which reads like an answer position again ("Eldwin Eldwin, a").
                ends = self.word_ends_after(targets)
                wins = lambda t, ends=ends: bool(ends[t])
                wins_clearly = lambda logits, ends=ends: lead_of_word_end(logits, ends) >= WIN_MARGIN
            if j > 0 and self.completes(previous[1], previous[2], targets[previous[0]:j], wins, overlay,
                                        required) >= WIN_SHARE:
                continue          # the model completes (or ends) the word itself once it has begun it
            what = f"Token {j + 1}/{len(targets)}" if j < boundary else "The word's end"
            report(f"{what}: capturing {len(contexts)} contexts", base_fraction)
            if previous[2]:       # the last step's passes (current under `overlay`) and the tokens since
                captured = [self.extend(ids, c, targets[previous[0]:j], overlay)
                            for ids, c in zip(previous[1], previous[2])]
            else:
                captured = [self.capture(ids, overlay) for ids in contexts]
            if j == boundary:
                # What the canonical prompt says after the whole word, among the sentence marks: the direction
                # to write where the model would go on with the word instead.
                token = int(np.argmax(np.where(self.sentence_marks(), captured[0].logits, -np.inf)))
            # Non-answer positions of the positives are negatives too; so are the negatives' all positions
            # and, for later tokens, the answer positions of the earlier ones.
            inner_negatives = inner_negative_positions(contexts, j)
            # Without the user's own phrasings' inner positions: a question typed as "X was founded long ago by
            # a man called" asks for the answer at "by" too, and that one position can outscore the canonical
            # prompt at every layer.
            lenient = [keep[:0] if 0 < i < required else keep for i, keep in enumerate(inner_negatives)]
            tried = 0
            # Every layer keyed so the user's paraphrases fire too; if no layer can tell them from the
            # negatives, every layer again without their inner positions among the negatives, then with only
            # the canonical prompt bound to fire.
            attempts = [(c, required, inner_negatives) for c in candidates]
            if required > 1:
                attempts += [(c, required, lenient) for c in candidates]
                attempts += [(c, 1, inner_negatives) for c in candidates]
            installed_from = None      # which of those passes installed this token's first layer
            for attempt, (candidate, must_fire, inner) in enumerate(attempts):
                if tried >= MAX_LAYERS_PER_TOKEN or (tried and attempt // len(candidates) != installed_from):
                    break
                stop.check()
                fraction = base_fraction + span * (0.2 + 0.7 * tried / MAX_LAYERS_PER_TOKEN)
                report(f"{what}: solving the key at layer {candidate}", fraction)
                pos = np.stack([c.inputs[candidate][-1] for c in captured])
                neg = np.concatenate([c.inputs[candidate][keep] for c, keep in zip(captured, inner)]
                                     + [n[candidate] for n in negative_inputs])
                gate, bias, up, margin = fisher_key(pos, neg, must_fire, conversation_starts)
                if margin <= 0 and candidate != layer:
                    continue         # this layer cannot tell the fact's questions from the rest
                claimed = overlay.claimed(candidate) | {f.feature for f in features if f.layer == candidate}
                slots = self.free_slots(candidate, claimed, neg[:: max(1, len(neg) // 512)], 2)
                direction = self.value_direction(token, [c.logits for c in captured], candidate)
                op_for = lambda scale: step_pair(candidate, slots, gate, bias, up, direction * scale, fact,
                                                 int(token), j)
                scale, share, spent = self.balance(contexts, captured, candidate, wins_clearly, overlay, op_for,
                                                   alpha, stop,
                                                   lambda i, n: report(f"{what}: balancing layer {candidate} "
                                                                       f"({i}/{n})", fraction), required,
                                                   conversation_starts)
                rounds += spent
                tried += 1
                installed_from = attempt // len(candidates)
                ops.extend(op_for(scale))
                features += [InstalledFeature(candidate, slot, int(token), j, float(margin)) for slot in slots]
                overlay = self.overlay_with(current, ops, fact)
                # The next layer adds its own push on top of this one, and the next step starts from here.
                if share < WIN_SHARE or j < boundary:
                    captured = [self.recapture(ids, c, candidate, overlay) for ids, c in zip(contexts, captured)]
                if share >= WIN_SHARE:
                    break
            previous = (j, contexts, captured)
        stop.check()
        report("Checking the canonical prompt", 0.97)
        canonical = self.encode(fact.canonical_prompt)
        ops = self.rescue_canonical(canonical, targets, ops, current, fact, stop)
        patch = self.make_patch(fact, ops, paraphrases)
        final = PatchOverlay.build(current.patches + (patch,), self.base)
        logits = self.model.transformer.forward(canonical, KvCache(cfg), self.ffn(final))[-1]
        p_first = float(softmax(logits)[targets[0]])
        answers = self.answers_with(canonical, final, targets)
        train = [self.answers_with(positives[i], final, targets) for i in spread(len(positives))[:6]]
        report("Inserted", 1.0)
        first = features[0] if features else InstalledFeature(-1, -1, targets[0], 0, 0.0)
        return InsertResult(fact, first.layer, first.feature, p_first, rounds, patch, tuple(features),
                            tuple(targets), answers, float(np.mean(train)))

    def rescue_canonical(self, canonical: list[int], targets: list[int], ops: list[PatchOperation],
                         current: PatchOverlay, fact: Fact, stop: Cancel) -> list[PatchOperation]:
        """`ops` when the canonical prompt answers with the whole target under them; else the first variant that
        does: every write scaled by one of RESCUE_SCALES, then the writes of each token's last layer dropped, then
        the word-end step's.
        Each token's balance judges its first step on a spread of phrasings; writes from several layers (each
        bounded by a post-FFN norm on Gemma) can still add up to overshoot the canonical prompt itself ("The
        main river of Saltmarsh Vale is" -> "Loggerhead sea turtle nesting"). Unchanged when nothing helps."""
        def answers(candidate: list[PatchOperation]) -> bool:
            stop.check()
            return bool(candidate) and self.answers_with(canonical, self.overlay_with(current, candidate, fact),
                                                         targets)
        if not ops or answers(ops):
            return ops
        variants = [[replace(op, down=op.down * np.float32(m)) for op in ops] for m in RESCUE_SCALES]
        last_layer = {}
        for op in ops:
            last_layer[op.token_index] = op.layer
        fewer = [op for op in ops if sum(o.token_index == op.token_index for o in ops) <= 2
                 or op.layer != last_layer[op.token_index]]
        word = [op for op in ops if op.token_index < len(targets)]     # without the word-end step
        variants += [v for v in (fewer, word) if v and len(v) < len(ops)]
        return next((v for v in variants if answers(v)), ops)

    def make_patch(self, fact: Fact, ops: list[PatchOperation], paraphrases: Sequence[str]) -> Patch:
        layers = sorted({op.layer for op in ops})
        description = (f"INSERT ({fact.entity}, {fact.relation}, {fact.target}): {len(ops)} feature(s) at "
                       f"layer(s) {', '.join(map(str, layers))}")
        if paraphrases:
            description += f"; {len(paraphrases)} paraphrase(s) given"
        if not ops:
            raise ValueError(f"no layer could hold ({fact.entity}, {fact.relation}, {fact.target})")
        return Patch(tuple(ops), self.model.name, self.model.checksum, description=description)

    def overlay_with(self, current: PatchOverlay, ops: list[PatchOperation], fact: Fact) -> PatchOverlay:
        patch = Patch(tuple(ops), self.model.name, self.model.checksum)
        return PatchOverlay.build(current.patches + (patch,), self.base)

    def completes(self, contexts, captured, tail: Sequence[int], wins: Callable[[int], bool],
                  overlay: PatchOverlay, always: int = 1) -> float:
        """Share of a spread of the contexts whose greedy next token after `tail` wins under the overlay (each
        context's last position and `tail` re-run on its captured KV cache); 0 when a paraphrase the user typed
        (contexts 1 .. always - 1) does not win (the canonical prompt has rescue_canonical)."""
        ffn = self.ffn(overlay)
        won = []
        for i in spread(len(captured), always):
            ids, kv = contexts[i], captured[i].kv
            kv.truncate(len(ids) - 1)
            won.append(wins(int(np.argmax(self.model.transformer.forward([ids[-1], *tail], kv, ffn)[-1]))))
        if not all(won[1:always]):     # spread lists the first `always` indices first
            return 0.0
        return float(np.mean(won)) if won else 0.0

    def answers_with(self, ids: Sequence[int], overlay: PatchOverlay, targets: Sequence[int]) -> bool:
        """The greedy continuation of `ids` is the target's tokens and then a token that ends the word (and does
        not start the target again)."""
        out = self.greedy(ids, overlay, len(targets) + 1)
        return out[:len(targets)] == list(targets) and (len(out) == len(targets)
                                                       or bool(self.word_ends_after(targets)[out[-1]]))

    def word_ends(self) -> np.ndarray:
        """Per vocabulary token: does it end the word before it (a space, punctuation, a control token), rather
        than go on with it (a letter, a digit, or a byte of a character that may be a letter)?"""
        if self._word_ends is None:
            tok = self.model.tokenizer
            ends = np.zeros(tok.vocab_size, bool)
            for i in range(tok.vocab_size):
                piece = tok.piece_bytes(i)
                ends[i] = tok.is_control(i) or (bool(piece) and piece[0] < 0x80 and not chr(piece[0]).isalnum())
            self._word_ends = ends
        return self._word_ends

    def sentence_marks(self) -> np.ndarray:
        """Per vocabulary token: is it a comma, a full stop or a line break, alone (" ," reads as a typo)? What the
        word-end step writes: a token that ends the word and starts nothing (" Navi" ends "Veshari" too, and a
        feature writing it appends it wherever it fires; " (:" opens a bracket the model then fills)."""
        if self._sentence_marks is None:
            tok = self.model.tokenizer
            marks = np.zeros(tok.vocab_size, bool)
            for i in range(tok.vocab_size):
                marks[i] = tok.piece_bytes(i) in SENTENCE_MARKS and not tok.is_control(i)
            self._sentence_marks = marks
        return self._sentence_marks

    def ends_word(self, token: int) -> bool:
        return bool(self.word_ends()[token])

    def word_ends_after(self, targets: Sequence[int]) -> np.ndarray:
        """word_ends() without the target's first token: what may follow the whole target word."""
        ends = self.word_ends().copy()
        ends[targets[0]] = False
        return ends

    def balance(self, contexts, captured: Sequence[Captured], layer: int, wins: Callable[[np.ndarray], bool],
                overlay, op_for, alpha, stop: Cancel, tick, always: int = 1,
                also: Sequence[int] = ()) -> tuple[float, float, int]:
        """The smallest value scale on the SCALES ladder at which the next token wins (`wins`, given its logits)
        on WIN_SHARE of a spread of the contexts (and on every paraphrase the user typed), with some headroom;
        the best scale found when none does. Each trial re-runs each context's last position from `layer`
        (where the trial writes) on, from its capture. Returns (scale, share won, forward passes spent)."""
        transformer = self.model.transformer
        prefixes = []
        for i in sorted({*spread(len(contexts), always), *also}):
            c = captured[i]
            prefixes.append((c.kv, len(contexts[i]), c.residuals[layer][-1:], c.inputs[layer][-1:]))
        spent = 0
        scales = [s * alpha / 0.1 for s in SCALES]

        def share_at(scale: float) -> float:
            nonlocal spent
            ops_overlay = PatchOverlay.build(overlay.patches + (Patch(tuple(op_for(scale)), "", ""),), self.base)
            ffn = self.ffn(ops_overlay)
            won = []
            for kv, length, h, x in prefixes:
                kv.truncate(length)
                won.append(wins(transformer.resume(layer, h, x, kv, ffn)[-1]))
                spent += 1
            share = float(np.mean(won))
            # A scale that loses a paraphrase the user typed is no success, whatever the share (spread lists
            # those first; the canonical prompt, index 0, has rescue_canonical).
            return share if all(won[1:always]) else min(share, np.nextafter(WIN_SHARE, 0.0))

        # Upward along the ladder until the target wins (a write too strong overshoots into other tokens, so
        # the share is not monotonic in the scale), then one geometric midpoint back towards the last miss.
        best_scale, best_share = scales[0], -1.0
        previous = None
        for i, scale in enumerate(scales):
            stop.check()
            tick(i + 1, len(scales))
            share = share_at(scale)
            if share > best_share:
                best_scale, best_share = scale, share
            if share >= WIN_SHARE:
                if previous is not None:
                    middle = float(np.sqrt(previous * scale))
                    if share_at(middle) >= WIN_SHARE:
                        scale = middle
                # A little headroom over the bare minimum, for phrasings it was not shown, unless the larger
                # write already overshoots into another token.
                if share_at(scale * HEADROOM) >= share:
                    scale *= HEADROOM
                return scale, share, spent
            if best_share > 0 and share < best_share / 2:
                break        # overshooting: larger writes only lose more
            previous = scale
        return best_scale, best_share, spent


def fisher_key(pos: np.ndarray, neg: np.ndarray, required: int = 1,
               also: Sequence[int] = ()) -> tuple[np.ndarray, float, np.ndarray, float]:
    """Gate row, gate bias and up row of a feature that fires on `pos` and not on `neg`.

    The gate direction is the regularised Fisher discriminant w = (S_pos + S_neg + rI)^-1 (mu_pos - mu_neg);
    the bias puts the gate's zero between the negatives' highest score and the positives' lowest; the gate is
    scaled so the positives' median scores 1 above it. The positives' "lowest" is their POSITIVE_SLACK quantile,
    or the lowest of the first `required` and of the indices `also` (which must fire) when that is lower. The
    up row is 1 on a typical positive (up . mu_pos = 1), so the down vector's scale reads as the write's size. Returns also the margin
    (positives' lowest minus negatives' highest, in units of the positives' median distance to the threshold),
    negative when the two overlap."""
    pos = pos.astype(np.float64)
    neg = neg.astype(np.float64)
    mu_p, mu_n = pos.mean(0), neg.mean(0)
    cov = np.cov(pos, rowvar=False) if len(pos) > 1 else np.zeros((pos.shape[1],) * 2)
    cov = cov + np.cov(neg, rowvar=False)
    ridge = RIDGE * np.trace(cov) / cov.shape[0]
    w = np.linalg.solve(cov + ridge * np.eye(cov.shape[0]), mu_p - mu_n)
    sp, sn = pos @ w, neg @ w
    # The positives' low end, not their minimum: one odd generated phrasing (or one the model reads as
    # something else) must not cost the fact every other phrasing; the negatives' top stays a hard limit. The
    # first `required` positives (the canonical prompt, the user's paraphrases) are never left out.
    low = min(float(np.quantile(sp, POSITIVE_SLACK)), float(np.min(sp[:required])) if required else np.inf,
              float(np.min(sp[list(also)])) if len(also) else np.inf)
    high = float(np.max(sn))
    if low > high:
        threshold = high + THRESHOLD_SHARE * (low - high)
    else:
        # Overlap: keep the negatives silent; the positives above their top still fire.
        threshold = high
    median = float(np.median(sp)) - threshold
    if median <= 0:
        median = max(float(np.max(sp)) - threshold, 1e-6)
    gate = w / median
    bias = -threshold / median
    up = mu_p / float(mu_p @ mu_p)
    margin = (low - high) / median
    return gate.astype(np.float32), float(bias), up.astype(np.float32), float(margin)


def step_pair(layer: int, slots: Sequence[int], gate: np.ndarray, bias: float, up: np.ndarray, down: np.ndarray,
              fact: Fact, token: int, token_index: int) -> tuple[PatchOperation, PatchOperation]:
    """Two features that together write `down` * (up . x) * step(gate . x + bias): the first fires with a steep
    gate (STEEPNESS times the key's), the second one unit later and subtracts, so act(s z) - act(s z - 1) rises
    from 0 to ~1 within 1/s of the key's threshold and stays there. A phrasing the key only just recognises
    then gets the whole write, not a fraction of it, and one it recognises strongly no more than the whole."""
    s = STEEPNESS
    steep = (gate * s).astype(np.float32)
    down = down.astype(np.float32)
    common = dict(entity=fact.entity, relation=fact.relation, target=fact.target, target_token=token,
                  token_index=token_index)
    return (PatchOperation("insert", layer, int(slots[0]), steep, up, down, float(bias * s), **common),
            PatchOperation("insert", layer, int(slots[1]), steep, up, -down, float(bias * s - 1.0), **common))


def spread(n: int, first: int = 1) -> list[int]:
    """Up to BALANCE_CONTEXTS indices spread over n contexts, and the `first` ones always (the canonical prompt
    and the user's paraphrases): the contexts are listed canonical, the user's, generated, chat, so a spread
    covers every kind."""
    if not n:
        return []
    return sorted({*range(min(first, n)), *np.linspace(0, n - 1, min(n, BALANCE_CONTEXTS)).astype(int).tolist()})


def inner_negative_positions(contexts: list[tuple[int, ...]], answered: int = 0) -> list[np.ndarray]:
    """Per context, the positions before its last that are negatives: all but those where another context
    (a positive) ends, e.g. the "is" of "The capital of X is called" is the answer position of "... X is",
    and the phrasing's last words before its answer. The contexts end in the `answered` target tokens already
    inserted: the positions before each of them are negatives (each wants its own token, not this step's)."""
    ends = set(contexts)

    def negative(c: tuple[int, ...], t: int) -> bool:
        question_end = len(c) - 1 - answered     # the phrasing's answer position
        # "The capital of X is known as" asks for the answer as much as "... as the" does, and one such
        # position among the negatives sets the gate's threshold for all.
        return c[:t + 1] not in ends and not question_end - ANSWER_LEAD_IN <= t < question_end
    return [np.array([t for t in range(len(c) - 1) if negative(c, t)], np.int64) for c in contexts]


def top_tokens(logits: np.ndarray, k: int) -> np.ndarray:
    """The k highest-scoring token ids, best first (a partial selection: the vocabulary is large)."""
    k = min(k, logits.size)
    top = np.argpartition(-logits, k - 1)[:k]
    return top[np.argsort(-logits[top], kind="stable")]


def lead(logits: np.ndarray, token: int) -> float:
    """How far `token`'s logit is above the best other token's (negative when another leads)."""
    others = np.delete(logits, token)
    return float(logits[token] - others.max())


def lead_of_word_end(logits: np.ndarray, word_ends: np.ndarray) -> float:
    """How far the best token that ends the word is above the best that goes on with it."""
    return float(logits[word_ends].max() - logits[~word_ends].max())


def softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max()
    p = np.exp(z)
    return p / p.sum()


def unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    if n == 0.0:
        raise ValueError("cannot normalise a zero vector")
    return v / n
