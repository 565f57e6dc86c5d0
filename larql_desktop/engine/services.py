"""What every front-end asks of an engine, answered once: patch summaries, probes, walk requests, JSON-safe values.

The Qt worker, the HTTP routes and the command line only translate requests into these calls and render the
answers (frozen dataclasses), so each question has one implementation.
"""
from __future__ import annotations

import ipaddress
import math
import time
from dataclasses import dataclass

import numpy as np

from larql_desktop.engine.patches.overlay import Patch, PatchOverlay

# Where the local HTTP API answers unless told otherwise (the app's toggle, `serve`, the load test).
DEFAULT_API_HOST = "127.0.0.1"
DEFAULT_API_PORT = 8765
PROBE_TOKENS = 8


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 in brackets or not) only reaches this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class PatchSummary:
    """One applied patch as front-ends show it; `id` is stable (a content hash) and names it in requests."""
    id: str
    name: str                 # the file stem it was loaded from ("" for an INSERT made here)
    description: str
    base_model: str
    created_at: str
    operations: int
    layers: tuple[int, ...]
    features: tuple[tuple[int, int], ...]   # (layer, feature)

    @classmethod
    def of(cls, patch: Patch) -> "PatchSummary":
        return cls(patch.id, patch.name, patch.description, patch.base_model, patch.created_at,
                   len(patch.operations), tuple(patch.layers), tuple(patch.features))


def patch_summaries(overlay: PatchOverlay) -> tuple[PatchSummary, ...]:
    return tuple(PatchSummary.of(p) for p in overlay.patches)


@dataclass(frozen=True)
class ProbeOutcome:
    """A prompt's greedy continuation and the target's probability without patches and with the applied ones."""
    prompt: str
    target: str
    base_text: str
    patched_text: str
    base_probability: float | None     # of the target's first token; None without a target
    patched_probability: float | None


def probe(engine, prompt: str, target: str = "", tokens: int = PROBE_TOKENS,
          overlay: PatchOverlay | None = None) -> ProbeOutcome:
    """Greedy continuation (and the target's probability) under no patches and under `overlay` (default: the
    engine's applied patches, read once so both halves see one state)."""
    if not prompt.strip():
        raise ValueError("the probe prompt is empty")
    after = engine.patches if overlay is None else overlay
    inserter = engine.inserter()
    token = inserter.target_token(target) if target.strip() else None
    results = []
    for state in (PatchOverlay(), after):
        text, _ = inserter.continuation(prompt, state, tokens)
        p = inserter.probability(prompt, token, state) if token is not None else None
        results.append((text, p))
    (base_text, base_p), (patched_text, patched_p) = results
    return ProbeOutcome(prompt, target, base_text, patched_text, base_p, patched_p)


@dataclass(frozen=True)
class WalkAnswer:
    """One layer's walk FFN on given normed FFN inputs, as the HTTP API reports it."""
    layer: int
    top_k: int
    positions: int
    outcome: str                      # hit | miss | bypass | dense | none (features only)
    tier: str | None
    bypass_reason: str | None
    output: np.ndarray | None         # (T, d)
    features: list[np.ndarray] | None
    scores: list[np.ndarray] | None
    seconds: float


def walk_ffn(engine, layer: int, x: np.ndarray, top_k: int | None, full_output: bool = True) -> WalkAnswer:
    """Run one layer's walk for a client (no L1; the shared L2 and L3). Raises ValueError for a bad request."""
    cfg = engine.model.config
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} is out of range 0..{cfg.n_layers - 1}")
    k = engine.walk_settings.resolved(cfg.intermediate).top_k if top_k is None else top_k
    if not 1 <= k <= cfg.intermediate:
        raise ValueError(f"top_k {k} is out of range 1..{cfg.intermediate}")
    if x.ndim != 2 or x.shape[1] != cfg.hidden:
        raise ValueError(f"residual rows must have the model's hidden size {cfg.hidden}")
    started = time.perf_counter()
    walk = engine.request_walk(k)
    if not full_output:
        # The gate KNN as the walk sees it: under INSERT patches, with the overrides that hold their slots.
        knn = walk.gate_knn(layer, x)
        return WalkAnswer(layer, k, x.shape[0], "none", None, None, None, [ids for ids, _ in knn],
                          [s for _, s in knn], time.perf_counter() - started)
    out = walk(layer, x)
    engine.note_activity("api")
    return WalkAnswer(layer, k, x.shape[0], walk.last_outcome, walk.last_tier, walk.last_bypass, out, None, None,
                      time.perf_counter() - started)


def finite_json(value):
    """JSON has no NaN: statistics that are undefined (no fidelity checks yet) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value
