"""Paraphrase collapse: do two prompts reach the same cache entry?

The seed's premise is that semantically equivalent prompts give residuals with cosine 0.98-0.99 and an identical
sparse feature set, so one cache entry serves both. This module measures it on the real model, per layer:

  * the cosine of the two prompts' normed FFN inputs (what the gate KNN and the cache see), taken at the last
    prompt position (the position that predicts the reply's first token) of the prompt as the engine renders it:
    chat template with the generation prompt for chat models, plain text for base models;
  * their top-K overlap |A ∩ B| / K, A and B being the K features of largest |gate score| (the walk's selection,
    `cache.keys.select_features`, K the engine's default: 79% of the intermediate size);
  * whether the cache keys are equal (`cache.keys.feature_key` of `cache.keys.key_features` at key width k');
  * the same over a sweep of K and of k', beside the overlap two *random* K-subsets of F features already have
    in expectation: K / F. At the seed's K that is 0.79, so an overlap of 0.9 is little above chance, and equal
    keys need every one of ~1,200 ids to agree.

The lab measures the model as its weights define it: the inputs come from the numpy fp32 forward pass over the
dequantised GGUF weights (`Fp32Forward`: attention and the dense FFN, no onnxruntime graphs), and the gate scores
are x @ W_gate.T in fp32. The engine's graphs run MatMulNBits with int8-quantised activations, which moved one
SmolLM2 layer's pair cosine by 0.02: enough to blur a question about 0.98 against 0.99. (The feature view, which
explains what the cache saw, stays on the graphs.)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from larql_desktop.engine.cache.keys import default_top_k, feature_key, key_features, select_features
from larql_desktop.engine.cache.tiers import cosine
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.model.transformer import KvCache, NumpyDenseFfn, TransformerModel

# Shares of the intermediate size the K sweep visits (besides the seed's default K and the report's), and the key
# widths k' swept at K.
K_SWEEP_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)
KEY_WIDTH_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def prompt_ids(model, prompt: str) -> list[int]:
    """The prompt as the engine feeds it for a first user turn: chat template for chat models, text for base."""
    return chat_prompt_ids(model, prompt)


COMPUTATION = "numpy fp32 (dequantised GGUF weights)"


class CollapseCancelled(Exception):
    """The caller's should_stop() said so between two prompts (or two pairs); nothing is reported."""


@dataclass(frozen=True)
class PromptCapture:
    prompt: str
    token_ids: tuple[int, ...]
    inputs: np.ndarray      # (n_layers, d) normed FFN inputs at the last prompt position
    scores: np.ndarray      # (n_layers, F) their gate scores x @ W_gate.T


class _PassComplete(Exception):
    """Raised by the recording FFN once the last layer's input is taken: the logits are never computed (on Gemma
    that would be a 262k-row matrix product per prompt)."""


class Fp32Forward:
    """The model's numpy fp32 path: its own TransformerModel with no graphs attached and the dense FFN from the
    dequantised weights (~0.4 s and ~400 MB to build, a 40-token pass ~0.2 s). The caller owns it: build one per
    lab run, or keep it while measuring one model and drop it after."""

    computation = COMPUTATION

    def __init__(self, model):
        self.model = model
        self.transformer = TransformerModel(model.gguf, model.config)
        self.ffn = NumpyDenseFfn(self.transformer)

    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray:
        return x @ self.ffn.weights[layer][0].T

    def last_position(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """((n_layers, d) normed FFN inputs, (n_layers, F) gate scores) at the last of `ids`."""
        n_layers = self.model.config.n_layers
        rows: list[np.ndarray] = []

        def recording(layer: int, x: np.ndarray) -> np.ndarray:
            rows.append(np.array(x[-1], dtype=np.float32, copy=True))
            if layer == n_layers - 1:
                raise _PassComplete
            return self.ffn(layer, x)

        try:
            self.transformer.forward(ids, KvCache(self.model.config), recording)
        except _PassComplete:
            pass
        if len(rows) != n_layers:
            raise RuntimeError(f"the pass recorded {len(rows)} of {n_layers} layers")
        inputs = np.stack(rows)
        return inputs, np.stack([self.gate_scores(layer, inputs[layer]) for layer in range(n_layers)])


def capture(forward: Fp32Forward, prompt: str) -> PromptCapture:
    model = forward.model
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("every prompt must be non-empty text")
    ids = prompt_ids(model, prompt)
    if len(ids) >= model.context_limit:
        raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {model.context_limit}")
    inputs, scores = forward.last_position(ids)
    return PromptCapture(prompt, tuple(ids), inputs, scores)


# ------------------------------------------------------------------------------------------ comparison
@dataclass(frozen=True)
class LayerComparison:
    layer: int
    cosine: float           # of the normed FFN inputs
    overlap: float          # |A ∩ B| / K at the report's K
    keys_equal: bool        # cache keys at the report's K and key width
    key_overlap: float      # |A' ∩ B'| / k' of the key features

    def to_dict(self) -> dict:
        return {"layer": self.layer, "cosine": self.cosine, "overlap": self.overlap,
                "keys_equal": self.keys_equal, "key_overlap": self.key_overlap}


@dataclass(frozen=True)
class SweepPoint:
    size: int                       # K (top-K sweep) or k' (key-width sweep)
    baseline: float                 # expected overlap of two random subsets of that size: size / F
    overlap: tuple[float, ...]      # per layer
    keys_equal: tuple[bool, ...]    # per layer

    def to_dict(self) -> dict:
        return {"size": self.size, "baseline": self.baseline, "overlap": list(self.overlap),
                "keys_equal": list(self.keys_equal), "layers_with_equal_keys": int(sum(self.keys_equal))}


@dataclass(frozen=True)
class PairReport:
    a: int                          # prompt indices
    b: int
    layers: tuple[LayerComparison, ...]
    top_k_sweep: tuple[SweepPoint, ...]
    key_width_sweep: tuple[SweepPoint, ...]   # at the report's K

    def column(self, name: str) -> np.ndarray:
        return np.array([getattr(c, name) for c in self.layers], dtype=float)

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "layers": [c.to_dict() for c in self.layers],
                "top_k_sweep": [p.to_dict() for p in self.top_k_sweep],
                "key_width_sweep": [p.to_dict() for p in self.key_width_sweep]}


