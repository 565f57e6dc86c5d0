"""LARQL's walk FFN through its FFN activation cache (L1 per session, L2 per process, optional persistent L3).

The key is made in keys.py, the tiers and the rule for serving a hit live in tiers.py, the counts in stats.py
and the persistent store in l3/ (codec, contract, SQLite and Redis backends); this module is the walk itself and
where it consults them.

Per layer, the gate KNN maps the normed FFN input to the top-K features by |gate score|; the cache key is a
64-bit hash of that set of feature ids (keys.py), so two residuals that select the same features share an entry. Only
single-position calls (decode) consult the cache; prefill, the full-K dense rewrite and layers carrying
INSERT overrides bypass it, each counted by reason.

A decode step runs in one call of a whole-model decoder graph where it can: the walk's stepper (stepper.py) plans
such steps and settles what they computed; this module is the walk a layer at a time, which the stepper's steps
match bit for bit.

Beyond the seed (see shared/notes/larql-reference.md for the holes in LARQL's own code):
  * entries are namespaced by model checksum, K, key width and the graphs' numerics, and only feature sets no
    INSERT override touches are looked up, so a hit never serves an output computed under another model, K,
    patch state or version of the graphs;
  * `lru` eviction and a byte budget besides the seed's `drop` policy; overwriting a key is never dropped;
  * a hit is served only when the entry was computed from (nearly) the same input (`HitRule`): the seed's
    key alone lets a request for 3x store its output where the next request for x finds it;
  * key width k' <= K and an optional cosine guard with small buckets (the key-stability question);
  * a verify mode that recomputes a fraction of hits and records the error a hit really carries;
  * an optional L3 (l3/: SQLite or Redis) consulted after L2; its hits fill L2 and L1, misses write back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from larql_desktop.engine.cache.keys import (default_top_k, feature_key, is_full_k, key_features, mask_key,
                                             select_mask, select_masks)
from larql_desktop.engine.cache.near_miss import NearMissSampler
from larql_desktop.engine.cache.stats import WalkObserver
from larql_desktop.engine.cache.l3.contract import L3Store
from larql_desktop.engine.cache.stepper import WalkStepper
from larql_desktop.engine.cache.trace import KeyTrace
from larql_desktop.engine.cache.tiers import DEFAULT_MAX_DISTANCE, CacheEntry, CacheTier, HitRule, PersistentTierView, frozen_copy
from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.model.transformer import ACTIVATIONS
from larql_desktop.engine.model.overlay import PatchOverlay, stable_dots, summed_writes

PATCH_MODES = ("bypass", "per_feature")


@dataclass(frozen=True)
class WalkSettings:
    top_k: int | None = None          # None: the seed's ratio (79% of the intermediate size)
    dense: bool = False               # plain dense FFN, no KNN, no cache
    key_width: int | None = None      # k' <= K ids in the key; None = K (the seed)
    cosine_guard: float | None = None  # tau: a hit needs cos(x, x0) >= tau (and norms within 5%): approximate
    bucket_size: int = 4              # entries per key when the guard is on
    # Without a guard, a hit needs |x - x0| <= max_distance * |x| (see DEFAULT_MAX_DISTANCE for the measurement).
    max_distance: float = DEFAULT_MAX_DISTANCE
    # The seed's pure feature-set semantics: any entry under the key is served, whatever input made it. For
    # study only: UNSAFE with untrusted clients (an HTTP client could choose what the app's chats are served),
    # so API requests never run with it.
    feature_set_hits: bool = False
    verify_fraction: float = 0.0      # share of hits recomputed to measure their error
    verify_seed: int = 0
    # "bypass": the seed's rule, layers with INSERT overrides skip L1 and L2. "per_feature": such a layer
    # still uses the cache when the selected features include no overridden one (ADR open question 3).
    patch_mode: str = "bypass"
    # Dense passes (dense settings, no INSERT overrides) may run as one call of the whole-model decoder graph,
    # and a walk's decode steps as one call of the walked decoder graph; False keeps both layer by layer (the
    # bench's like-for-like baseline for the cache, and what the tests compare the one-call steps with).
    whole_model_graph: bool = True
    # Near-miss explanation (engine/cache/near_miss.py): share of misses explained (0: off), and the guard tau
    # it judges them by when cosine_guard is None.
    near_miss_fraction: float = 0.0
    near_miss_tau: float = 0.995

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"K must be at least 1, not {self.top_k}")
        if self.key_width is not None and self.key_width < 1:
            raise ValueError(f"key width must be at least 1, not {self.key_width}")
        if self.cosine_guard is not None and not (-1.0 <= self.cosine_guard <= 1.0):
            raise ValueError(f"cosine guard must be within [-1, 1], not {self.cosine_guard}")
        if not 0.0 <= self.max_distance <= 1.0:       # NaN fails too
            raise ValueError(f"maximum input distance must be within [0, 1], not {self.max_distance}")
        if not 1 <= self.bucket_size <= 256:
            raise ValueError(f"bucket size must be between 1 and 256, not {self.bucket_size}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify fraction must be within [0, 1], not {self.verify_fraction}")
        if not 0.0 <= self.near_miss_fraction <= 1.0:
            raise ValueError(f"near-miss fraction must be within [0, 1], not {self.near_miss_fraction}")
        if not -1.0 <= self.near_miss_tau <= 1.0:
            raise ValueError(f"near-miss tau must be within [-1, 1], not {self.near_miss_tau}")
        if self.patch_mode not in PATCH_MODES:
            raise ValueError(f"patch mode must be one of {', '.join(PATCH_MODES)}, not {self.patch_mode!r}")

    def sizes(self, intermediate: int) -> tuple[int, int]:
        """(K, key width) for a model of `intermediate` features per layer, defaults filled in; ValueError if
        either does not fit."""
        k = default_top_k(intermediate) if self.top_k is None else self.top_k
        if k > intermediate:
            raise ValueError(f"K={k} exceeds the model's {intermediate} features per layer")
        width = k if self.key_width is None else self.key_width
        if width > k:
            raise ValueError(f"key width {width} exceeds K={k}")
        return k, width

    def resolved(self, intermediate: int) -> "WalkSettings":
        k, width = self.sizes(intermediate)
        return replace(self, top_k=k, key_width=width)

    @property
    def hit_rule(self) -> HitRule:
        if self.cosine_guard is not None:
            return HitRule("cosine", tau=self.cosine_guard)
        if self.feature_set_hits:
            return HitRule("feature_set")
        return HitRule("near", max_distance=self.max_distance)


class FfnGraphs(Protocol):
    config: ModelConfig   # its activation name is used for overridden features
    numerics: str    # names how the graphs compute (export format): part of every cache key's namespace

    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray) -> np.ndarray: ...
    def dense(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def walk_top_k(self, layer: int, x: np.ndarray, k: int) -> np.ndarray: ...


class WalkFfn:
    """The FfnCall of one session: sparse walk over the top-K features, through L1 then L2 (then L3).

    INSERT overrides (a PatchOverlay) are applied on top of the base graphs: overridden features get patched
    gate scores before selection, are masked out of the base walk and added back from their override vectors.
    Its `stepper` (stepper.py) is what the model asks about running whole passes in one graph call.
    """

    def __init__(self, graphs: FfnGraphs, settings: WalkSettings, *, model_checksum: str,
                 l1: CacheTier | None = None, l2: CacheTier | None = None, l3: L3Store | None = None,
                 observers: tuple[WalkObserver, ...] = (), patches: PatchOverlay | None = None,
                 trace: KeyTrace | None = None, key_log: list | None = None):
        """`graphs`: the model's FFN graphs (their config sizes the walk); `model_checksum` names the model in every
        cache key; the tiers looked up in order (None or disabled: skipped); `observers` are told each call's
        outcome (statistics, recorders); `patches` the INSERT overlay (None: none); `trace` the engine's key
        trace, which lets whole decode steps of hits be planned (None: never); `key_log`, when a list, gets
        (layer, key) of every cache lookup, for offline analysis."""
        self.graphs = graphs
        intermediate = graphs.config.intermediate
        self.n_layers = graphs.config.n_layers
        self.l3 = l3             # an l3.L3Store (persistent tier after L2) or None
        self._l3_tier = PersistentTierView(l3, self.n_layers) if l3 is not None else None
        # Outcome of the latest call ("hit", "miss", "bypass", "dense"), the tier that hit and the bypass reason:
        # for callers that report per call (the HTTP API builds one WalkFfn per request).
        self.last_outcome: str | None = None
        self.last_tier: str | None = None
        self.last_bypass: str | None = None
        self.key_log = key_log
        self.intermediate = intermediate
        self.settings = settings.resolved(intermediate)
        self.top_k, self.key_width = settings.sizes(intermediate)   # the same as settings' own, typed int
        self.hit_rule = self.settings.hit_rule
        self.model_checksum = model_checksum
        self.l1, self.l2 = l1, l2
        self.observers = observers   # the observers each call's outcome is reported to (statistics, recorders)
        self.patches = patches if patches is not None else PatchOverlay()
        self.full_k = is_full_k(self.settings.top_k, intermediate)
        self.activation = ACTIVATIONS[graphs.config.activation]
        self._rng = np.random.default_rng(self.settings.verify_seed)
        s = self.settings
        self.near_miss = None if not s.near_miss_fraction else NearMissSampler(
            s.near_miss_fraction, s.cosine_guard if s.cosine_guard is not None else s.near_miss_tau,
            intermediate, s.top_k, seed=s.verify_seed)
        self.stepper = WalkStepper(self, trace)

    def add_observer(self, observer: WalkObserver) -> None:
        """Report every later call's outcome to `observer` too (once, however often it is added)."""
        if observer not in self.observers:
            self.observers = self.observers + (observer,)

    def namespace(self) -> tuple:
        """What an entry's output depends on besides the feature key: the model, K, key width and the graphs'
        numerics (a persistent L3 entry computed by older or corrupt graphs is never served to the repaired ones).
        No patch state: a feature set that an INSERT override touches never reaches a lookup (the layer bypasses,
        or in per-feature mode that one call does), so every cached output is a function of the base weights."""
        s = self.settings
        return (self.model_checksum, s.top_k, s.key_width, self.graphs.numerics)

    def record_outcome(self, layer, outcome, started, **kw):
        """Report one layer's outcome (timed from `started`, None: untimed) to every observer."""
        seconds = None if started is None else time.perf_counter() - started
        self.last_outcome, self.last_bypass = outcome, kw.get("bypass")
        results = kw.get("tier_results", ())
        self.last_tier = results[-1][0] if outcome == "hit" and results else None
        for observer in self.observers:
            observer.record(layer, outcome, seconds, **kw)

    def record_untimed(self, records: list, tier: str | None = None, bypass: str | None = None) -> None:
        """Report the outcomes of layers one graph call ran, (layer, outcome, tier results, bypass reason) each,
        untimed; the last one's outcome, with the `tier` that hit or the `bypass` reason, is the latest call's."""
        for observer in self.observers:
            observer.record_untimed(records)
        self.last_outcome, self.last_bypass, self.last_tier = records[-1][1], bypass, tier

    def selection_mask(self, scores: np.ndarray) -> np.ndarray:
        """(T, F) 0/1 float mask of the top-K features per position: what the walk graph sums over."""
        k = self.settings.top_k
        return select_masks(scores, k).astype(np.float32)

    def mask_for(self, scores: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(T, F) 0/1 mask of the top-K features per position, and each position's selection (ascending ids)."""
        mask = self.selection_mask(scores)
        return mask, [np.flatnonzero(row) for row in mask]

    def overrides_at(self, layer: int, x: np.ndarray):
        """The INSERT overrides of `layer` as they stand for inputs `x`: (overrides or None, their gate scores
        under the overlay (T, n), where each override holds its slot (T, n) bool); what the feature view shows."""
        return self._patched(layer, x)

    def _patched(self, layer: int, x: np.ndarray):
        """(overrides or None, their gate scores under the overlay (T, n), where each override holds its slot)."""
        ovr = self.patches.layer(layer)
        if ovr is None:
            return None, None, None
        patched = ovr.scores(x)
        # An inserted (gated) feature takes over its slot only where it fires and its fact wins (LayerOverrides.
        # holding); elsewhere the slot keeps its base feature. Plain overrides replace their feature everywhere.
        return ovr, patched, ovr.holding(patched)

    def gate_knn(self, layer: int, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per position, the features the walk actually sums (the selected base features, with overridden
        slots replaced where their override holds) strongest first, and the gate scores it uses for them."""
        scores = self.graphs.gate_scores(layer, x)
        mask = self.selection_mask(scores)
        ovr, patched, holds = self._patched(layer, x)
        if ovr is not None:
            scores[:, ovr.features] = np.where(holds, patched, scores[:, ovr.features])
            mask[:, ovr.features] = np.maximum(mask[:, ovr.features], holds)
        result = []
        for t in range(x.shape[0]):
            ids = np.flatnonzero(mask[t])
            ids = ids[np.argsort(-np.abs(scores[t, ids]), kind="stable")]
            result.append((ids, scores[t, ids]))
        return result

    def _walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray, patched=None) -> np.ndarray:
        """Base walk over `mask`, with each overridden slot computed from its override where that holds."""
        ovr, patched_scores, holds = patched if patched is not None else self._patched(layer, x)
        if ovr is None or not holds.any():
            return self.graphs.walk(layer, x, scores, mask)
        base_mask = mask.copy()
        base_mask[:, ovr.features] *= ~holds
        out = self.graphs.walk(layer, x, scores, base_mask)
        act = self.activation(patched_scores) * stable_dots(x, ovr.up) * holds        # (T, n)
        return out + summed_writes(act, ovr.down)                                    # (T, d)

    def dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The dense FFN under the current overlay."""
        if self.patches.layer(layer) is None:
            return self.graphs.dense(layer, x)
        ones = np.ones((x.shape[0], self.intermediate), np.float32)
        return self._walk(layer, x, self.graphs.gate_scores(layer, x), ones)

    def lookup_tiers(self) -> list:
        """The enabled tiers, in lookup order (L1, L2, then L3)."""
        tiers = [t for t in (self.l1, self.l2) if t is not None and t.settings.enabled]
        if self._l3_tier is not None and self._l3_tier.enabled:
            tiers.append(self._l3_tier)
        return tiers

    def selects_in_graph(self) -> bool:
        """Every tier off and no INSERT override anywhere: nothing needs the scores or the selection in Python,
        so each layer runs as one call of the top-K walk graph (selection and mask inside it)."""
        return not self.patches.overridden_layers and not self.lookup_tiers()

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.call_with_scores(layer, x, None)

    def call_with_scores(self, layer: int, x: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
        """The FFN at `layer` for x; `scores`: x @ W_gate.T of the base weights when the caller has them."""
        started = time.perf_counter()
        s = self.settings
        if s.dense or self.full_k:
            out = self.dense(layer, x)
            self.record_outcome(layer, "dense", started, bypass=None if s.dense else "full_k")
            return out
        tiers = self.lookup_tiers()
        if scores is None and not tiers and self.patches.layer(layer) is None:
            out = self.graphs.walk_top_k(layer, x, s.top_k)     # the same features and output as below
            self.record_outcome(layer, "bypass", started, bypass="prefill" if x.shape[0] != 1 else "cache_off")
            return out
        # Gate KNN: the base features compete exactly as in the base model (an overridden slot keeps its base
        # score in the ranking), so a patch never reshuffles which base features are selected.
        if scores is None:
            scores = self.graphs.gate_scores(layer, x)
        patched = self._patched(layer, x)
        ovr, _, holds = patched
        touched = ovr is not None and bool(holds.any())
        if x.shape[0] != 1:
            bypass = "prefill"
            if self.l3 is not None:
                self.l3.engine_busy()     # a prefill puts nothing: the L3's writer would take it for a quiet moment
        elif ovr is not None and (s.patch_mode == "bypass" or touched):
            bypass = "patched"
        else:
            bypass = None if tiers else "cache_off"
        if bypass is not None:
            out = self._walk(layer, x, scores, self.selection_mask(scores), patched)
            self.record_outcome(layer, "bypass", started, bypass=bypass)
            self.stepper.after_bypass(layer, bypass, scores)
            return out
        # Only untouched feature sets reach here: their output depends on the base weights alone.
        key, selected = self.key_of(scores[0])
        if self.key_log is not None:
            self.key_log.append((layer, key))
        self.stepper.link(layer, key, selected)
        x0 = x[0]
        rule = self.hit_rule
        bucket = s.bucket_size if s.cosine_guard is not None else 1
        results = []
        for i, tier in enumerate(tiers):
            entry = tier.lookup(layer, key, x0, rule)
            results.append((tier.name, entry is not None))
            if entry is not None:
                for upper in tiers[:i]:           # a hit fills the tiers above it
                    upper.store(layer, key, entry, bucket)
                self.record_outcome(layer, "hit", started, tier_results=tuple(results))
                if s.verify_fraction and self._rng.random() < s.verify_fraction:
                    self._verify(layer, x, scores, selected[None].astype(np.float32), entry)   # not timed
                return entry.output[None, :].copy()
        out = self._walk(layer, x, scores, selected[None].astype(np.float32), patched)
        # An overflowed output (an absurd input, a broken graph) is returned as computed but never stored: a
        # cache holds only what a later hit may serve.
        entry = None
        if np.isfinite(out).all():
            bits = None if self.near_miss is None else self.near_miss.bits(np.flatnonzero(selected))
            entry = CacheEntry(frozen_copy(out[0]), frozen_copy(x0), bits)
            for tier in tiers:
                tier.store(layer, key, entry, bucket)
        self.record_outcome(layer, "miss", started, tier_results=tuple(results))
        if self.near_miss is not None and entry is not None:
            self.near_miss.after_miss(layer, started, x0, out[0], entry, tiers, key[0], self.observers)
        return out

    def key_of(self, scores: np.ndarray) -> tuple[tuple, np.ndarray]:
        """The cache key of one position's base gate scores (F,), and its selection mask: packed from the mask
        itself (no ids) unless the key is built from fewer features than K."""
        s = self.settings
        selected = select_mask(scores, s.top_k)
        if s.key_width >= s.top_k:
            return (self.namespace(), mask_key(selected)), selected
        return (self.namespace(), feature_key(key_features(scores, np.flatnonzero(selected), s.key_width))), selected

    def _verify(self, layer, x, scores, mask, entry: CacheEntry) -> None:
        """Fidelity: the hit against a fresh computation at this input. Staleness: the entry against a fresh
        computation at the input it was made from, under the current weights and patches (must be exact)."""
        cached = entry.output
        fresh = self._walk(layer, x, scores, mask)[0]
        denom = float(np.linalg.norm(fresh) * np.linalg.norm(cached))
        cosine = float(fresh @ cached) / denom if denom else 1.0
        max_abs = float(np.max(np.abs(fresh - cached)))
        x0 = entry.residual[None, :]
        scores0 = self.graphs.gate_scores(layer, x0)
        remade = self._walk(layer, x0, scores0, self.selection_mask(scores0))[0]
        stale = float(np.max(np.abs(remade - cached)))
        for observer in self.observers:
            observer.record_fidelity(cosine, max_abs, stale)
