"""LARQL's walk FFN and its FFN activation cache (L1 per session, L2 per process, optional persistent L3).

Per layer, the gate KNN maps the normed FFN input to the top-K features by |gate score|; the cache key is a
64-bit hash of the sorted feature ids, so two residuals that select the same features share an entry. Only
single-position calls (decode) consult the cache; prefill, the full-K dense rewrite and layers carrying
INSERT overrides bypass it, each counted by reason.

Beyond the seed (see shared/notes/larql-reference.md for the holes in LARQL's own code):
  * entries are namespaced by model checksum, K, key width, patch epoch and the graphs' numerics, so a hit
    never serves an output computed under another model, K, patch state or version of the graphs;
  * `lru` eviction and a byte budget besides the seed's `drop` policy; overwriting a key is never dropped;
  * a hit is served only when the entry was computed from (nearly) the same input (`HitRule`): the seed's
    key alone lets a request for 3x store its output where the next request for x finds it;
  * key width k' <= K and an optional cosine guard with small buckets (the key-stability question);
  * a verify mode that recomputes a fraction of hits and records the error a hit really carries;
  * an optional L3 (engine/l3.py: SQLite or Redis) consulted after L2; its hits fill L2 and L1, misses write back.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from larql_desktop.engine.cache.near_miss import NearMissCounts, NearMissSampler, NearMissSnapshot
from larql_desktop.engine.model.transformer import ACTIVATIONS
from larql_desktop.engine.patches.overlay import CLEAN_EPOCH, PatchOverlay

SEED_K_RATIO = 8092 / 10240          # the seed's default K on Gemma 3 4B
FULL_K_NUM, FULL_K_DEN = 4, 5        # K >= 4/5 of the intermediate size -> dense FFN (no KNN, no cache)
POLICIES = ("drop", "lru")
BYPASS_REASONS = ("prefill", "full_k", "patched", "cache_off")
OUTCOMES = ("hit", "miss", "bypass", "dense")
TIERS = ("L1", "L2", "L3")
PATCH_MODES = ("bypass", "per_feature")


def default_top_k(intermediate: int) -> int:
    return int(intermediate * SEED_K_RATIO)


def is_full_k(top_k: int, intermediate: int) -> bool:
    return top_k * FULL_K_DEN >= intermediate * FULL_K_NUM


def feature_key(feature_ids: np.ndarray) -> int:
    """64-bit key of a feature set: order-independent (ids are sorted) and stable across processes."""
    ids = np.sort(np.asarray(feature_ids, dtype=np.int64)).astype("<i4")
    return int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little")


def select_features(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top-k features by |score| for one position (in no particular order)."""
    if k >= scores.size:
        return np.arange(scores.size)
    return np.argpartition(-np.abs(scores), k - 1)[:k]


def key_features(scores: np.ndarray, selected: np.ndarray, width: int) -> np.ndarray:
    """The `width` strongest of the selected features: what the cache key is built from."""
    if width >= selected.size:
        return selected
    return selected[np.argpartition(-np.abs(scores[selected]), width - 1)[:width]]


# ----------------------------------------------------------------------------------------------- tiers
@dataclass(frozen=True)
class TierSettings:
    enabled: bool = True
    capacity: int = 4096             # keys per layer
    policy: str = "drop"             # the seed drops new entries when full; "lru" evicts the least recent
    byte_budget: int | None = None   # optional cap on the tier's total bytes

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if not 1 <= self.capacity <= 10_000_000:
            raise ValueError(f"capacity must be between 1 and 10000000 entries per layer, not {self.capacity}")
        if self.byte_budget is not None and self.byte_budget < 1:
            raise ValueError(f"byte budget must be positive, not {self.byte_budget}")


