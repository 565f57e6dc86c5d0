"""Cache statistics: per-layer counts by outcome, tier and bypass reason, latencies, fidelity of verified hits and
explained near misses, recorded by every walk and read as immutable snapshots by the front-ends."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from larql_desktop.engine.cache.near_miss import NearMissCounts, NearMissSnapshot

if TYPE_CHECKING:
    from larql_desktop.engine.cache.tiers import CacheTier

BYPASS_REASONS = ("prefill", "full_k", "patched", "cache_off")


class WalkObserver(Protocol):
    """What a walk reports each FFN call's outcome to: its statistics (`CacheStats`: the session's and the
    engine's) and, for the token view, a session's `model.outcomes.OutcomeRecorder`. A walk is given its
    observers (`WalkFfn.add_observer`); none of them is asked anything back."""

    def record(self, layer: int, outcome: str, seconds: float | None, *, tier_results=(),
               bypass: str | None = None) -> None: ...

    def record_untimed(self, records: Sequence[tuple]) -> None: ...

    def record_fidelity(self, cosine: float, max_abs: float, stale: float = 0.0) -> None: ...

    def record_near_miss(self, layer: int, found) -> None: ...
OUTCOMES = ("hit", "miss", "bypass", "dense")
TIERS = ("L1", "L2", "L3")


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
    full_misses: np.ndarray   # per layer, lookups that missed every tier they consulted (the FFN was computed)
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
                "full_misses": {"total": int(self.full_misses.sum()), "per_layer": self.full_misses.tolist()},
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
            self._lat_recent: dict[str, deque[float]] = {o: deque(maxlen=1024) for o in OUTCOMES}
            self._recent: deque = deque(maxlen=self.RECENT)
            self._fid_n, self._fid_sum, self._fid_min, self._fid_maxabs, self._fid_stale = 0, 0.0, 1.0, 0.0, 0.0
            self._calls = 0
            self._lookups = 0
            self._near_miss = NearMissCounts(n)

    def record(self, layer: int, outcome: str, seconds: float | None, *, tier_results=(),
               bypass: str | None = None) -> None:
        """tier_results: (tier, hit) in lookup order. seconds None: the call was not timed on its own (a layer of
        the whole-model decoder graph): it is counted, but left out of the latency figures."""
        with self._lock:
            self._count(layer, outcome, tier_results, bypass)
            if seconds is None:
                return
            self._lat_timed[outcome] += 1
            self._lat_sum[outcome] += seconds
            self._lat_min[outcome] = min(self._lat_min[outcome], seconds)
            self._lat_recent[outcome].append(seconds)
            self._recent.append((time.monotonic(), layer, outcome, seconds))

    def record_untimed(self, records) -> None:
        """`record(layer, outcome, None, tier_results=..., bypass=...)` for each (layer, outcome, tier_results,
        bypass) of `records`, under one lock (the layers of a decode step run in one call). Counted per kind of
        record, all its layers at once: a step's 30 misses were 120 one-element numpy increments, in each
        batched row's serial share of the step."""
        layers_of: dict[tuple, list[int]] = {}
        for layer, outcome, tier_results, bypass in records:
            layers_of.setdefault((outcome, tier_results, bypass), []).append(layer)
        with self._lock:
            for (outcome, tier_results, bypass), layers in layers_of.items():
                self._count_layers(np.asarray(layers, np.intp), outcome, tier_results, bypass)

    def _count_layers(self, layers: np.ndarray, outcome: str, tier_results, bypass: str | None) -> None:
        """_count for each of `layers` (a layer may repeat). _count stays for record's single layer: np.add.at
        costs ~10x a scalar increment, and record runs per layer on the layer-by-layer path."""
        n = len(layers)
        self._calls += n
        if tier_results:
            self._lookups += n
        for tier, hit in tier_results:
            np.add.at((self._hits if hit else self._misses)[tier], layers, 1)
        if bypass is not None:
            np.add.at(self._bypass[bypass], layers, 1)
        if outcome == "miss":
            np.add.at(self._full_misses, layers, 1)
        self._lat_count[outcome] += n

    def _count(self, layer: int, outcome: str, tier_results, bypass: str | None) -> None:
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


def _total(a) -> int:
    return int(np.asarray(a).sum())


@dataclass(frozen=True)
class CacheCounts:
    """What the FFN cache did during one reply or request (differences of its statistics before and after)."""
    tiers: tuple[tuple[str, int, int], ...] = ()   # (tier, hits, misses) in lookup order: L1, L2, …
    bypasses: tuple[tuple[str, int], ...] = ()     # (reason, calls), reasons with calls only
    dense_calls: int = 0
    lookups: int = 0       # decode calls that consulted the cache
    computed: int = 0      # of those, the ones every tier missed (the FFN ran)
    calls: int = 0         # FFN calls of any kind

    def tier(self, name: str) -> tuple[int, int]:
        """(hits, misses) of one tier; (0, 0) if it is not listed."""
        return next(((h, m) for n, h, m in self.tiers if n == name), (0, 0))

    @property
    def bypass_total(self) -> int:
        return sum(n for _, n in self.bypasses)

    def to_dict(self) -> dict:
        return {"ffn_calls": self.calls, "lookups": self.lookups,
                "hits": {name: h for name, h, _ in self.tiers},
                "tier_misses": {name: m for name, _, m in self.tiers},
                "misses": self.computed,
                "bypasses": dict(self.bypasses), "dense_calls": self.dense_calls}

    def __add__(self, other: "CacheCounts") -> "CacheCounts":
        names = list(dict.fromkeys([n for n, _, _ in self.tiers] + [n for n, _, _ in other.tiers]))
        tiers = tuple((n, self.tier(n)[0] + other.tier(n)[0], self.tier(n)[1] + other.tier(n)[1]) for n in names)
        mine, theirs = dict(self.bypasses), dict(other.bypasses)
        bypasses = tuple((r, mine.get(r, 0) + theirs.get(r, 0)) for r in dict.fromkeys([*mine, *theirs]))
        return CacheCounts(tiers, bypasses, self.dense_calls + other.dense_calls, self.lookups + other.lookups,
                           self.computed + other.computed, self.calls + other.calls)


def cache_counts(before: StatsSnapshot | None, after: StatsSnapshot) -> CacheCounts:
    """What happened between two snapshots of the same statistics (a reply's share of its chat's stats; with
    `before` None, everything `after` counts: a request's own session)."""
    def delta(get) -> int:
        return get(after) - (get(before) if before is not None else 0)

    def tier(name: str, field: str):
        return lambda s: _total(getattr(s.tiers[name], field)) if name in s.tiers else 0

    tiers = tuple((name, delta(tier(name, "hits")), delta(tier(name, "misses"))) for name in after.tiers)
    bypasses = tuple((reason, n) for reason in after.bypasses
                     if (n := delta(lambda s, r=reason: _total(s.bypasses.get(r, 0)))) > 0)
    dense = delta(lambda s: s.latency["dense"].count if "dense" in s.latency else 0)
    computed = delta(lambda s: _total(s.full_misses) if s.full_misses is not None else 0)
    return CacheCounts(tiers, bypasses, dense, delta(lambda s: s.lookups), computed, delta(lambda s: s.calls))
