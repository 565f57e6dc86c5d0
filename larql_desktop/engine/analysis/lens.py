"""The logit lens and what a feature does, through the model's own final norm and head.

Logit lens: the residual after each layer read as if it were the last one, rms_norm(h, output_norm) @ W_out.T: the
tokens the model would predict from there, and where the token it did choose ranks (an INSERTed target's rank
across layers shows where the fact is written). Promoted tokens: an FFN feature's down vector (its override's where
a patch replaced it) through the same norm and head: the tokens that feature pushes the prediction towards
(LM-Debugger's projection of FFN sub-updates). Both run in the model's head graph when it has one (numpy else).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from larql_desktop.engine.analysis.reply_pass import ReplyPass

DEFAULT_TOP = 5


def head_logits(model, residuals: np.ndarray) -> np.ndarray:
    """(R, vocab) logits of residual rows (R, d) through the final norm and the head."""
    rows = np.ascontiguousarray(residuals, np.float32)
    transformer = model.transformer
    if transformer.graphs is not None:
        return transformer.graphs.run_head(rows, np.zeros_like(rows))   # the head adds the last FFN's output: none
    return transformer.logits(rows)


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def top_of(row: np.ndarray, n: int) -> np.ndarray:
    """The indices of the n largest values of `row`, largest first (ties: the lower index first)."""
    part = np.argpartition(-row, min(n, row.size - 1))[:n]
    return part[np.lexsort((part, -row[part]))]


@dataclass(frozen=True)
class LensLayer:
    layer: int
    top_ids: tuple[int, ...]
    top_texts: tuple[str, ...]
    top_probabilities: tuple[float, ...]
    chosen_rank: int          # 1 = the top token
    chosen_probability: float


@dataclass(frozen=True)
class LogitLens:
    position: int
    chosen_id: int
    chosen_text: str
    layers: tuple[LensLayer, ...]


def logit_lens(model, reply_pass: ReplyPass, index: int, chosen_id: int, top: int = DEFAULT_TOP) -> LogitLens:
    """The lens of the `index`-th recorded position of `reply_pass`, with `chosen_id`'s rank at every layer."""
    if not 0 <= index < len(reply_pass.positions):
        raise ValueError(f"position index {index} is out of range 0..{len(reply_pass.positions) - 1}")
    vocab = model.config.vocab_size
    if not 0 <= chosen_id < vocab:
        raise ValueError(f"token id {chosen_id} is out of range for a vocabulary of {vocab}")
    probs = softmax_rows(head_logits(model, reply_pass.residuals[:, index]))      # (n_layers, vocab)
    decode = model.tokenizer.decode
    layers = []
    for layer, p in enumerate(probs):
        ids = top_of(p, top)
        chosen = p[chosen_id]
        layers.append(LensLayer(layer, tuple(int(i) for i in ids), tuple(decode([int(i)]) for i in ids),
                                tuple(float(p[i]) for i in ids), int((p > chosen).sum()) + 1, float(chosen)))
    return LogitLens(reply_pass.positions[index], int(chosen_id), decode([int(chosen_id)]), tuple(layers))


@dataclass(frozen=True)
class PromotedTokens:
    layer: int
    feature: int
    ids: tuple[int, ...]
    texts: tuple[str, ...]
    logits: tuple[float, ...]
    patch_epoch: str          # the layer's overlay epoch the down vector came from ("clean": the base weights)


class FeatureVocabulary:
    """Each feature's promoted tokens, cached per layer and per the layer's patches (a new INSERT there makes the
    layer's entries afresh). One per engine; thread-safe."""

    def __init__(self, engine, top: int = DEFAULT_TOP):
        self.engine = engine
        self.top = top
        self._by_layer: dict[tuple[int, str], dict[int, PromotedTokens]] = {}
        self._lock = threading.Lock()

    def down_vector(self, layer: int, feature: int) -> np.ndarray:
        """(d,) the feature's down vector as the walk uses it: its override's where a patch replaced it."""
        engine = self.engine
        ovr = engine.patches.layer(layer)
        if ovr is not None:
            slot = np.flatnonzero(ovr.features == feature)
            if slot.size:
                return np.asarray(ovr.down[slot[0]], np.float32)
        return np.asarray(engine.base_weights.down_matrix(layer)[:, feature], np.float32)

    def promoted(self, layer: int, features) -> tuple[PromotedTokens, ...]:
        cfg = self.engine.model.config
        if not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer {layer} is out of range 0..{cfg.n_layers - 1}")
        features = [int(f) for f in features]
        if any(not 0 <= f < cfg.intermediate for f in features):
            raise ValueError(f"features must lie within 0..{cfg.intermediate - 1}")
        epoch = self.engine.patches.layer_epoch(layer)
        with self._lock:
            known = self._by_layer.setdefault((layer, epoch), {})
            missing = [f for f in dict.fromkeys(features) if f not in known]
        if missing:
            model = self.engine.model
            logits = head_logits(model, np.stack([self.down_vector(layer, f) for f in missing]))
            decode = model.tokenizer.decode
            made = {}
            for f, row in zip(missing, logits):
                ids = top_of(row, self.top)
                made[f] = PromotedTokens(layer, f, tuple(int(i) for i in ids), tuple(decode([int(i)]) for i in ids),
                                         tuple(float(row[i]) for i in ids), epoch)
            with self._lock:
                known.update(made)
        return tuple(known[f] for f in features)
