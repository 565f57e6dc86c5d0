"""What an INSERT feature writes: the direction that raises the target token against the model's own candidates
through the final norm and the unembedding (and a post-FFN norm), turned until the head alone names the target
first, and the scale found by a search over real forward passes until the target wins on the positives."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from larql_desktop.engine.formats.quants import dequantize, dequantize_rows
from larql_desktop.engine.model.overlay import BaseFeatureWeights, Patch, PatchOverlay
from larql_desktop.engine.model.together import Resumed, resume_together
from larql_desktop.engine.patches.insert.capture import Cancel, Captured, Capturing, softmax

# Share of the positives the target must win on (greedy) before a scale is accepted.
WIN_SHARE = 0.9
# ... and by how much (logits, i.e. nats): a write that only just wins on the phrasings it was balanced on loses
# on the next one the user types, where the model's own answer is a little stronger.
WIN_MARGIN = 1.0
FULL_STOP = b"."   # what the word-end step writes (Inserter.full_stops)
SCALES = tuple(float(4.0 ** k) for k in range(1, 6))    # 4 .. 1024, in units of the normed FFN input
HEADROOM = 1.25
BALANCE_CONTEXTS = 16
# Value directions are turned until the head, given the direction alone, names the target first by this lead
# (logits), pushing away from up to SATURATION_RIVALS tokens per step (Inserter.saturating).
SATURATION_LEAD = 2.0
SATURATION_RIVALS = 8
SATURATION_STEPS = 12
SATURATION_STEP = 0.5



class Values(Capturing):
    """The value side of a feature (and what counts as the word's end)."""
    base: BaseFeatureWeights
    _post_norms: dict[int, np.ndarray | None]
    _word_ends: np.ndarray | None
    _full_stops: np.ndarray | None

    def post_ffn_norm(self, layer: int) -> np.ndarray | None:
        if layer not in self._post_norms:
            t = self.model.gguf.tensors
            name = f"blk.{layer}.post_ffw_norm.weight"
            self._post_norms[layer] = dequantize(t[name]) if name in t else None
        return self._post_norms[layer]

    def output_rows(self, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(self.model.transformer.output_tensor, np.asarray(ids, np.int64))

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

    def full_stops(self) -> np.ndarray:
        """Per vocabulary token: is it a full stop, alone (" ." reads as a typo)? What the word-end step writes: a
        token that ends the word and starts nothing (" Navi" ends "Veshari" too, and a feature writing it appends
        it wherever it fires; " (:" opens a bracket the model then fills). Not a comma or a line break: the
        word-end key fires after the word wherever it is written, the reply's own later mentions too, and a comma
        there called the name up again ("Poseidon, the capital of Atlantis is Poseidon, Poseidon, Poseidon, ...",
        the window's walk); a full stop closes the answer (" Poseidon. Poseidon is a Greek god of the ocean")."""
        if self._full_stops is None:
            tok = self.model.tokenizer
            stops = np.zeros(tok.vocab_size, bool)
            for i in range(tok.vocab_size):
                stops[i] = tok.piece_bytes(i) == FULL_STOP and not tok.is_control(i)
            self._full_stops = stops
        return self._full_stops

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
        (where the trial writes) on, from its capture, all of them together (model/together.py). Returns
        (scale, share won, forward passes spent)."""
        prefixes = []
        for i in sorted({*spread(len(contexts), always), *also}):
            c = captured[i]
            prefixes.append((c.kv, len(contexts[i]), c.residuals[layer][-1:], c.inputs[layer][-1:]))
        spent = 0
        scales = [s * alpha / 0.1 for s in SCALES]

        def share_at(scale: float, need: float | None = None) -> float:
            """The share won at `scale`; with `need`, one below `need` when the share does not reach it (or a
            paraphrase the user typed loses): the callers that only ask whether a scale reaches `need` read no
            more."""
            nonlocal spent
            ops_overlay = PatchOverlay.build(overlay.patches + (Patch(tuple(op_for(scale)), "", ""),), self.base)
            for kv, length, _, _ in prefixes:
                kv.truncate(length)
            resumed = [Resumed(h, x, kv) for kv, _, h, x in prefixes]
            won = [wins(logits) for logits in resume_together(self.model.transformer, layer, resumed,
                                                               self.ffn(ops_overlay))]
            spent += len(won)
            share = float(np.mean(won))
            if need is not None and (share < need or (need >= WIN_SHARE and not all(won[1:always]))):
                return float(np.nextafter(need, -np.inf))
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
                    if share_at(middle, WIN_SHARE) >= WIN_SHARE:
                        scale = middle
                # A little headroom over the bare minimum, for phrasings it was not shown, unless the larger
                # write already overshoots into another token.
                if share_at(scale * HEADROOM, share) >= share:
                    scale *= HEADROOM
                return scale, share, spent
            if best_share > 0 and share < best_share / 2:
                break        # overshooting: larger writes only lose more
            previous = scale
        return best_scale, best_share, spent


def spread(n: int, first: int = 1) -> list[int]:
    """Up to BALANCE_CONTEXTS indices spread over n contexts, and the `first` ones always (the canonical prompt
    and the user's paraphrases): the contexts are listed canonical, the user's, generated, chat, so a spread
    covers every kind."""
    if not n:
        return []
    return sorted({*range(min(first, n)), *np.linspace(0, n - 1, min(n, BALANCE_CONTEXTS)).astype(int).tolist()})


TOP_BLOCK = 64      # top_tokens' block of the vocabulary


def top_tokens(logits: np.ndarray, k: int) -> np.ndarray:
    """The k highest-scoring token ids, best first. The k-th highest of the blocks' maxima bounds the k-th
    highest logit from below (those k maxima are k logits), so only the few logits at or above it are
    partitioned: ~75 us instead of ~500 for a partition of SmolLM2's 49,152 (INSERT asks for ~90 contexts'
    top tokens at every candidate layer)."""
    k = min(k, logits.size)
    whole = logits.size // TOP_BLOCK * TOP_BLOCK
    candidates = np.arange(logits.size)
    if whole // TOP_BLOCK >= 4 * k:
        maxima = logits[:whole].reshape(-1, TOP_BLOCK).max(axis=1)
        floor = np.partition(maxima, maxima.size - k)[maxima.size - k]
        candidates = np.flatnonzero(logits >= floor)
    top = candidates[np.argpartition(-logits[candidates], k - 1)[:k]]
    return top[np.argsort(-logits[top], kind="stable")]


def lead(logits: np.ndarray, token: int) -> float:
    """How far `token`'s logit is above the best other token's (negative when another leads)."""
    others = np.delete(logits, token)
    return float(logits[token] - others.max())


def lead_of_word_end(logits: np.ndarray, word_ends: np.ndarray) -> float:
    """How far the best token that ends the word is above the best that goes on with it."""
    return float(logits[word_ends].max() - logits[~word_ends].max())


def unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    if n == 0.0:
        raise ValueError("cannot normalise a zero vector")
    return v / n
