"""Per-layer FFN outcomes of one forward pass, for the token view.

An `OutcomeRecorder` is one of a walk's observers (cache.stats.WalkObserver, beside its CacheStats: the session adds
it with `WalkFfn.add_observer`), so the walk reports to it exactly what it counts. A session starts it before a
forward pass and takes the outcomes after it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerOutcome:
    layer: int
    outcome: str             # "hit", "miss", "bypass" or "dense"
    tier: str | None = None  # the tier that hit ("L1", "L2", "L3")
    bypass: str | None = None   # why the cache was bypassed ("prefill", "patched", "cache_off", "full_k")

    def describe(self) -> str:
        if self.outcome == "hit":
            return f"{self.tier} hit"
        if self.outcome == "bypass":
            return f"bypass ({(self.bypass or '').replace('_', ' ')})"
        if self.outcome == "dense":
            return "dense" + (f" ({self.bypass.replace('_', ' ')})" if self.bypass else "")
        return self.outcome


class OutcomeRecorder:
    """Collects the last outcome per layer between `start()` and `take()` (one call per layer per pass)."""

    def __init__(self) -> None:
        self._layers: dict[int, LayerOutcome] = {}
        self._active = False
        # Outcomes are immutable and few (layer x outcome x tier x reason): each is made once and reused, since
        # making 30 frozen dataclasses per decode step cost ~60 us of a ~10 ms SmolLM2 step.
        self._made: dict[tuple, LayerOutcome] = {}

    def start(self) -> None:
        self._layers = {}
        self._active = True

    def take(self) -> tuple[LayerOutcome, ...]:
        self._active = False
        layers, self._layers = self._layers, {}
        return tuple(layers[k] for k in sorted(layers))

    # --- the WalkObserver protocol a walk reports to ---

    def record(self, layer: int, outcome: str, seconds: float | None, *, tier_results=(),
               bypass: str | None = None) -> None:
        if self._active:
            self._put(layer, outcome, tier_results, bypass)

    def record_untimed(self, records) -> None:
        if self._active:
            for layer, outcome, tier_results, bypass in records:
                self._put(layer, outcome, tier_results, bypass)

    def _put(self, layer: int, outcome: str, tier_results, bypass: str | None) -> None:
        layer = int(layer)
        key = (layer, outcome, tier_results[-1][0] if outcome == "hit" and tier_results else None, bypass)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = LayerOutcome(*key)
        self._layers[layer] = made

    def record_fidelity(self, cosine: float, max_abs: float, stale: float = 0.0) -> None:
        pass   # fidelity checks are not per-token outcomes

    def record_near_miss(self, layer: int, found) -> None:
        pass   # near-miss explanations go to the statistics, not to a token's outcomes
