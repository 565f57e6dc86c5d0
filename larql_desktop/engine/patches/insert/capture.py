"""Running the model for INSERT: greedy continuations, and captures (per layer the normed FFN input and the
residual after attention, with the KV cache) that are resumed from a changed layer or extended by more tokens
instead of re-run whole; the negatives' captures, under the base weights, are remembered between inserts. And
the cancel check every step of an insert makes."""
from __future__ import annotations

import threading
from itertools import islice, takewhile
from typing import Callable, NamedTuple, Sequence

import numpy as np

from larql_desktop.engine.cache.walk import WalkFfn
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.model.generation import greedy
from larql_desktop.engine.model.overlay import PatchOverlay
from larql_desktop.engine.model.transformer import KvCache

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


def softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max()
    p = np.exp(z)
    return p / p.sum()


class Capturing:
    """Forward passes under an overlay (the FFN from `ffn`, which the Inserter builds)."""
    model: LoadedModel
    ffn: Callable[[PatchOverlay], WalkFfn]
    _captured: dict[tuple, "Captured"]
    _continued: dict[str, str]

    def encode(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text)

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
