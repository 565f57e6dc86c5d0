"""Near-miss explanation: how far did a cache miss come from hitting?

Exact feature-set keys hit on exact repeats and almost never elsewhere. For a sample of misses this finds, at the
miss's layer, the stored entry of the session's in-memory tiers (L1, L2) nearest to it

  * by feature-set overlap |A ∩ B| / K (each entry carries its selected features as a packed bitset, so the
    overlap is a popcount), and
  * by residual cosine (the normed FFN input the entry was computed from),

and whether a cosine guard at tau (the walk's own guard, or the near-miss tau when the walk has none) would have
served it from that nearest entry, with the output error such a hit would carry: |out - entry.output| / |out|.

Off by default (WalkSettings.near_miss_fraction = 0: no bitsets, no search, one `is None` test per miss). When on,
a miss is explained with probability `near_miss_fraction`, and only while the time spent explaining stays within
NEAR_MISS_BUDGET of the time the misses themselves took, so decode slows by at most that share whatever the tiers
hold. Distributions per layer are kept by `NearMissCounts` inside each CacheStats and arrive in every
StatsSnapshot (`near_miss`), for the monitor, the command line and the HTTP API alike.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

NEAR_MISS_BUDGET = 0.05          # explaining may cost at most this share of the misses' own time
# Histogram edges. Overlap: twentieths. Cosine: fine near 1, where a guard's tau lives.
OVERLAP_EDGES = np.linspace(0.0, 1.0, 21)
COSINE_EDGES = np.array([-1.0, 0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0])


def feature_bits(ids: np.ndarray, intermediate: int) -> np.ndarray:
    """The selected feature ids as a packed bitset of `intermediate` bits (read-only)."""
    mask = np.zeros(intermediate, bool)
    mask[ids] = True
    bits = np.packbits(mask)
    bits.flags.writeable = False
    return bits


@dataclass(frozen=True)
class NearMiss:
    """One explained miss: its nearest stored entries."""
    layer: int
    candidates: int             # stored entries it was compared with
    overlap: float              # best |A ∩ B| / K among them (nan when none carries a bitset)
    cosine: float               # best residual cosine
    served: bool                # a cosine guard at tau (walk.HitRule "cosine": norms within 5%) accepts an entry
    error: float                # |out - e.output| / |out| for the entry the guard would serve (else the nearest)
    tau: float


def nearest(layer: int, x: np.ndarray, out: np.ndarray, bits: np.ndarray, top_k: int, entries: list,
            tau: float) -> NearMiss | None:
    """The nearest of `entries` (CacheEntry-like: residual, output, features) to the miss (x, out, bits).

    `served` applies the cache's own cosine guard (walk.HitRule "cosine"): cos >= tau with the norms within
    GUARD_NORM_TOLERANCE, over every entry (as if the key had put them all in one bucket)."""
    # walk.py imports this module: its guard's constant is read at call time.
    from larql_desktop.engine.cache.tiers import GUARD_NORM_TOLERANCE

    if not entries:
        return None
    residuals = np.stack([e.residual for e in entries])
    norms, nx = np.linalg.norm(residuals, axis=1), float(np.linalg.norm(x))
    cos = residuals @ x / (norms * nx + 1e-30)
    guardable = np.abs(nx / np.maximum(norms, 1e-30) - 1.0) <= GUARD_NORM_TOLERANCE
    accepted = np.where(guardable & (cos >= tau), cos, -np.inf)
    served = bool(np.isfinite(accepted).any())
    best = int(np.argmax(accepted)) if served else int(np.argmax(cos))
    with_bits = [e.features for e in entries if e.features is not None]
    if with_bits:
        shared = np.bitwise_count(np.stack(with_bits) & bits).sum(axis=1, dtype=np.int64)
        overlap = float(shared.max()) / top_k
    else:
        overlap = float("nan")
    error = float(np.linalg.norm(out - entries[best].output)) / (float(np.linalg.norm(out)) + 1e-30)
    return NearMiss(layer, len(entries), overlap, float(cos.max()), served, error, tau)


class NearMissSampler:
    """Per walk FFN: which misses to explain (probability and time budget), and explaining them."""

    def __init__(self, fraction: float, tau: float, intermediate: int, top_k: int, seed: int = 0,
                 budget: float = NEAR_MISS_BUDGET):
        self.fraction = fraction
        self.tau = tau
        self.intermediate = intermediate
        self.top_k = top_k
        self.budget = budget
        self._rng = np.random.default_rng(seed)
        self.miss_seconds = 0.0      # time the misses took
        self.spent = 0.0             # time spent explaining them
        self.longest = 0.0           # the longest single explanation
        self.skipped_for_budget = 0

    def bits(self, ids: np.ndarray) -> np.ndarray:
        return feature_bits(ids, self.intermediate)

    def after_miss(self, layer: int, started: float, x: np.ndarray, out: np.ndarray, entry, tiers, namespace,
                   stats) -> NearMiss | None:
        """Called by WalkFfn after a miss was computed, stored and recorded (so its latency excludes this)."""
        now = time.perf_counter()
        self.miss_seconds += now - started
        if self._rng.random() >= self.fraction:
            return None
        if self.spent > self.budget * self.miss_seconds:
            self.skipped_for_budget += 1
            return None
        # Entries told apart by their output array, the one object every tier holding an entry shares (a tier
        # hands out a new CacheEntry around it at each read): the miss's own new entry is left out, and one held
        # by L1 and L2 is compared once.
        seen, entries = {id(entry.output)}, []
        for tier in tiers:
            entries_of = getattr(tier, "entries_of", None)     # in-memory tiers only: L3 is not searched
            if entries_of is None:
                continue
            for e in entries_of(layer, namespace):
                if id(e.output) not in seen:
                    seen.add(id(e.output))
                    entries.append(e)
        found = nearest(layer, x, out, entry.features, self.top_k, entries, self.tau)
        for st in stats:
            # Not every recorder in a walk's stats keeps near misses (the token view's per-layer outcomes don't).
            record = getattr(st, "record_near_miss", None)
            if record is not None:
                record(layer, found)
        took = time.perf_counter() - now
        self.spent += took
        self.longest = max(self.longest, took)
        return found


# ------------------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class NearMissSnapshot:
    """Per layer (arrays of length n_layers, histograms (n_layers, bins)): the explained misses."""
    sampled: np.ndarray         # misses explained
    empty: np.ndarray           # of which the tiers held nothing to compare with
    served: np.ndarray          # a guard at tau would have served them
    overlap_hist: np.ndarray    # best feature-set overlap, on OVERLAP_EDGES
    cosine_hist: np.ndarray     # best residual cosine, on COSINE_EDGES
    overlap_sum: np.ndarray
    cosine_sum: np.ndarray
    served_error_sum: np.ndarray   # output error of the would-be-served ones
    served_error_max: np.ndarray
    tau: float | None           # the latest explained miss's tau
    recent: tuple               # (layer, overlap, cosine, served, error) of the latest explained misses

    @property
    def found(self) -> np.ndarray:
        return self.sampled - self.empty

    def _per_found(self, total: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.found > 0, total / np.maximum(self.found, 1), np.nan)

    @property
    def mean_overlap(self) -> np.ndarray:
        return self._per_found(self.overlap_sum)

    @property
    def mean_cosine(self) -> np.ndarray:
        return self._per_found(self.cosine_sum)

    @property
    def served_rate(self) -> np.ndarray:
        return self._per_found(self.served.astype(float))

    @property
    def mean_served_error(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.served > 0, self.served_error_sum / np.maximum(self.served, 1), np.nan)

    def _recent_median(self, column: int) -> float | None:
        """Median over the latest explained misses (`recent`): exact for them, unlike a histogram's bins."""
        values = np.array([r[column] for r in self.recent], dtype=float)
        values = values[np.isfinite(values)]
        return float(np.median(values)) if values.size else None

    def to_dict(self) -> dict:
        def listed(a):
            return [None if isinstance(v, float) and not np.isfinite(v) else v for v in np.asarray(a).tolist()]
        return {"tau": self.tau, "sampled": int(self.sampled.sum()), "served": int(self.served.sum()),
                "overlap_edges": OVERLAP_EDGES.tolist(), "cosine_edges": COSINE_EDGES.tolist(),
                "recent_median_overlap": self._recent_median(1), "recent_median_cosine": self._recent_median(2),
                "recent": len(self.recent),
                "per_layer": {"sampled": self.sampled.tolist(), "empty": self.empty.tolist(),
                              "served": self.served.tolist(), "mean_overlap": listed(self.mean_overlap),
                              "mean_cosine": listed(self.mean_cosine),
                              "mean_served_error": listed(self.mean_served_error),
                              "served_error_max": self.served_error_max.tolist(),
                              "overlap_hist": self.overlap_hist.tolist(), "cosine_hist": self.cosine_hist.tolist()}}


