"""The feature view: for one position of a token sequence and one layer, the strongest FFN features by gate
score, which of them formed the cache key, and which INSERT overrides fired there.

The normed FFN input is recomputed by one forward pass of the sequence through a walk FFN with the engine's
settings and patches but no cache tiers and no statistics (so asking never moves the monitor or fills a cache);
a hit the chat was served may have differed from this exact computation by the hit rule's tolerance. The
features come from the engine's walk (`WalkFfn.gate_knn`: the selected base features, with an override holding
its slot where it fires); the key from `keys.select_features` / `keys.key_features` over the *base* scores, as
the walk makes it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from larql_desktop.engine.cache.keys import feature_key, key_features, select_features
from larql_desktop.engine.cache.walk import WalkFfn
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache

DEFAULT_TOP_N = 20


@dataclass(frozen=True)
class FeatureRow:
    feature: int
    score: float              # the signed gate score the walk uses (an override's own where it fires)
    in_key: bool              # among the k' features the cache key hashes
    patch_id: str | None      # the INSERT patch whose override fired in this slot, else None

    @property
    def fired_override(self) -> bool:
        return self.patch_id is not None


@dataclass(frozen=True)
class FeatureView:
    layer: int
    position: int             # index into the sequence (its last token)
    token_id: int             # the token at that position
    top_k: int                # K
    key_width: int            # k'
    key_hash: int             # feature_key of the key features (64-bit)
    rows: tuple[FeatureRow, ...]        # the strongest top_n by |score|, strongest first
    fired: tuple[FeatureRow, ...]       # every override that fired at this layer and position, ranked or not
    layer_patched: bool       # the layer carries overrides: the walk bypasses the cache there (no lookup)


def _patch_owning(patches, layer: int, feature: int) -> str | None:
    """The id of the last applied patch that writes (layer, feature): its vectors are the ones in effect."""
    owner = None
    for patch in patches:
        for op in patch.operations:
            if op.layer == layer and op.feature == feature:
                owner = patch.id if op.op != "delete" else None
    return owner


def normed_ffn_input(engine: LarqlEngine, ids: list[int], layer: int) -> np.ndarray:
    """(d,) the normed FFN input at the last of `ids` and `layer`, from one pass with the engine's FFN settings
    and patches and no cache."""
    model = engine.model
    settings = replace(engine.walk_settings, near_miss_fraction=0.0, verify_fraction=0.0)
    walk = WalkFfn(model.ffn, settings, model_checksum=model.checksum, patches=engine.patches)
    captured: list[np.ndarray] = []

    def recording(at: int, x: np.ndarray) -> np.ndarray:
        if at == layer:
            captured.append(np.array(x[-1], dtype=np.float32, copy=True))
        return walk(at, x)

    model.transformer.forward(ids, KvCache(model.config), recording)
    return captured[0]


def feature_view(engine: LarqlEngine, ids, layer: int, top_n: int = DEFAULT_TOP_N) -> FeatureView:
    """The feature view of the last position of `ids` (e.g. prompt ids + the generated ids before a sampled
    token: the pass that token was sampled from) at `layer`. ValueError for a bad request."""
    model = engine.model
    cfg = model.config
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("the feature view needs at least one token")
    if len(ids) > model.context_limit:
        raise ValueError(f"{len(ids)} tokens exceed the context of {model.context_limit}")
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} is out of range 0..{cfg.n_layers - 1}")
    if top_n < 1:
        raise ValueError(f"the feature view shows at least one feature, not {top_n}")
    x = normed_ffn_input(engine, ids, layer)[None, :]
    walk = engine.request_walk()          # the engine's K and key width, its patches; gate_knn touches no cache
    (walked, walked_scores), = walk.gate_knn(layer, x)
    base = model.ffn.gate_scores(layer, x)[0]
    key = key_features(base, select_features(base, walk.top_k), walk.key_width)
    key_set = set(key.tolist())
    ovr, patched, holds = walk.overrides_at(layer, x)
    owners: dict[int, str | None] = {}
    fired = []
    if ovr is not None:
        for j, feature in enumerate(ovr.features.tolist()):
            if holds[0, j]:        # an inserted feature that fires here, or a plain override (holds everywhere)
                owners[feature] = _patch_owning(engine.applied_patches, layer, feature)
                fired.append(FeatureRow(feature, float(patched[0, j]), feature in key_set, owners[feature]))

    rows = tuple(FeatureRow(int(f), float(v), int(f) in key_set, owners.get(int(f)))
                 for f, v in zip(walked[:top_n], walked_scores[:top_n]))
    fired.sort(key=lambda r: -abs(r.score))
    return FeatureView(layer, len(ids) - 1, ids[-1], walk.top_k, walk.key_width, feature_key(key), rows, tuple(fired),
                       ovr is not None)
