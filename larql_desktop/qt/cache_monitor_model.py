"""What the cache monitor plots, as plain data: histories built from successive stats events, per-layer arrays
from the latest one, and the JSON/CSV exports. numpy, no Qt: the panel only copies these into plot items.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict

import numpy as np

from larql_desktop.engine.cache.stats import BYPASS_REASONS, OUTCOMES, StatsSnapshot, TIERS
from larql_desktop.qt.protocol import CacheStatsEvent
# cache_counts is the engine's (the HTTP API counts per request with it too); imported from here by the worker.
from larql_desktop.engine.cache.stats import cache_counts  # noqa: F401


def _total(a: np.ndarray) -> int:
    return int(np.asarray(a).sum())


class History:
    """Fixed-capacity time series: `append` one row, `view` gives (t, columns) as array views (no copies)."""

    def __init__(self, columns: tuple[str, ...], capacity: int = 1200):
        self.columns = columns
        self.capacity = capacity
        self._data = np.full((2 * capacity, 1 + len(columns)), np.nan)
        self._start = 0
        self._end = 0

    def __len__(self) -> int:
        return self._end - self._start

    def clear(self) -> None:
        self._start = self._end = 0

    def append(self, t: float, values) -> None:
        if self._end == len(self._data):          # slide the window back: amortised O(1) per row
            keep = self.capacity - 1
            self._data[:keep] = self._data[self._end - keep:self._end]
            self._start, self._end = 0, keep
        self._data[self._end] = (t, *values)
        self._end += 1
        if len(self) > self.capacity:
            self._start = self._end - self.capacity

    @property
    def t(self) -> np.ndarray:
        return self._data[self._start:self._end, 0]

    def column(self, name: str) -> np.ndarray:
        return self._data[self._start:self._end, 1 + self.columns.index(name)]


class MonitorModel:
    """Ingests CacheStatsEvents (a few per second while generating) and keeps what the charts show.

    Time series are process-wide: hit rate per tier and median FFN-call latency per outcome over each
    interval between events, and the running mean/min cosine of verified hits.
    """

    def __init__(self, capacity: int = 1200):
        self.latest: CacheStatsEvent | None = None
        self.version = 0                          # bumped on every change; the view redraws when it moves
        self.hit_rate = History(TIERS, capacity)
        self.latency_us = History(OUTCOMES, capacity)
        self.fidelity = History(("mean_cosine", "min_cosine"), capacity)
        self._t0: float | None = None
        self._engine_id: int | None = None
        self._prev: StatsSnapshot | None = None
        self._seen_until = -math.inf              # the newest `recent` timestamp already turned into latency

    def reset(self) -> None:
        for h in (self.hit_rate, self.latency_us, self.fidelity):
            h.clear()
        self._t0, self._prev, self._seen_until = None, None, -math.inf
        self.version += 1

    def ingest(self, event: CacheStatsEvent) -> None:
        if event.engine_id != self._engine_id:    # a new model: its statistics start from nothing
            self.reset()
            self._engine_id = event.engine_id
        snap = event.process
        prev = self._prev
        if prev is not None and snap.calls < prev.calls:   # statistics were reset
            prev = None
        if self._t0 is None:
            self._t0 = event.time
        t = event.time - self._t0
        if snap.calls != (prev.calls if prev is not None else 0):
            rates = []
            for name in TIERS:
                if name not in snap.tiers:
                    rates.append(math.nan)
                    continue
                hits = _total(snap.tiers[name].hits) - (_total(prev.tiers[name].hits) if prev else 0)
                misses = _total(snap.tiers[name].misses) - (_total(prev.tiers[name].misses) if prev else 0)
                rates.append(hits / (hits + misses) if hits + misses else math.nan)
            self.hit_rate.append(t, rates)
            self.latency_us.append(t, self._interval_latency(snap))
            f = snap.fidelity
            self.fidelity.append(t, (f.mean_cosine, f.min_cosine) if f.checked else (math.nan, math.nan))
        self._prev = snap
        self.latest = event
        self.version += 1

    def _interval_latency(self, snap: StatsSnapshot) -> list[float]:
        fresh = [r for r in snap.recent if r[0] > self._seen_until]
        if snap.recent:
            self._seen_until = snap.recent[-1][0]
        out = []
        for outcome in OUTCOMES:
            seconds = [r[3] for r in fresh if r[2] == outcome]
            out.append(1e6 * float(np.median(seconds)) if seconds else math.nan)
        return out

    # --- per layer, from the latest process-wide snapshot ---

    def per_layer(self) -> dict[str, np.ndarray]:
        """Arrays of length n_layers: hits, entries and KiB per tier, misses (lookups that missed every tier
        they consulted: exact when the snapshot counts them, else inferred from the per-tier counts), bypasses."""
        if self.latest is None:
            return {}
        snap = self.latest.process
        misses = snap.full_misses
        out = {"misses": misses, "bypasses": sum(snap.bypasses.values())}
        for name, tier in snap.tiers.items():
            out[f"{name} hits"] = tier.hits
            out[f"{name} entries"] = tier.entries
            out[f"{name} KiB"] = tier.bytes / 1024.0
        return out

    def near_misses(self) -> dict[str, np.ndarray] | None:
        """Per layer, beside the hit rate: how near the explained misses came to a stored entry (nearest
        feature-set overlap and residual cosine, their distributions, and the share a guard at tau would have
        served). None before any statistics; zero `sampled` while explanation is off."""
        if self.latest is None or self.latest.process.near_miss is None:
            return None
        return near_miss_arrays(self.latest.process)


def near_miss_arrays(snap: StatsSnapshot) -> dict[str, np.ndarray]:
    nm = snap.near_miss
    hits = sum(t.hits for t in snap.tiers.values())
    misses = snap.full_misses
    looked = hits + misses
    with np.errstate(invalid="ignore", divide="ignore"):
        hit_rate = np.where(looked > 0, hits / np.maximum(looked, 1), np.nan)
    return {"hit_rate": hit_rate, "sampled": nm.sampled, "found": nm.found, "mean_overlap": nm.mean_overlap,
            "mean_cosine": nm.mean_cosine, "served_rate": nm.served_rate,
            "mean_served_error": nm.mean_served_error, "overlap_hist": nm.overlap_hist,
            "cosine_hist": nm.cosine_hist}


# --- exports ---

def _finite(value):
    """JSON has no NaN: statistics without data (no verified hits yet) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def stats_json(event: CacheStatsEvent) -> str:
    doc = {"process": event.process.to_dict(),
           "session": event.session.to_dict() if event.session is not None else None,
           "session_id": event.session_id,
           "patched_layers": list(event.patched_layers),
           "settings": asdict(event.settings)}
    return json.dumps(_finite(doc), indent=1)