class NearMissCounts:
    """Accumulates explained misses per layer. Not locked: CacheStats calls it under its own lock."""

    RECENT = 1024

    def __init__(self, n_layers: int):
        n = n_layers
        self.sampled = np.zeros(n, np.int64)
        self.empty = np.zeros(n, np.int64)
        self.served = np.zeros(n, np.int64)
        self.overlap_hist = np.zeros((n, len(OVERLAP_EDGES) - 1), np.int64)
        self.cosine_hist = np.zeros((n, len(COSINE_EDGES) - 1), np.int64)
        self.overlap_sum = np.zeros(n)
        self.cosine_sum = np.zeros(n)
        self.served_error_sum = np.zeros(n)
        self.served_error_max = np.zeros(n)
        self.tau: float | None = None
        self.recent: deque = deque(maxlen=self.RECENT)

    @staticmethod
    def _bin(edges: np.ndarray, value: float) -> int:
        return int(np.clip(np.searchsorted(edges, value, side="right") - 1, 0, len(edges) - 2))

    def record(self, layer: int, found: NearMiss | None) -> None:
        self.sampled[layer] += 1
        if found is None:
            self.empty[layer] += 1
            return
        self.tau = found.tau
        if np.isfinite(found.overlap):
            self.overlap_hist[layer, self._bin(OVERLAP_EDGES, found.overlap)] += 1
            self.overlap_sum[layer] += found.overlap
        self.cosine_hist[layer, self._bin(COSINE_EDGES, found.cosine)] += 1
        self.cosine_sum[layer] += found.cosine
        if found.served:
            self.served[layer] += 1
            self.served_error_sum[layer] += found.error
            self.served_error_max[layer] = max(self.served_error_max[layer], found.error)
        self.recent.append((layer, found.overlap, found.cosine, found.served, found.error))

    def snapshot(self) -> NearMissSnapshot:
        return NearMissSnapshot(self.sampled.copy(), self.empty.copy(), self.served.copy(),
                                self.overlap_hist.copy(), self.cosine_hist.copy(), self.overlap_sum.copy(),
                                self.cosine_sum.copy(), self.served_error_sum.copy(),
                                self.served_error_max.copy(), self.tau, tuple(self.recent))


def describe(nm: NearMissSnapshot | None, baseline: float | None) -> str:
    """One line for people: what the explained misses say (baseline: K/F, the overlap of two random K-sets), or
    how to turn explanation on."""
    if nm is None or not int(nm.sampled.sum()):
        return ("No misses explained: turn on \"Explain misses\" (a share of misses is compared with every stored "
                "entry of its layer; off by default).")
    found = int(nm.found.sum())
    if not found:
        return f"{int(nm.sampled.sum())} misses explained; the tiers held nothing to compare them with yet."
    overlap = float(nm.overlap_sum.sum()) / found
    cos = float(nm.cosine_sum.sum()) / found
    served = int(nm.served.sum())
    err = float(nm.served_error_sum.sum()) / served if served else float("nan")
    chance = f" (two random K-sets share {baseline:.3f})" if baseline is not None else ""
    guard = (f"a cosine guard at tau {nm.tau} would have served {100 * served / found:.1f}% of them"
             + (f", with output error {err:.3f} on average" if served else ""))
    return (f"{found} misses explained: the nearest stored entry shared {overlap:.3f} of its features on average"
            f"{chance} and its residual cosine was {cos:.4f}; {guard}.")
