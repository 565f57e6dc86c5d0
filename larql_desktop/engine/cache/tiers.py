"""The cache tiers: L1 (one per session) and L2 (one per process) in memory, and the persistent L3 seen as a tier.

A tier maps (namespace, feature key) to a small bucket of entries per layer; `lru` eviction and a byte budget
besides the seed's `drop` policy; overwriting a key is never dropped. An entry is served only when `HitRule` says
the input that made it is (nearly) the request's own: the seed's key alone lets a request for 3x store its output
where the next request for x finds it."""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

POLICIES = ("drop", "lru")


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
        return _nbytes((self.output, self.residual, self.features))


ENTRY_PARTS = 3     # (output, residual, features): an entry's arrays in a tier's flat bucket


def _bucket_entries(bucket: tuple) -> list[tuple]:
    """A tier's flat bucket as (output, residual, features) per entry, oldest first."""
    return [bucket[i:i + ENTRY_PARTS] for i in range(0, len(bucket), ENTRY_PARTS)]


def _nbytes(parts: tuple) -> int:
    """CacheEntry.nbytes of an entry as a tier holds it: (output, residual, features)."""
    output, residual, features = parts
    return output.nbytes + residual.nbytes + (0 if features is None else features.nbytes)


def frozen_copy(a: np.ndarray) -> np.ndarray:
    # ndarray.copy where no conversion is needed: ~0.3 us less a call, 60 calls a decode step.
    a = a.copy() if isinstance(a, np.ndarray) and a.dtype == np.float32 else np.array(a, dtype=np.float32)
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
        distance_sq, norm_sq = self._near(x[None], x0[None])
        return -float(distance_sq[0]) if self._near_enough(distance_sq, norm_sq)[0] else None

    def admits(self, x: np.ndarray, x0: np.ndarray) -> np.ndarray:
        """Row by row (x, x0: (n, d)): whether an entry stored for x0 may serve x (closeness is not None)."""
        if self.mode == "feature_set":
            return np.ones(x.shape[0], bool)
        if self.mode == "cosine":
            return np.array([self.closeness(a, b) is not None for a, b in zip(x, x0)], bool)
        return self._near_enough(*self._near(x, x0))

    @staticmethod
    def _near(x: np.ndarray, x0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """|x - x0|^2 and |x|^2 per row: summed in float32 as the inputs are, compared in float64."""
        diff = x - x0
        return (np.einsum("ij,ij->i", diff, diff).astype(np.float64),
                np.einsum("ij,ij->i", x, x).astype(np.float64))

    def _near_enough(self, distance_sq: np.ndarray, norm_sq: np.ndarray) -> np.ndarray:
        # Compared squared: no square root on the hit path. NaN compares False, and a norm beyond float32
        # (inf <= inf would pass) is refused, so a non-finite or overflowing input misses.
        return (distance_sq <= self.max_distance * self.max_distance * norm_sq) & (norm_sq < math.inf)


class CacheTier:
    """One cache tier: per-layer maps from (namespace, feature key) to a small bucket of entries.

    Thread-safe: the L2 tier is shared by every session and thread of the process.
    """

    def __init__(self, name: str, n_layers: int, settings: TierSettings = TierSettings()):
        self.name = name
        self.n_layers = n_layers
        self.settings = settings
        self._lock = threading.Lock()
        # Per layer: key -> bucket, one flat tuple of its entries' arrays (output, residual, features, output,
        # ...; ENTRY_PARTS each, oldest first). A tuple of arrays is an object Python's cycle collector stops
        # tracking at its first collection (a nested one only at its second), where a CacheEntry and a list
        # each stayed tracked: an L2 of ~120k entries made every full collection walk ~240k more objects
        # (60-130 ms with all threads stopped, every few seconds of a busy server).
        self._layers: list[OrderedDict] = [OrderedDict() for _ in range(n_layers)]
        # Per-layer counts as Python ints, and the bytes' total kept as they change: a decode step stores one
        # entry per layer in each tier, and numpy scalar arithmetic (and a sum per store for the byte budget)
        # cost several microseconds each, in every batched row's serial share of the step.
        self._bytes = [0] * n_layers
        self._entries = [0] * n_layers
        self._evictions = [0] * n_layers
        self._dropped = [0] * n_layers
        self._total_bytes = 0

    def configure(self, settings: TierSettings) -> None:
        with self._lock:
            self.settings = settings
            for layer in range(self.n_layers):
                self._shrink(layer, settings.capacity)

    def clear(self) -> None:
        with self._lock:
            for layer in range(self.n_layers):
                self._layers[layer].clear()
            self._bytes = [0] * self.n_layers
            self._entries = [0] * self.n_layers
            self._total_bytes = 0

    def _valid_layer(self, layer: int) -> bool:
        return 0 <= layer < self.n_layers

    def lookup(self, layer: int, key, x: np.ndarray | None, rule: HitRule | None) -> CacheEntry | None:
        """The bucket's entry under `key` that `rule` lets serve x, the closest if several do; rule None: the
        newest entry under the key, whatever its input (for callers that check the input themselves)."""
        if not self._valid_layer(layer):
            return None
        with self._lock:
            if rule is None:
                return self._newest(layer, key)
            bucket = self._layers[layer].get(key)
            if bucket is None:
                return None
            best, best_score = None, None
            for parts in reversed(_bucket_entries(bucket)):        # newest first: ties go to the newest
                score = rule.closeness(x, parts[1])
                if score is not None and (best_score is None or score > best_score):
                    best, best_score = parts, score
            if best is not None and self.settings.policy == "lru":
                self._layers[layer].move_to_end(key)
            return None if best is None else CacheEntry(*best)

    def newest_many(self, wanted) -> list[CacheEntry | None]:
        """`lookup(layer, key, None, None)` for each (layer, key) of `wanted`, under one lock."""
        with self._lock:
            return [self._newest(layer, key) if self._valid_layer(layer) else None for layer, key in wanted]

    def _newest(self, layer: int, key) -> CacheEntry | None:
        """The newest entry under `key` (held lock; a valid layer), kept as recent under `lru`."""
        bucket = self._layers[layer].get(key)
        if bucket is None:
            return None
        if self.settings.policy == "lru":
            self._layers[layer].move_to_end(key)
        return CacheEntry(*bucket[-ENTRY_PARTS:])

    def store(self, layer: int, key, entry: CacheEntry, bucket_size: int = 1) -> bool:
        """Insert; returns False when the tier dropped it (full under the drop policy)."""
        if not self._valid_layer(layer):
            return False
        with self._lock:
            return self._store(layer, key, entry, bucket_size)

    def store_many(self, items, bucket_size: int = 1) -> None:
        """`store(layer, key, entry, bucket_size)` for each (layer, key, entry) of `items`, under one lock."""
        with self._lock:
            for layer, key, entry in items:
                if self._valid_layer(layer):
                    self._store(layer, key, entry, bucket_size)

    def _store(self, layer: int, key, entry: CacheEntry, bucket_size: int) -> bool:
        s = self.settings
        entries = self._layers[layer]
        bucket = entries.get(key)
        if bucket is None:
            if len(entries) >= s.capacity:
                if s.policy == "drop":
                    self._dropped[layer] += 1
                    return False
                self._evict_oldest(layer)
            bucket = ()
        elif s.policy == "lru":
            entries.move_to_end(key)
        # An existing key is always updated (never dropped); buckets keep the newest entries.
        bucket += (entry.output, entry.residual, entry.features)
        self._count(layer, 1, entry.nbytes)
        kept = ENTRY_PARTS * max(1, bucket_size)
        if len(bucket) > kept:
            dropped = _bucket_entries(bucket[:-kept])
            self._count(layer, -len(dropped), -sum(_nbytes(parts) for parts in dropped))
            bucket = bucket[-kept:]
        entries[key] = bucket
        if s.byte_budget is not None:
            self._enforce_budget(layer, key)
        return key in entries

    def _evict_oldest(self, layer: int) -> None:
        _, bucket = self._layers[layer].popitem(last=False)
        held = _bucket_entries(bucket)
        self._count(layer, -len(held), -sum(_nbytes(parts) for parts in held))
        self._evictions[layer] += 1

    def _count(self, layer: int, entries: int, nbytes: int) -> None:
        self._entries[layer] += entries
        self._bytes[layer] += nbytes
        self._total_bytes += nbytes

    def _shrink(self, layer: int, capacity: int) -> None:
        while len(self._layers[layer]) > capacity:
            self._evict_oldest(layer)

    def _enforce_budget(self, layer: int, newest_key) -> None:
        budget = self.settings.byte_budget
        while self._total_bytes > budget:
            if self.settings.policy == "drop":
                # Under drop, the newest entry is the one that does not fit.
                bucket = self._layers[layer][newest_key]
                self._count(layer, -1, -_nbytes(bucket[-ENTRY_PARTS:]))
                if len(bucket) > ENTRY_PARTS:
                    self._layers[layer][newest_key] = bucket[:-ENTRY_PARTS]
                else:
                    del self._layers[layer][newest_key]
                self._dropped[layer] += 1
                return
            victim_layer = layer if len(self._layers[layer]) > 1 else int(np.argmax(self._bytes))
            self._evict_oldest(victim_layer)

    def entries_of(self, layer: int, namespace) -> list[CacheEntry]:
        """Every entry of `layer` under `namespace` (near-miss explanation: the candidates a miss is compared with)."""
        if not self._valid_layer(layer):
            return []
        with self._lock:
            return [CacheEntry(*parts) for key, bucket in self._layers[layer].items() if key[0] == namespace
                    for parts in _bucket_entries(bucket)]

    def occupancy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, entries, bytes, evictions, dropped) per layer, copied."""
        with self._lock:
            keys = np.array([len(d) for d in self._layers], np.int64)
            return keys, *(np.array(counts, np.int64)
                           for counts in (self._entries, self._bytes, self._evictions, self._dropped))


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

    def store_many(self, items, bucket_size: int = 1) -> None:
        self._store.put_many([(layer, key[0], key[1], entry) for layer, key, entry in items])

    def newest_many(self, wanted) -> list[CacheEntry | None]:
        return self._store.get_many([(layer, key[0], key[1]) for layer, key in wanted])
