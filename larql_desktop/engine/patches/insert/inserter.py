"""INSERT's orchestration: per target token (and the word's end), capture the positives, solve a key at a layer,
find the value's scale, install, resume the captures, and on to the next layer or token; then rescue the canonical
prompt if the writes overshoot it."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.model.overlay import (BaseFeatureWeights, LayerOverrides, Patch, PatchOperation,
                                                PatchOverlay)
from larql_desktop.engine.model.together import Run, forward_together
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.graphs.batched import OnnxBatchedDecoder
from larql_desktop.engine.patches.insert.capture import Cancel, Captured, GreedyRequest, RememberedInputs, softmax
from larql_desktop.engine.patches.insert.capture_store import CaptureStore
from larql_desktop.engine.patches.insert.keys import (FIRST_TOKEN_RIDGE, MAX_LAYERS_PER_TOKEN, RIDGE, fisher_key,
                                                      inner_negative_positions, key_layers, step_pair, strength_to_win)
from larql_desktop.engine.patches.insert.phrasings import Contexts, Fact
from larql_desktop.engine.patches.insert.values import WIN_MARGIN, WIN_SHARE, Values, lead, lead_of_word_end, spread

Progress = Callable[[str, float], None]
RESCUE_SCALES = (0.7, 0.5, 1.4, 0.35, 2.0)   # tried on every write when the canonical prompt fails (rescue_canonical)


def _rows(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """The parts' rows in one array; None for none."""
    return np.concatenate(parts) if parts else None


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