@dataclass(frozen=True)
class CacheEntry:
    output: np.ndarray      # (d,) raw FFN output, read-only
    residual: np.ndarray    # (d,) the normed FFN input it was computed from, read-only
    features: np.ndarray | None = None   # packed bitset of the selected features (near-miss explanation on)

    @property
    def nbytes(self) -> int:
        return self.output.nbytes + self.residual.nbytes + (0 if self.features is None else self.features.nbytes)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.float32, copy=True)
    a.flags.writeable = False
    return a


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b) / (float(np.linalg.norm(a)) * float(np.linalg.norm(b)) + 1e-30)


# The default bound on |x - x0| / |x| for serving an entry stored for x0 to the input x. Measured (tests in
# tests/test_integrity.py, on the real FFN inputs of three prompts at every layer): every exact-repeat hit so far
# (regenerate, the restart from an fp32 L3, the Qt panels' repeats) is at distance 0.0 exactly, as the same
# tokens give bit-identical residuals; an fp16 L3 stores x0 rounded to half precision, at up to 3.7e-4 (SmolLM2)
# and 3.6e-4 (Gemma 3), and its hits must still hit. A residual scaled by 3 is at 0.67, by 1e20 at 1.0, and the
# closest distinct residuals sharing a feature key (key width 1: 1,638 and 1,488 such pairs) are at 9.8e-3
# (SmolLM2) and 8.6e-2 (Gemma 3). So 1e-3 keeps every exact and half-precision repeat (2.7x margin), refuses
# every scaled or foreign input (10x margin or more), and what a hit may differ from a fresh computation is of
# the size of fp16 storage rounding.
DEFAULT_MAX_DISTANCE = 1e-3
# The cosine guard is an angle test: alone it accepts 3x or 1e20x the input. The guard also needs the norms
# within 5% of each other (an FFN output grows about with the square of its input's scale, so ~10% at most).
GUARD_NORM_TOLERANCE = 0.05


@dataclass(frozen=True)
class HitRule:
    """When an entry stored for the input x0 may serve the input x (both (d,) float32).

    Default (`near`): |x - x0| <= max_distance * |x|. `cosine`: the user's approximate option, cos(x, x0) >= tau
    with the norms within GUARD_NORM_TOLERANCE. `feature_set`: the seed's semantics, any entry under the key
    (for study only: unsafe with untrusted clients, who can then choose what others are served).
    A non-finite x or x0 never passes `near` or `cosine`."""
    mode: str = "near"
    max_distance: float = DEFAULT_MAX_DISTANCE
    tau: float | None = None

    def closeness(self, x: np.ndarray, x0: np.ndarray) -> float | None:
        """None when x0's entry may not serve x; else a score, higher for a closer x0 (picks within a bucket)."""
        if self.mode == "feature_set":
            return 0.0
        if self.mode == "cosine":
            nx, n0 = float(np.linalg.norm(x)), float(np.linalg.norm(x0))
            if not (n0 > 0.0 and abs(nx / n0 - 1.0) <= GUARD_NORM_TOLERANCE):
                return None
            cos = float(x @ x0) / (nx * n0)
            return cos if cos >= self.tau else None
        diff = x - x0
        distance_sq, norm_sq = float(diff @ diff), float(x @ x)
        # Compared squared: no square root on the hit path. NaN compares False, and a norm beyond float32
        # (inf <= inf would pass) is refused, so a non-finite or overflowing input misses.
        if distance_sq <= self.max_distance * self.max_distance * norm_sq and norm_sq < math.inf:
            return -distance_sq
        return None