@dataclass(frozen=True)
class CollapseReport:
    model: str
    template: str                   # "chat" or "plain"
    intermediate: int               # F
    top_k: int                      # K
    key_width: int                  # k'
    prompts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]   # each prompt as measured (its last id is the position compared)
    pairs: tuple[PairReport, ...]   # every pair i < j; pairs[0] is prompts 0 and 1
    computation: str = COMPUTATION

    @property
    def baseline(self) -> float:
        return self.top_k / self.intermediate

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return tuple(len(ids) for ids in self.token_ids)

    def to_dict(self) -> dict:
        first = self.pairs[0]
        return {"model": self.model, "template": self.template, "position": "last prompt token",
                "input": "normed FFN input", "computation": self.computation,
                "intermediate": self.intermediate, "top_k": self.top_k,
                "key_width": self.key_width, "random_overlap_baseline": self.baseline,
                "prompts": list(self.prompts), "prompt_tokens": list(self.prompt_tokens),
                "token_ids": [list(ids) for ids in self.token_ids],
                "layers": [c.to_dict() for c in first.layers],
                "pairs": [p.to_dict() for p in self.pairs]}


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    return len(np.intersect1d(a, b, assume_unique=True)) / a.size


def _key(scores: np.ndarray, k: int, width: int) -> tuple[np.ndarray, int]:
    chosen = key_features(scores, select_features(scores, k), width)
    return chosen, feature_key(chosen)


def compare_layer(layer: int, xa: np.ndarray, xb: np.ndarray, sa: np.ndarray, sb: np.ndarray, top_k: int,
                  key_width: int) -> LayerComparison:
    A, B = select_features(sa, top_k), select_features(sb, top_k)
    ka, kb = key_features(sa, A, key_width), key_features(sb, B, key_width)
    return LayerComparison(layer, cosine(xa, xb), _overlap(A, B), feature_key(ka) == feature_key(kb),
                           _overlap(ka, kb))


def _sweep(ca: PromptCapture, cb: PromptCapture, sizes, top_k: int | None, intermediate: int) -> tuple:
    """top_k None: sweep K (key = all K ids); else sweep the key width k' at that K."""
    points = []
    for size in sizes:
        overlaps, equal = [], []
        for sa, sb in zip(ca.scores, cb.scores):
            k = size if top_k is None else top_k
            A, key_a = _key(sa, k, size)
            B, key_b = _key(sb, k, size)
            overlaps.append(_overlap(A, B))
            equal.append(key_a == key_b)
        points.append(SweepPoint(size, size / intermediate, tuple(overlaps), tuple(equal)))
    return tuple(points)


def resolve_sizes(intermediate: int, top_k: int | None, key_width: int | None) -> tuple[int, int]:
    k = default_top_k(intermediate) if top_k is None else int(top_k)
    if not 1 <= k <= intermediate:
        raise ValueError(f"K must be between 1 and the model's {intermediate} features, not {k}")
    width = k if key_width is None else int(key_width)
    if not 1 <= width <= k:
        raise ValueError(f"key width must be between 1 and K={k}, not {width}")
    return k, width


