"""A reply's forward pass recomputed for its pictures: per layer and per token of the reply, the residual after the
layer (for the logit lens), and where an INSERTed feature fired; plus the codes the reply x layer picture draws.

The pass runs the reply's token history once through a walk FFN with the engine's settings and patches but no
cache tiers and no statistics (as engine/cache/features.py does), so asking never moves the monitor or fills a
cache. Where the chat was served a cache hit, the hit rule allowed its answer to differ from this exact computation
by the rule's tolerance; the outcomes (hit, miss, bypass) are the ones the engine recorded while it generated.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Sequence

import numpy as np

from larql_desktop.engine.cache.walk import WalkFfn
from larql_desktop.engine.formats.quants import dequantize
from larql_desktop.engine.model.outcomes import LayerOutcome
from larql_desktop.engine.model.transformer import KvCache, rms_norm


class Cell(IntEnum):
    """What the FFN did for one token at one layer, as the reply x layer picture colours it."""
    L1_HIT = 0
    L2_HIT = 1
    L3_HIT = 2
    MISS = 3
    BYPASS_PREFILL = 4
    BYPASS_PATCHED = 5
    BYPASS_CACHE_OFF = 6
    BYPASS_FULL_K = 7
    DENSE = 8
    INSERT_FIRED = 9
    UNKNOWN = 10          # no outcome recorded (a reply restored from disk without its details)


CELL_LABELS = {Cell.L1_HIT: "L1 hit", Cell.L2_HIT: "L2 hit", Cell.L3_HIT: "L3 hit", Cell.MISS: "miss",
               Cell.BYPASS_PREFILL: "bypass (prefill)", Cell.BYPASS_PATCHED: "bypass (patched)",
               Cell.BYPASS_CACHE_OFF: "bypass (cache off)", Cell.BYPASS_FULL_K: "bypass (full K)",
               Cell.DENSE: "dense", Cell.INSERT_FIRED: "INSERT fired", Cell.UNKNOWN: "not recorded"}
_HITS = {"L1": Cell.L1_HIT, "L2": Cell.L2_HIT, "L3": Cell.L3_HIT}
_BYPASSES = {"prefill": Cell.BYPASS_PREFILL, "patched": Cell.BYPASS_PATCHED, "cache_off": Cell.BYPASS_CACHE_OFF,
             "full_k": Cell.BYPASS_FULL_K}


def cell_of(outcome: LayerOutcome) -> Cell:
    if outcome.outcome == "hit":
        return _HITS.get(outcome.tier or "", Cell.UNKNOWN)
    if outcome.outcome == "miss":
        return Cell.MISS
    if outcome.outcome == "bypass":
        return _BYPASSES.get(outcome.bypass or "", Cell.UNKNOWN)
    if outcome.outcome == "dense":
        return Cell.DENSE
    return Cell.UNKNOWN


def outcome_grid(layers_per_token: Sequence[Sequence[LayerOutcome]], n_layers: int,
                 fired: np.ndarray | None = None) -> np.ndarray:
    """(n_layers, T) Cell codes: column t the outcomes recorded for token t (its layers), INSERT_FIRED where
    `fired` (n_layers, T) says an inserted feature fired."""
    grid = np.full((n_layers, len(layers_per_token)), int(Cell.UNKNOWN), np.int16)
    for t, layers in enumerate(layers_per_token):
        for o in layers:
            if 0 <= o.layer < n_layers:
                grid[o.layer, t] = cell_of(o)
    if fired is not None:
        grid[np.asarray(fired, bool)] = int(Cell.INSERT_FIRED)
    return grid


@dataclass(frozen=True)
class ReplyPass:
    """The recomputed pass at the positions asked for (each the last position of the pass a token was sampled
    from)."""
    positions: tuple[int, ...]
    residuals: np.ndarray      # (n_layers, P, d) the residual after each layer (its attention and FFN)
    fired: np.ndarray          # (n_layers, P) bool: an inserted (gated) feature took its slot there
    fired_features: tuple      # per layer, per position: the inserted features that fired (tuple of ints)

    def __post_init__(self):
        for a in (self.residuals, self.fired):
            a.flags.writeable = False


def uncached_walk(engine) -> WalkFfn:
    """A walk with the engine's FFN settings and patches, no cache tiers, no statistics, no sampling of checks."""
    model = engine.model
    settings = replace(engine.walk_settings, near_miss_fraction=0.0, verify_fraction=0.0)
    return WalkFfn(model.ffn, settings, model_checksum=model.checksum, patches=engine.patches)


def _post_ffn_norms(model) -> list[np.ndarray | None]:
    tensors = model.gguf.tensors
    return [dequantize(tensors[name]) if (name := f"blk.{i}.post_ffw_norm.weight") in tensors else None
            for i in range(model.config.n_layers)]


def run_reply_pass(engine, ids: Sequence[int], positions: Sequence[int]) -> ReplyPass:
    """Run `ids` once and record, at each of `positions`, every layer's residual and the INSERTed features that
    fired. ValueError for a bad request."""
    model = engine.model
    cfg = model.config
    ids = [int(i) for i in ids]
    positions = tuple(int(p) for p in positions)
    if not ids:
        raise ValueError("the reply pass needs at least one token")
    if len(ids) > model.context_limit:
        raise ValueError(f"{len(ids)} tokens exceed the context of {model.context_limit}")
    if any(not 0 <= p < len(ids) for p in positions):
        raise ValueError(f"positions must lie within the {len(ids)} tokens")
    walk = uncached_walk(engine)
    overlay = engine.patches
    at = np.asarray(positions, np.int64)
    n, d = cfg.n_layers, cfg.hidden
    after_attention = np.zeros((n, len(at), d), np.float32)
    ffn_out = np.zeros((n, len(at), d), np.float32)
    fired = np.zeros((n, len(at)), bool)
    fired_features: list[list[tuple[int, ...]]] = [[() for _ in at] for _ in range(n)]

    def record(layer: int, h: np.ndarray, x: np.ndarray) -> None:
        after_attention[layer] = h[at]

    def ffn(layer: int, x: np.ndarray) -> np.ndarray:
        out = walk(layer, x)
        ffn_out[layer] = out[at]
        ovr = overlay.layer(layer)
        if ovr is not None and ovr.gated.any():
            # Where an inserted feature takes its slot (the walk's rule, LayerOverrides.holding).
            holds = ovr.inserted_holding(x[at])        # (P, n_overrides)
            fired[layer] = holds.any(axis=1)
            for p in np.flatnonzero(fired[layer]):
                fired_features[layer][p] = tuple(int(f) for f in ovr.features[holds[p]])
        return out

    model.transformer.forward(ids, KvCache(cfg), ffn, record=record)
    residuals = after_attention
    for layer, norm in enumerate(_post_ffn_norms(model)):
        f = ffn_out[layer] if norm is None else rms_norm(ffn_out[layer], norm, cfg.norm_eps)
        residuals[layer] = residuals[layer] + f
    return ReplyPass(positions, residuals, fired, tuple(tuple(row) for row in fired_features))