class CacheTier:
    """One cache tier: per-layer maps from (namespace, feature key) to a small bucket of entries.

    Thread-safe: the L2 tier is shared by every session and thread of the process.
    """

    def __init__(self, name: str, n_layers: int, settings: TierSettings = TierSettings()):
        self.name = name
        self.n_layers = n_layers
        self.settings = settings
        self._lock = threading.Lock()
        self._layers: list[OrderedDict] = [OrderedDict() for _ in range(n_layers)]
        self._bytes = np.zeros(n_layers, np.int64)
        self._entries = np.zeros(n_layers, np.int64)
        self._evictions = np.zeros(n_layers, np.int64)
        self._dropped = np.zeros(n_layers, np.int64)

    def configure(self, settings: TierSettings) -> None:
        with self._lock:
            self.settings = settings
            for layer in range(self.n_layers):
                self._shrink(layer, settings.capacity)

    def clear(self) -> None:
        with self._lock:
            for layer in range(self.n_layers):
                self._layers[layer].clear()
            self._bytes[:] = 0
            self._entries[:] = 0

    def _valid_layer(self, layer: int) -> bool:
        return 0 <= layer < self.n_layers

    def lookup(self, layer: int, key, x: np.ndarray | None, rule: HitRule | None) -> CacheEntry | None:
        """The bucket's entry under `key` that `rule` lets serve x, the closest if several do; rule None: the
        newest entry under the key, whatever its input (for callers that check the input themselves)."""
        if not self._valid_layer(layer):
            return None
        with self._lock:
            bucket = self._layers[layer].get(key)
            if bucket is None:
                return None
            if rule is None:
                best = bucket[-1]
            else:
                best, best_score = None, None
                for entry in reversed(bucket):        # newest first: ties go to the newest
                    score = rule.closeness(x, entry.residual)
                    if score is not None and (best_score is None or score > best_score):
                        best, best_score = entry, score
            if best is not None and self.settings.policy == "lru":
                self._layers[layer].move_to_end(key)
            return best

    def store(self, layer: int, key, entry: CacheEntry, bucket_size: int = 1) -> bool:
        """Insert; returns False when the tier dropped it (full under the drop policy)."""
        if not self._valid_layer(layer):
            return False
        s = self.settings
        with self._lock:
            entries = self._layers[layer]
            bucket = entries.get(key)
            if bucket is None:
                if len(entries) >= s.capacity:
                    if s.policy == "drop":
                        self._dropped[layer] += 1
                        return False
                    self._evict_oldest(layer)
                bucket = entries[key] = []
            elif s.policy == "lru":
                entries.move_to_end(key)
            # An existing key is always updated (never dropped); buckets keep the newest entries.
            bucket.append(entry)
            self._bytes[layer] += entry.nbytes
            self._entries[layer] += 1
            while len(bucket) > max(1, bucket_size):
                old = bucket.pop(0)
                self._bytes[layer] -= old.nbytes
                self._entries[layer] -= 1
            if s.byte_budget is not None:
                self._enforce_budget(layer, key)
            return key in entries

    def _evict_oldest(self, layer: int) -> None:
        _, bucket = self._layers[layer].popitem(last=False)
        self._bytes[layer] -= sum(e.nbytes for e in bucket)
        self._entries[layer] -= len(bucket)
        self._evictions[layer] += 1

    def _shrink(self, layer: int, capacity: int) -> None:
        while len(self._layers[layer]) > capacity:
            self._evict_oldest(layer)

    def _enforce_budget(self, layer: int, newest_key) -> None:
        budget = self.settings.byte_budget
        while int(self._bytes.sum()) > budget:
            if self.settings.policy == "drop":
                # Under drop, the newest entry is the one that does not fit.
                bucket = self._layers[layer][newest_key]
                old = bucket.pop()
                self._bytes[layer] -= old.nbytes
                self._entries[layer] -= 1
                if not bucket:
                    del self._layers[layer][newest_key]
                self._dropped[layer] += 1
                return
            victim_layer = layer if len(self._layers[layer]) > 1 else int(np.argmax(self._bytes))
            self._evict_oldest(victim_layer)

    def invalidate(self, layer: int, predicate) -> int:
        """Remove entries of `layer` whose key satisfies predicate(key); returns how many keys went."""
        if not self._valid_layer(layer):
            return 0
        with self._lock:
            doomed = [k for k in self._layers[layer] if predicate(k)]
            for k in doomed:
                bucket = self._layers[layer].pop(k)
                self._bytes[layer] -= sum(e.nbytes for e in bucket)
                self._entries[layer] -= len(bucket)
            return len(doomed)

    def entries_of(self, layer: int, namespace) -> list[CacheEntry]:
        """Every entry of `layer` under `namespace` (near-miss explanation: the candidates a miss is compared with)."""
        if not self._valid_layer(layer):
            return []
        with self._lock:
            return [e for key, bucket in self._layers[layer].items() if key[0] == namespace for e in bucket]

    def occupancy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, entries, bytes, evictions, dropped) per layer, copied."""
        with self._lock:
            keys = np.array([len(d) for d in self._layers], np.int64)
            return keys, self._entries.copy(), self._bytes.copy(), self._evictions.copy(), self._dropped.copy()


# ----------------------------------------------------------------------------------------------- stats
@dataclass(frozen=True)
class TierSnapshot:
    name: str
    enabled: bool
    hits: np.ndarray        # per layer
    misses: np.ndarray
    keys: np.ndarray
    entries: np.ndarray
    bytes: np.ndarray
    evictions: np.ndarray
    dropped: np.ndarray

    @property
    def hit_rate(self) -> float:
        total = int(self.hits.sum() + self.misses.sum())
        return float(self.hits.sum()) / total if total else 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "enabled": self.enabled, "hit_rate": self.hit_rate,
                "hits": int(self.hits.sum()), "misses": int(self.misses.sum()),
                "entries": int(self.entries.sum()), "bytes": int(self.bytes.sum()),
                "evictions": int(self.evictions.sum()), "dropped": int(self.dropped.sum()),
                "per_layer": {k: getattr(self, k).tolist()
                              for k in ("hits", "misses", "keys", "entries", "bytes", "evictions", "dropped")}}


@dataclass(frozen=True)
class LatencySummary:
    count: int
    mean_us: float
    min_us: float
    median_us: float     # over the recent window


@dataclass(frozen=True)
class FidelitySummary:
    checked: int
    mean_cosine: float       # cached vs fresh output at the hit's own input: the approximation a hit carries
    min_cosine: float
    max_abs_error: float
    max_stale_error: float   # cached vs recomputed at the entry's own input under current weights: must be 0


@dataclass(frozen=True)
class StatsSnapshot:
    """Immutable view of the cache statistics, for the GUI, the command line and the HTTP endpoint."""
    calls: int
    lookups: int            # decode calls that consulted a cache
    tiers: dict             # tier name -> TierSnapshot
    bypasses: dict          # reason -> per-layer counts
    latency: dict           # outcome -> LatencySummary
    fidelity: FidelitySummary
    recent: tuple           # (timestamp, layer, outcome, seconds) of the latest calls
    # Per layer, lookups that missed every tier they consulted (the FFN was computed); None from older producers.
    full_misses: np.ndarray | None = None
    near_miss: NearMissSnapshot | None = None   # explained misses (engine/cache/near_miss.py)

    @property
    def hits(self) -> int:
        return int(sum(t.hits.sum() for t in self.tiers.values()))

    @property
    def bypass_total(self) -> int:
        return int(sum(v.sum() for v in self.bypasses.values()))

    def to_dict(self) -> dict:
        return {"calls": self.calls, "lookups": self.lookups,
                "tiers": {k: v.to_dict() for k, v in self.tiers.items()},
                "bypasses": {k: {"total": int(v.sum()), "per_layer": v.tolist()} for k, v in self.bypasses.items()},
                "latency_us": {k: vars(v) for k, v in self.latency.items()},
                "fidelity": vars(self.fidelity),
                **({"full_misses": {"total": int(self.full_misses.sum()), "per_layer": self.full_misses.tolist()}}
                   if self.full_misses is not None else {}),
                **({"near_miss": self.near_miss.to_dict()} if self.near_miss is not None else {})}


class CacheStats:
    """Thread-safe counters. A session records into its own and into the process-wide one."""

    RECENT = 4096

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        n = self.n_layers
        with getattr(self, "_lock", threading.Lock()):
            self._hits = {t: np.zeros(n, np.int64) for t in TIERS}
            self._misses = {t: np.zeros(n, np.int64) for t in TIERS}
            self._bypass = {r: np.zeros(n, np.int64) for r in BYPASS_REASONS}
            self._full_misses = np.zeros(n, np.int64)
            self._lat_count = dict.fromkeys(OUTCOMES, 0)      # calls per outcome
            self._lat_timed = dict.fromkeys(OUTCOMES, 0)      # of which timed on their own
            self._lat_sum = dict.fromkeys(OUTCOMES, 0.0)
            self._lat_min = dict.fromkeys(OUTCOMES, float("inf"))
            self._lat_recent = {o: deque(maxlen=1024) for o in OUTCOMES}
            self._recent = deque(maxlen=self.RECENT)
            self._fid_n, self._fid_sum, self._fid_min, self._fid_maxabs, self._fid_stale = 0, 0.0, 1.0, 0.0, 0.0
            self._calls = 0
            self._lookups = 0
            self._near_miss = NearMissCounts(n)

    def record(self, layer: int, outcome: str, seconds: float | None, *, tier_results=(),
               bypass: str | None = None) -> None:
        """tier_results: (tier, hit) in lookup order. seconds None: the call was not timed on its own (a layer of
        the whole-model decoder graph): it is counted, but left out of the latency figures."""
        with self._lock:
            self._calls += 1
            if tier_results:
                self._lookups += 1
            for tier, hit in tier_results:
                (self._hits if hit else self._misses)[tier][layer] += 1
            if bypass is not None:
                self._bypass[bypass][layer] += 1
            if outcome == "miss":
                self._full_misses[layer] += 1
            self._lat_count[outcome] += 1
            if seconds is None:
                return
            self._lat_timed[outcome] += 1
            self._lat_sum[outcome] += seconds
            self._lat_min[outcome] = min(self._lat_min[outcome], seconds)
            self._lat_recent[outcome].append(seconds)
            self._recent.append((time.monotonic(), layer, outcome, seconds))

    def record_fidelity(self, cosine: float, max_abs: float, stale: float = 0.0) -> None:
        with self._lock:
            self._fid_n += 1
            self._fid_sum += cosine
            self._fid_min = min(self._fid_min, cosine)
            self._fid_maxabs = max(self._fid_maxabs, max_abs)
            self._fid_stale = max(self._fid_stale, stale)

    def record_near_miss(self, layer: int, found) -> None:
        with self._lock:
            self._near_miss.record(layer, found)

    def snapshot(self, tiers: dict[str, list["CacheTier"]], enabled: dict[str, bool]) -> StatsSnapshot:
        """`tiers`: the tier objects whose occupancy is summed under each tier name (L1: every session's)."""
        with self._lock:
            tier_snaps = {}
            for name in TIERS:
                keys, entries, nbytes, evictions, dropped = (np.zeros(self.n_layers, np.int64) for _ in range(5))
                for tier in tiers.get(name, ()):
                    for total, part in zip((keys, entries, nbytes, evictions, dropped), tier.occupancy()):
                        total += part
                on = enabled.get(name, False)
                tier_snaps[name] = TierSnapshot(name, on, self._hits[name].copy(), self._misses[name].copy(),
                                                keys, entries, nbytes, evictions, dropped)
            latency = {}
            for o in OUTCOMES:
                n, timed = self._lat_count[o], self._lat_timed[o]
                recent = np.fromiter(self._lat_recent[o], float) if self._lat_recent[o] else np.zeros(0)
                latency[o] = LatencySummary(n, 1e6 * self._lat_sum[o] / timed if timed else 0.0,
                                            1e6 * self._lat_min[o] if timed else 0.0,
                                            1e6 * float(np.median(recent)) if recent.size else 0.0)
            fid = FidelitySummary(self._fid_n, self._fid_sum / self._fid_n if self._fid_n else float("nan"),
                                  self._fid_min if self._fid_n else float("nan"), self._fid_maxabs,
                                  self._fid_stale)
            return StatsSnapshot(self._calls, self._lookups, tier_snaps,
                                 {r: v.copy() for r, v in self._bypass.items()}, latency, fid,
                                 tuple(self._recent), self._full_misses.copy(), self._near_miss.snapshot())


# ----------------------------------------------------------------------------------------------- walk FFN
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
    # Dense passes (dense settings, no INSERT overrides) may run as one call of the whole-model decoder graph;
    # False keeps them layer by layer, like the walk (the bench's like-for-like baseline for the cache).
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

    def resolved(self, intermediate: int) -> "WalkSettings":
        k = default_top_k(intermediate) if self.top_k is None else self.top_k
        if k > intermediate:
            raise ValueError(f"K={k} exceeds the model's {intermediate} features per layer")
        width = k if self.key_width is None else self.key_width
        if width > k:
            raise ValueError(f"key width {width} exceeds K={k}")
        return replace(self, top_k=k, key_width=width)

    @property
    def hit_rule(self) -> HitRule:
        if self.cosine_guard is not None:
            return HitRule("cosine", tau=self.cosine_guard)
        if self.feature_set_hits:
            return HitRule("feature_set")
        return HitRule("near", max_distance=self.max_distance)


class FfnGraphs(Protocol):
    config: object   # ModelConfig (its activation name is used for overridden features)
    numerics: str    # names how the graphs compute (export format): part of every cache key's namespace

    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray) -> np.ndarray: ...
    def dense(self, layer: int, x: np.ndarray) -> np.ndarray: ...