def compare_captures(model_name: str, template: str, intermediate: int, captures: list[PromptCapture],
                     top_k: int | None = None, key_width: int | None = None, computation: str = COMPUTATION,
                     should_stop: Callable[[], bool] = lambda: False) -> CollapseReport:
    if len(captures) < 2:
        raise ValueError("the collapse lab compares at least two prompts")
    k, width = resolve_sizes(intermediate, top_k, key_width)
    k_sizes = sorted({max(1, int(round(f * intermediate))) for f in K_SWEEP_FRACTIONS}
                     | {default_top_k(intermediate), k})
    widths = sorted({w for w in KEY_WIDTH_SWEEP if w <= k} | {width, k})
    pairs = []
    for i, j in itertools.combinations(range(len(captures)), 2):
        if should_stop():
            raise CollapseCancelled("the collapse lab was stopped")
        ca, cb = captures[i], captures[j]
        layers = tuple(compare_layer(layer, ca.inputs[layer], cb.inputs[layer], ca.scores[layer],
                                     cb.scores[layer], k, width) for layer in range(len(ca.inputs)))
        pairs.append(PairReport(i, j, layers, _sweep(ca, cb, k_sizes, None, intermediate),
                                _sweep(ca, cb, widths, k, intermediate)))
    return CollapseReport(model_name, template, intermediate, k, width, tuple(c.prompt for c in captures),
                          tuple(c.token_ids for c in captures), tuple(pairs), computation)


def collapse(model, prompts: list[str], top_k: int | None = None, key_width: int | None = None,
             forward: Fp32Forward | None = None, should_stop: Callable[[], bool] = lambda: False,
             progress: Callable[[int, int], None] = lambda done, total: None) -> CollapseReport:
    """The lab's measurement for `prompts` on a loaded model: one fp32 pass per prompt through `forward` (built
    for this call when None). `should_stop` is checked before each prompt and each pair (CollapseCancelled);
    `progress(done, total)` follows each captured prompt."""
    if len(prompts) < 2:
        raise ValueError("the collapse lab compares at least two prompts")
    resolve_sizes(model.config.intermediate, top_k, key_width)      # refuse bad sizes before any work
    if any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise ValueError("every prompt must be non-empty text")
    if should_stop():
        raise CollapseCancelled("the collapse lab was stopped")
    forward = Fp32Forward(model) if forward is None else forward
    captures = []
    for prompt in prompts:
        if should_stop():
            raise CollapseCancelled("the collapse lab was stopped")
        captures.append(capture(forward, prompt))
        progress(len(captures), len(prompts))
    return compare_captures(model.name, "chat" if model.is_chat else "plain", model.config.intermediate,
                            captures, top_k, key_width, forward.computation, should_stop)


# ------------------------------------------------------------------------------------------ text
def _summary(values: np.ndarray) -> str:
    return f"{values.min():.3f} / {np.median(values):.3f} / {values.max():.3f}"


def format_report(report: CollapseReport) -> list[str]:
    first = report.pairs[0]
    p = report.prompts
    lines = [f"collapse: {report.model} ({report.template} prompts), K={report.top_k} of {report.intermediate}, "
             f"key width {report.key_width}; normed FFN input at the last prompt token; {report.computation}",
             f"A: {p[first.a]!r} ({report.prompt_tokens[first.a]} tokens)",
             f"B: {p[first.b]!r} ({report.prompt_tokens[first.b]} tokens)",
             f"{'layer':>5s} {'cosine':>8s} {'overlap':>8s} {'random':>7s} {'key ovl':>8s} {'keys equal':>10s}"]
    for c in first.layers:
        lines.append(f"{c.layer:5d} {c.cosine:8.4f} {c.overlap:8.4f} {report.baseline:7.4f} {c.key_overlap:8.4f} "
                     f"{'yes' if c.keys_equal else 'no':>10s}")
    lines.append("pairs (min / median / max over layers):")
    for pair in report.pairs:
        equal = int(pair.column("keys_equal").sum())
        lines.append(f"  {pair.a}-{pair.b}: cosine {_summary(pair.column('cosine'))}, overlap "
                     f"{_summary(pair.column('overlap'))}, equal keys on {equal}/{len(pair.layers)} layers")
    lines.append(f"K sweep, prompts {first.a}-{first.b} (median overlap over layers vs random K/F; layers with "
                 "equal keys):")
    for point in first.top_k_sweep:
        lines.append(f"  K={point.size:5d}: {np.median(point.overlap):.3f} vs {point.baseline:.3f}; "
                     f"{sum(point.keys_equal)}/{len(point.keys_equal)}")
    lines.append(f"key width sweep at K={report.top_k} (median key overlap vs random k'/F; layers with equal keys):")
    for point in first.key_width_sweep:
        lines.append(f"  k'={point.size:5d}: {np.median(point.overlap):.3f} vs {point.baseline:.4f}; "
                     f"{sum(point.keys_equal)}/{len(point.keys_equal)}")
    return lines


CSV_HEADER = ("pair_a", "pair_b", "layer", "cosine", "overlap", "random_overlap", "key_overlap", "keys_equal")


def report_csv_rows(report: CollapseReport) -> list[tuple]:
    return [(pair.a, pair.b, c.layer, c.cosine, c.overlap, report.baseline, c.key_overlap, int(c.keys_equal))
            for pair in report.pairs for c in pair.layers]