CSV_COLUMNS = ("layer", "patched", *(f"{t}_{f}" for t in TIERS for f in
                                     ("hits", "misses", "keys", "entries", "bytes", "evictions", "dropped")),
               *(f"bypass_{r}" for r in BYPASS_REASONS),
               "near_miss_sampled", "near_miss_mean_overlap", "near_miss_mean_cosine", "near_miss_served")


def _csv_float(value: float):
    return "" if not math.isfinite(float(value)) else f"{float(value):.6f}"


def stats_csv(event: CacheStatsEvent) -> str:
    """One row per layer of the process-wide statistics."""
    snap = event.process
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    patched = set(event.patched_layers)
    for layer in range(event.n_layers):
        row = [layer, int(layer in patched)]
        for name in TIERS:
            tier = snap.tiers.get(name)
            row += [int(getattr(tier, f)[layer]) if tier is not None else 0 for f in
                    ("hits", "misses", "keys", "entries", "bytes", "evictions", "dropped")]
        row += [int(snap.bypasses[r][layer]) if r in snap.bypasses else 0 for r in BYPASS_REASONS]
        nm = snap.near_miss
        if nm is not None:
            row += [int(nm.sampled[layer]), _csv_float(nm.mean_overlap[layer]), _csv_float(nm.mean_cosine[layer]),
                    int(nm.served[layer])]
        else:
            row += [0, "", "", 0]
        writer.writerow(row)
    return out.getvalue()