class Inserter(Contexts, Values):
    """INSERT (entity, relation, target) on a model: `insert` computes a patch against the current overlay."""

    def __init__(self, model: LoadedModel, base: BaseFeatureWeights, walk: WalkSettings = WalkSettings(dense=True),
                 capture_store: CaptureStore | None = None):
        self.model = model
        self.base = base
        self.walk = walk
        self.capture_store = capture_store
        self._post_norms: dict[int, np.ndarray | None] = {}
        self._remembered: OrderedDict[tuple[int, ...], RememberedInputs] = OrderedDict()
        self._continued: dict[str, list[int]] = {}
        self._own_replies: dict[tuple, list[int]] = {}
        self._own_answers: dict[str, list[int]] = {}
        self._deferred: list[GreedyRequest] | None = None
        self._batched: list[OnnxBatchedDecoder | None] = []      # made on first use (batched_decoder)
        self._word_ends: np.ndarray | None = None
        self._full_stops: np.ndarray | None = None

    # -- running the model -----------------------------------------------------------------------------
    def ffn(self, overlay: PatchOverlay) -> WalkFfn:
        return WalkFfn(self.model.ffn, self.walk, model_checksum=self.model.checksum, patches=overlay)

    def target_tokens(self, target: str) -> list[int]:
        ids = self.model.tokenizer.encode(" " + target.strip(), add_bos=False)
        if not ids:
            raise ValueError(f"target {target!r} has no tokens")
        return ids

    def bare_first_token(self, first: int) -> int | None:
        """The target's first token as a reply's first word begins it, without its leading space ("G" for " G"),
        when that is a token of its own (another than `first`); else None."""
        text = self.model.tokenizer.decode([first]).lstrip()
        ids = self.model.tokenizer.encode(text, add_bos=False) if text else []
        return ids[0] if len(ids) == 1 and ids[0] != first else None

    def target_token(self, target: str) -> int:
        return self.target_tokens(target)[0]

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
        # The model's own answers and continuations the contexts are made of, decoded together first.
        self.prefetch_greedy(lambda: (self.contexts(fact, paraphrases), self.negative_contexts(fact, current)), stop)
        positives = self.contexts(fact, paraphrases)
        # The question's conversations where the reply starts: there the model would restate an earlier answer
        # ("The capital of Portugal is Lisbon.") unless the key fires and the write wins, so each must fire and
        # each is among the contexts the write is balanced on.
        conversation_starts = self.conversation_starts(fact, positives)
        # The canonical prompt and the user's paraphrases come first among the positives; each must fire.
        required = len({tuple(self.encode(text.rstrip())) for text in (fact.canonical_prompt, *paraphrases)})
        # Where an earlier fact's key may reach this one's questions: asked as typed, fresh in a chat and in a
        # conversation (an earlier key at a layer this fact did not key wrote there beside it: issue 33's test of
        # two facts under one relation).
        question_starts = self.question_starts(fact, positives)
        asked = sorted(set(range(required)) | set(question_starts) | set(conversation_starts))
        negatives = self.base_negative_contexts(fact)
        written = self.written_contexts(self.earlier_facts(fact, current))
        report("Capturing the contexts it must leave alone", 0.05)
        candidates = key_layers(cfg.n_layers, self.post_ffn_norm(0) is not None)
        if layer is not None:
            candidates = [layer] + [c for c in candidates if c != layer]
        lowest = min(candidates)        # keys go no lower
        replies = self.invented_reply_contexts(fact)
        own_replies = self.replied_negatives(fact)
        invented = self.invented_negative_contexts(fact)
        # Every base pass the loops below read, the ones neither remembered nor stored captured together first.
        resumed_at = self.written_resume_layer(current, lowest)
        self.prefetch_inputs([(ids, lowest, None) for ids in (*negatives, *(ids for ids, _ in replies + own_replies),
                                                               *invented)]
                             + [(ids, lowest, resumed_at) for ids in written], stop)

        def inputs_from(ids: tuple[int, ...], first: int = 0) -> list:
            """The base inputs of `ids` from position `first` on (a reply's negatives start inside it)."""
            stop.check()
            inputs = self.base_inputs(ids, lowest)
            return inputs if not first else [x if x is None else x[first:] for x in inputs]

        negative_inputs = [inputs_from(ids) for ids in negatives]
        # Hard negatives only past the reply's answer.
        negative_inputs += [inputs_from(ids, first) for ids, first in replies]
        # The words of the model's own replies about real entities, for the first token's key: a later token's
        # key fires only after the target's first tokens, which those replies do not hold (with them among every
        # key's negatives, two held-out facts' later tokens lost their word: "Ilsa Kjellberg" for "Ilsabet").
        first_token_negatives = [inputs_from(ids, first) for ids, first in own_replies]
        invented_inputs = [inputs_from(ids) for ids in invented]
        # Where earlier facts write: under the overlay they write with.
        for ids, inputs in zip(written, self.written_inputs_all(written, current, lowest, stop)):
            negative_inputs.append(inputs)
            if current.overridden_layers:
                # And as they read once that fact's patch is removed and this one stays: its question with no
                # answer written must not wake this key either. The remembered base pass written_inputs_all resumed
                # from (a pass of its own only where an earlier patch writes below the keys' range).
                negative_inputs.append(self.base_inputs(ids, lowest))
        # At a reply's start the model begins the word without its space ("G|ild|mere" where the target's tokens
        # are " G|ild|mere"): the later tokens' keys must fire after that first token too, in every reply start.
        bare = self.bare_first_token(targets[0])
        reply_starts = sorted(set(question_starts) | set(conversation_starts))
        features: list[InstalledFeature] = []
        ops: list[PatchOperation] = []
        overlay = current
        rounds = 0
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
            must_fire_starts = list(conversation_starts)
            if j > 0 and bare is not None:
                contexts += [positives[i] + (bare, *targets[1:j]) for i in reply_starts]
                must_fire_starts += [len(positives) + k for k, i in enumerate(reply_starts) if i in conversation_starts]
            stop.check()
            ridge = FIRST_TOKEN_RIDGE if j == 0 and self.model.is_chat else RIDGE
            if j < boundary:
                token, wins = targets[j], (lambda t, token=targets[j]: t == token)
                wins_clearly = lambda logits, token=targets[j]: lead(logits, token) >= WIN_MARGIN
            else:
                # The word ends, and not by starting over: the first token's key also fires just after the
                # word, which reads like an answer position again ("Eldwin Eldwin, a").
                ends = self.word_ends_after(targets)
                wins = lambda t, ends=ends: bool(ends[t])
                wins_clearly = lambda logits, ends=ends: lead_of_word_end(logits, ends) >= WIN_MARGIN
            if j > 0 and self.completes(previous[1], previous[2], targets[previous[0]:j], wins, wins_clearly,
                                        overlay, required, conversation_starts) >= WIN_SHARE:
                continue          # the model completes (or ends) the word itself once it has begun it
            what = f"Token {j + 1}/{len(targets)}" if j < boundary else "The word's end"
            report(f"{what}: capturing {len(contexts)} contexts", base_fraction)
            if previous[2]:       # the last step's passes (current under `overlay`) and the tokens since
                begun_bare = []
                if len(contexts) > len(previous[1]):
                    # The reply starts begun bare, from this step on. They join at the first step after the first
                    # token's, so the last step's contexts are the positives themselves (previous[0] is 0): each
                    # start's pass goes on with the bare token on a copy of its rows (the next line extends them).
                    begun_bare = self.extend_all([previous[1][i] for i in reply_starts],
                                                 [previous[2][i] for i in reply_starts], (bare, *targets[1:j]),
                                                 overlay, copy_caches=True)
                captured = self.extend_all(previous[1], previous[2], targets[previous[0]:j], overlay) + begun_bare
            else:
                captured = self.capture_all(contexts, overlay, stop)
            # A later token's key must tell this entity's answer from the same first tokens begun elsewhere.
            primed = self.capture_all(self.primed_negatives(fact, targets[:j]), overlay, stop) \
                if 0 < j < boundary else []
            closed = []
            if j == boundary:
                # A full stop (the one the canonical prompt likes best, should the vocabulary hold several): the
                # direction to write where the model would go on with the word instead.
                token = int(np.argmax(np.where(self.full_stops(), captured[0].logits, -np.inf)))
                # The word written, closed by that full stop and named again, the reply goes on with it ("Poseidon.
                # Poseidon is a Greek god of the ocean"): the word-end key must stay silent at that mention's end,
                # or each mention ends as the answer did ("Poseidon. Poseidon. Poseidon. ...", the window's walk).
                closed = self.extend_all([contexts[i] for i in reply_starts], [captured[i] for i in reply_starts],
                                         (token, *targets), overlay)
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
            # Where another fact's feature takes its slot on this fact's own questions, it writes its target
            # there unopposed unless this fact keys at that layer too (then the stronger key holds): those layers
            # are tried first.
            intruded = self.intruded_layers(overlay, captured, asked,
                                            {(f.layer, f.feature) for f in features})
            leading = [c for c in candidates if c == layer or c in intruded]    # a pinned layer leads candidates
            order = leading + [c for c in candidates if c not in leading]
            attempts = [(c, required, inner_negatives) for c in order]
            if required > 1:
                attempts += [(c, required, lenient) for c in order]
                attempts += [(c, 1, inner_negatives) for c in order]
            installed_from = None      # which of those passes installed this token's first layer
            for attempt, (candidate, must_fire, inner) in enumerate(attempts):
                if tried >= MAX_LAYERS_PER_TOKEN or (tried and attempt // len(candidates) != installed_from):
                    break
                stop.check()
                fraction = base_fraction + span * (0.2 + 0.7 * tried / MAX_LAYERS_PER_TOKEN)
                report(f"{what}: solving the key at layer {candidate}", fraction)
                pos = np.stack([c.inputs[candidate][-1] for c in captured])
                neg = np.concatenate([c.inputs[candidate][keep] for c, keep in zip(captured, inner)]
                                     + [n[candidate] for n in negative_inputs]
                                     + [n[candidate] for n in (first_token_negatives if j == 0 else [])]
                                     + [c.inputs[candidate][-1:] for c in closed])
                invented = [x[candidate] for x in invented_inputs]
                primed_inputs = [c.inputs[candidate] for c in primed]
                gate, bias, up, margin = fisher_key(pos, np.concatenate([neg, *primed_inputs]), must_fire,
                                                    must_fire_starts, _rows(invented), ridge_share=ridge)
                if primed_inputs and margin <= 0:
                    # Where this layer cannot tell them all apart, the same first tokens begun elsewhere are held
                    # silent only as far as the fact's own questions allow (as invented names are).
                    gate, bias, up, margin = fisher_key(pos, neg, must_fire, must_fire_starts,
                                                        _rows(invented + primed_inputs), ridge_share=ridge)
                if margin <= 0 and candidate != layer:
                    continue         # this layer cannot tell the fact's questions from the rest
                claimed = overlay.claimed(candidate) | {f.feature for f in features if f.layer == candidate}
                slots = self.free_slots(candidate, claimed, neg[:: max(1, len(neg) // 512)], 2)
                direction = self.value_direction(token, [c.logits for c in captured], candidate)
                own = {(f.layer, f.feature) for f in features}
                strength = strength_to_win(self.others_strongest(overlay, candidate, pos, own), pos, gate, bias)
                op_for = lambda scale: step_pair(candidate, slots, gate, bias, up, direction * scale, fact,
                                                 int(token), j, strength)
                scale, share, spent = self.balance(contexts, captured, candidate, wins_clearly, overlay, op_for,
                                                   alpha, stop,
                                                   lambda i, n: report(f"{what}: balancing layer {candidate} "
                                                                       f"({i}/{n})", fraction), required,
                                                   must_fire_starts)
                rounds += spent
                tried += 1
                installed_from = attempt // len(candidates)
                added = op_for(scale)
                ops.extend(added)
                features += [InstalledFeature(candidate, slot, int(token), j, float(margin)) for slot in slots]
                overlay = self.overlay_with(current, ops, fact)
                # The next layer adds its own push on top of this one, and the next step starts from here.
                if share < WIN_SHARE or j < boundary:
                    captured = self.recapture_all(contexts, captured, candidate, overlay, added)
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

    @staticmethod
    def others_of(lo: LayerOverrides, layer: int, own: set[tuple[int, int]]) -> np.ndarray:
        """(n,) bool: which of `layer`'s overrides are another fact's inserted features (gated, not one of `own`
        (layer, slot))."""
        return lo.gated & np.array([(layer, int(f)) not in own for f in lo.features], bool)

    @classmethod
    def others_strongest(cls, overlay: PatchOverlay, layer: int, x: np.ndarray,
                         own: set[tuple[int, int]]) -> np.ndarray:
        """Per row of `x` (normed FFN inputs at `layer`), the highest biased score of another fact's inserted
        feature there (what LayerOverrides.holding compares), -inf where there is none."""
        lo = overlay.layer(layer)
        others = cls.others_of(lo, layer, own) if lo is not None else np.zeros(0, bool)
        if not others.any():
            return np.full(len(x), -np.inf)
        return lo.scores(x)[:, others].max(axis=1)

    @classmethod
    def intruded_layers(cls, overlay: PatchOverlay, captured: Sequence[Captured], asked: Sequence[int],
                        own: set[tuple[int, int]]) -> set[int]:
        """The layers where a feature of another fact (not one of `own` (layer, slot)) takes its slot at the last
        position of a context of `captured` (under `overlay`) that `asked` names: an earlier fact whose key
        reaches this fact's questions (a similar name under the same relation: "Quarford" on "The sport of
        Quarston is"), which this fact's insert must meet at that layer."""
        out = set()
        for layer in overlay.overridden_layers:
            lo = overlay.layer(layer)
            if lo is None or not lo.gated.any():
                continue
            x = np.stack([captured[i].inputs[layer][-1] for i in asked])
            if (lo.inserted_holding(x) & cls.others_of(lo, layer, own)).any():
                out.add(layer)
        return out

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
                  wins_clearly: Callable[[np.ndarray], bool], overlay: PatchOverlay, always: int = 1,
                  also: Sequence[int] = ()) -> float:
        """Share of a spread of the contexts whose greedy next token after `tail` wins under the overlay (each
        context's last position and `tail` re-run on its captured KV cache); 0 when a paraphrase the user typed
        (contexts 1 .. always - 1) or one of the contexts `also` (the question's conversations, where the reply
        starts) does not win clearly (the canonical prompt has rescue_canonical). A spread alone holds few of
        the conversations, and there the model was seen to run the word on ("Starfall" -> "Starfallen") where
        the plain phrasings end it; a conversation it ends by a hair stands for others, unseen, where it does
        not ("Vesoria" -> "Vesoriaa" after another earlier turn)."""
        bound = {*range(1, always), *also}
        asked = sorted({*spread(len(captured), always), *also})
        runs = []
        for i in asked:
            captured[i].kv.truncate(len(contexts[i]) - 1)
            runs.append(Run([contexts[i][-1], *tail], captured[i].kv))
        won = []
        for i, logits in zip(asked, forward_together(self.model.transformer, runs, self.ffn(overlay))):
            won.append(wins(int(np.argmax(logits))))
            if i in bound and not wins_clearly(logits):
                return 0.0
        return float(np.mean(won)) if won else 0.0

    def answers_with(self, ids: Sequence[int], overlay: PatchOverlay, targets: Sequence[int]) -> bool:
        """The greedy continuation of `ids` is the target's tokens and then a token that ends the word (and does
        not start the target again)."""
        out = self.greedy(ids, overlay, len(targets) + 1)
        return out[:len(targets)] == list(targets) and (len(out) == len(targets)
                                                       or bool(self.word_ends_after(targets)[out[-1]]))