class PersistentTierView:
    """The persistent store (L3) seen as a tier of one model: the last link of the lookup chain (one entry per
    key, so the cosine guard checks it like a bucket of one) and its occupancy for the statistics."""

    def __init__(self, store, n_layers: int):
        self._store = store
        self.name = store.name
        self.n_layers = n_layers

    @property
    def enabled(self) -> bool:
        return self._store.settings.enabled

    def occupancy(self):
        return self._store.occupancy(self.n_layers)

    def lookup(self, layer: int, key, x: np.ndarray, rule: HitRule | None) -> CacheEntry | None:
        entry = self._store.get(layer, key[0], key[1])
        if entry is not None and rule is not None and rule.closeness(x, entry.residual) is None:
            return None
        return entry

    def store(self, layer: int, key, entry: CacheEntry, bucket_size: int = 1) -> bool:
        return self._store.put(layer, key[0], key[1], entry)


class WalkFfn:
    """The FfnCall of one session: sparse walk over the top-K features, through L1 then L2.

    INSERT overrides (a PatchOverlay) are applied on top of the base graphs: overridden features get patched
    gate scores before selection, are masked out of the base walk and added back from their override vectors.
    """

    def __init__(self, graphs: FfnGraphs, intermediate: int, model_checksum: str, settings: WalkSettings,
                 l1: CacheTier | None, l2: CacheTier | None, stats: tuple[CacheStats, ...],
                 patches: PatchOverlay | None = None, key_log: list | None = None, l3=None):
        self.graphs = graphs
        self.l3 = l3             # an l3.L3Store (persistent tier after L2) or None
        self._l3_tier = PersistentTierView(l3, graphs.config.n_layers) if l3 is not None else None
        # Outcome of the latest call ("hit", "miss", "bypass", "dense"), the tier that hit and the bypass reason:
        # for callers that report per call (the HTTP API builds one WalkFfn per request).
        self.last_outcome: str | None = None
        self.last_tier: str | None = None
        self.last_bypass: str | None = None
        self.key_log = key_log   # when a list: (layer, key) of every cache lookup, for offline analysis
        self.intermediate = intermediate
        self.settings = settings.resolved(intermediate)
        self._hit_rule = self.settings.hit_rule
        self.model_checksum = model_checksum
        self.l1, self.l2 = l1, l2
        self.stats = stats
        self.patches = patches if patches is not None else PatchOverlay()
        self.full_k = is_full_k(self.settings.top_k, intermediate)
        self.activation = ACTIVATIONS[graphs.config.activation]
        self._rng = np.random.default_rng(self.settings.verify_seed)
        s = self.settings
        self.near_miss = None if not s.near_miss_fraction else NearMissSampler(
            s.near_miss_fraction, s.cosine_guard if s.cosine_guard is not None else s.near_miss_tau,
            intermediate, s.top_k, seed=s.verify_seed)

    def namespace(self, epoch: str) -> tuple:
        """What an entry's output depends on besides the feature key: the model, K, key width, the layer's
        patch epoch and the graphs' numerics (a persistent L3 entry computed by older graphs, e.g. with fp32
        activations, is never served to newer ones)."""
        s = self.settings
        return (self.model_checksum, s.top_k, s.key_width, epoch, self.graphs.numerics)

    def _record(self, layer, outcome, started, **kw):
        seconds = None if started is None else time.perf_counter() - started
        self.last_outcome, self.last_bypass = outcome, kw.get("bypass")
        results = kw.get("tier_results", ())
        self.last_tier = results[-1][0] if outcome == "hit" and results else None
        for st in self.stats:
            st.record(layer, outcome, seconds, **kw)

    def picks_for(self, scores: np.ndarray) -> list[np.ndarray]:
        """Each position's top-K features (what a cache key is made from)."""
        k = self.settings.top_k
        return [select_features(row, k) for row in scores]

    @staticmethod
    def mask_from(picks: list[np.ndarray], scores: np.ndarray) -> np.ndarray:
        """(T, F) 0/1 mask of the picked features: what the walk graph sums over."""
        mask = np.zeros_like(scores)
        for t, chosen in enumerate(picks):
            mask[t, chosen] = 1.0
        return mask

    def mask_for(self, scores: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(T, F) 0/1 mask of the top-K features per position, and each position's selection."""
        picks = self.picks_for(scores)
        return self.mask_from(picks, scores), picks

    def _patched(self, layer: int, x: np.ndarray):
        """(overrides or None, their gate scores under the overlay (T, n), where each override holds its slot)."""
        ovr = self.patches.layer(layer)
        if ovr is None:
            return None, None, None
        patched = x @ ovr.gate.T + ovr.gate_bias
        # An inserted (gated) feature takes over its slot only where its biased gate score is positive; elsewhere
        # the slot keeps its base feature, so unrelated inputs compute exactly what the base model computes.
        # Plain overrides (no bias) replace their feature everywhere.
        return ovr, patched, (patched > 0.0) | ~ovr.gated

    def gate_knn(self, layer: int, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per position, the features the walk actually sums (the selected base features, with overridden
        slots replaced where their override holds) strongest first, and the gate scores it uses for them."""
        scores = self.graphs.gate_scores(layer, x)
        mask, _ = self.mask_for(scores)
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
        act = self.activation(patched_scores) * (x @ ovr.up.T) * holds       # (T, n)
        return out + act @ ovr.down                                          # (T, d)

    def dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The dense FFN under the current overlay."""
        if self.patches.layer(layer) is None:
            return self.graphs.dense(layer, x)
        ones = np.ones((x.shape[0], self.intermediate), np.float32)
        return self._walk(layer, x, self.graphs.gate_scores(layer, x), ones)

    def claim_dense_pass(self, positions: int) -> bool:
        """Whether the model may run a whole pass as the plain dense model, all layers in one decoder-graph call
        (model.TransformerModel.forward asks before each pass): yes under dense settings (or a K so large the
        walk is dense anyway) with no INSERT override on any layer. A claimed pass is recorded as a "dense"
        outcome per layer, untimed: one call runs them all."""
        s = self.settings
        if not s.whole_model_graph or not (s.dense or self.full_k) or self.patches.overridden_layers:
            return False
        for layer in range(self.graphs.config.n_layers):
            self._record(layer, "dense", None, bypass=None if s.dense else "full_k")
        return True

    @property
    def takes_gate_scores(self) -> bool:
        """The walk starts from the gate scores: the model may hand them over from the layer graph's call
        (`call_with_scores`) rather than have them computed by a call of their own."""
        return not (self.settings.dense or self.full_k)

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.call_with_scores(layer, x, None)

    def call_with_scores(self, layer: int, x: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
        """The FFN at `layer` for x; `scores`: x @ W_gate.T of the base weights when the caller has them."""
        started = time.perf_counter()
        s = self.settings
        if s.dense or self.full_k:
            out = self.dense(layer, x)
            self._record(layer, "dense", started, bypass=None if s.dense else "full_k")
            return out
        # Gate KNN: the base features compete exactly as in the base model (an overridden slot keeps its base
        # score in the ranking), so a patch never reshuffles which base features are selected.
        if scores is None:
            scores = self.graphs.gate_scores(layer, x)
        picks = self.picks_for(scores)     # the mask is made only where a walk runs: a hit needs the key alone
        patched = self._patched(layer, x)
        ovr, _, holds = patched
        touched = ovr is not None and bool(holds.any())
        tiers = [t for t in (self.l1, self.l2) if t is not None and t.settings.enabled]
        if self._l3_tier is not None and self._l3_tier.enabled:
            tiers.append(self._l3_tier)
        if x.shape[0] != 1:
            bypass = "prefill"
        elif ovr is not None and (s.patch_mode == "bypass" or touched):
            bypass = "patched"
        else:
            bypass = None if tiers else "cache_off"
        if bypass is not None:
            out = self._walk(layer, x, scores, self.mask_from(picks, scores), patched)
            self._record(layer, "bypass", started, bypass=bypass)
            return out
        # Only untouched feature sets reach here: their output depends on the base weights alone.
        key = (self.namespace(CLEAN_EPOCH), feature_key(key_features(scores[0], picks[0], s.key_width)))
        if self.key_log is not None:
            self.key_log.append((layer, key))
        x0 = x[0]
        rule = self._hit_rule
        bucket = s.bucket_size if s.cosine_guard is not None else 1
        results = []
        for i, tier in enumerate(tiers):
            entry = tier.lookup(layer, key, x0, rule)
            results.append((tier.name, entry is not None))
            if entry is not None:
                for upper in tiers[:i]:           # a hit fills the tiers above it
                    upper.store(layer, key, entry, bucket)
                self._record(layer, "hit", started, tier_results=tuple(results))
                if s.verify_fraction and self._rng.random() < s.verify_fraction:
                    self._verify(layer, x, scores, self.mask_from(picks, scores), entry)   # not timed
                return entry.output[None, :].copy()
        out = self._walk(layer, x, scores, self.mask_from(picks, scores), patched)
        # An overflowed output (an absurd input, a broken graph) is returned as computed but never stored: a
        # cache holds only what a later hit may serve.
        entry = None
        if np.isfinite(out).all():
            bits = None if self.near_miss is None else self.near_miss.bits(picks[0])
            entry = CacheEntry(_frozen(out[0]), _frozen(x0), bits)
            for tier in tiers:
                tier.store(layer, key, entry, bucket)
        self._record(layer, "miss", started, tier_results=tuple(results))
        if self.near_miss is not None and entry is not None:
            self.near_miss.after_miss(layer, started, x0, out[0], entry, tiers, key[0], self.stats)
        return out

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
        remade = self._walk(layer, x0, scores0, self.mask_for(scores0)[0])[0]
        stale = float(np.max(np.abs(remade - cached)))
        for st in self.stats:
            st.record_fidelity(cosine, max_abs, stale)
