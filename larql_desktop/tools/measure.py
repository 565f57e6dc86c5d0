"""Measurements of what the cache gains and costs: the seed's one-layer benchmark and its hit-rate table."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Callable

import numpy as np

from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.cache.stats import CacheStats, FidelitySummary
from larql_desktop.engine.cache.tiers import CacheTier, GUARD_NORM_TOLERANCE, TierSettings
from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.model.generation import SamplingSettings, greedy
from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.session import ChatSession
from larql_desktop.engine.loading import LoadedModel

Log = Callable[[str], None]


# ------------------------------------------------------------------------------------------ bench-ffn-cache
def capture_residuals(model: LoadedModel, layer: int, prompt: str, n: int) -> np.ndarray:
    """Normed FFN inputs of `layer` at n real decode steps (dense FFN, greedy)."""
    captured: list[np.ndarray] = []

    def recording_ffn(i: int, x: np.ndarray) -> np.ndarray:
        if i == layer and x.shape[0] == 1:
            captured.append(x.copy())
        return model.ffn.dense(i, x)

    ids = chat_prompt_ids(model, prompt)
    for _ in islice(greedy(model.transformer, ids, recording_ffn, context_limit=model.context_limit), n + 1):
        pass   # n decode steps after the prompt: one captured input each
    return np.stack(captured[:n])


@dataclass(frozen=True)
class BenchRow:
    mode: str
    calls: int
    min_us: float
    median_us: float
    hit_rate: float | None = None


def _timed(fn, inputs) -> np.ndarray:
    out = np.empty(len(inputs))
    for i, x in enumerate(inputs):
        t = time.perf_counter()
        fn(x)
        out[i] = time.perf_counter() - t
    return out * 1e6


def bench_ffn_cache(model: LoadedModel, layer: int, top_k: int | None, iters: int, rotate: int = 16,
                    prompt: str = "Explain how a cache speeds up a program.") -> list[BenchRow]:
    cfg = model.config
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer must be within 0..{cfg.n_layers - 1}, not {layer}")
    if iters < 1:
        raise ValueError("iters must be at least 1")
    residuals = capture_residuals(model, layer, prompt, rotate)
    x0 = residuals[0]
    settings = WalkSettings(top_k=top_k)
    n = cfg.n_layers

    def walk(l1: CacheTier | None, stats: CacheStats | None = None) -> WalkFfn:
        return WalkFfn(model.ffn, settings, model_checksum=model.checksum, l1=l1,
                       observers=(stats if stats is not None else CacheStats(n),))

    rows = []
    baseline = walk(CacheTier("L1", n, TierSettings(enabled=False)))
    rows.append(("baseline (no cache)", _timed(lambda x: baseline(layer, x), [x0] * iters), None))

    # A fresh tier per call: every call is a miss that computes and stores.
    fresh = [walk(CacheTier("L1", n)) for _ in range(iters)]
    times = np.empty(iters)
    for i, w in enumerate(fresh):
        t = time.perf_counter()
        w(layer, x0)
        times[i] = (time.perf_counter() - t) * 1e6
    rows.append(("cold cache (miss + store)", times, None))

    warm = walk(CacheTier("L1", n))
    warm(layer, x0)
    rows.append(("warm cache (100% hit)", _timed(lambda x: warm(layer, x), [x0] * iters), None))

    stats = CacheStats(n)
    rotating = walk(CacheTier("L1", n), stats)
    inputs = [residuals[i % len(residuals)] for i in range(iters)]   # the vector timed is the one looked up
    rot_times = _timed(lambda x: rotating(layer, x), inputs)
    snap = stats.snapshot({"L1": [rotating.l1]}, {"L1": True})
    rows.append((f"rotating {len(residuals)} real residuals", rot_times, snap.tiers["L1"].hit_rate))

    rows.append(("dense FFN (reference)", _timed(lambda x: model.ffn.dense(layer, x), [x0] * iters), None))
    return [BenchRow(name, len(t), float(t.min()), float(np.median(t)), hr) for name, t, hr in rows]


def format_bench(model: LoadedModel, layer: int, rows: list[BenchRow], top_k: int) -> list[str]:
    lines = [f"bench-ffn-cache: {model.name}, layer {layer}, K={top_k} of {model.config.intermediate}, "
             f"{model.threads} threads",
             f"{'mode':34s} {'calls':>6s} {'min us':>9s} {'median us':>10s} {'hit rate':>9s}"]
    for r in rows:
        hr = "" if r.hit_rate is None else f"{100 * r.hit_rate:8.1f}%"
        lines.append(f"{r.mode:34s} {r.calls:6d} {r.min_us:9.1f} {r.median_us:10.1f} {hr:>9s}")
    base = rows[0].median_us
    warm = next(r for r in rows if r.mode.startswith("warm"))
    lines.append(f"warm hit / baseline median: {warm.median_us / base:.2f}x")
    return lines


# ------------------------------------------------------------------------------------------ bench-batch
@dataclass(frozen=True)
class BatchBenchRow:
    decoder: str            # "dense" or "walked" (the top-K walk at every layer, then the head)
    rows: int
    ms_per_step: float      # the fastest of the rounds' medians
    tok_per_s: float        # rows / ms_per_step
    vs_one_row: float       # tok_per_s over the one-row tok_per_s of the same decoder


def bench_batched_decoders(model: LoadedModel, top_k: int, rows: list[int], context: int = 128, steps: int = 30,
                           rounds: int = 2) -> list[BatchBenchRow]:
    """The batched decoder graphs' own speed by rows: one decode step of `rows` sequences, each `context`
    positions into its KV cache, in one call. What batching concurrent requests can gain on this machine whatever
    the server around it does (no prefill, no sampling, no cache lookups, no HTTP): a server's aggregate tok/s
    over one client's stays below `vs_one_row`. The row counts run in turn, `rounds` times over, each its
    fastest median, so a busy spell of a shared host does not land on one row count alone."""
    from larql_desktop.engine.completions import batched_decoder
    from larql_desktop.engine.model.transformer import zeroed_layer_pairs

    cfg = model.config
    if not rows or min(rows) < 1:
        raise ValueError(f"row counts must be at least 1, not {rows}")
    if not 1 <= context < model.context_limit:
        raise ValueError(f"context must be within 1..{model.context_limit - 1}, not {context}")
    if steps < 1 or rounds < 1:
        raise ValueError("steps and rounds must be at least 1")
    decoder = batched_decoder(model)
    if decoder is None:
        raise ValueError(f"{model.name} has no decoder graphs to batch")
    rng = np.random.default_rng(0)
    counts = sorted(set(rows) | {1})
    inputs = {}
    for b in counts:       # the attention's cost follows the lengths, not the values: random keys and values
        keys, values = zeroed_layer_pairs(cfg.n_layers, (b, cfg.n_kv_heads, context + 1, cfg.head_dim))
        for array in keys + values:
            array[:, :, :context] = rng.standard_normal(array[:, :, :context].shape) * 0.1
        h = (rng.standard_normal((b, cfg.hidden)) * 0.1).astype(np.float32)
        inputs[b] = (h, np.full(b, context, np.int64), keys, values)

    def walked(h, pos, keys, values):     # the walked decoder leaves the head to one call for all rows, as a server
        passes = decoder.run_walked(h, pos, keys, values, model.transformer.rope, top_k)
        return model.transformer.graphs.run_head(np.stack([p.residuals[-1] for p in passes]),
                                                 np.stack([p.outputs[-1] for p in passes]))

    steppers = {"dense": lambda h, pos, k, v: decoder.run(h, pos, k, v, model.transformer.rope), "walked": walked}
    best: dict[tuple[str, int], float] = {}
    for name, step in steppers.items():
        step(*inputs[1])                       # the session and its bindings made before anything is timed
        for _ in range(rounds):
            for b in counts:
                step(*inputs[b])
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    step(*inputs[b])
                    times.append(time.perf_counter() - t)
                median = float(np.median(times)) * 1e3
                best[name, b] = min(best.get((name, b), median), median)
    out = []
    for name in steppers:
        one = 1 / best[name, 1]
        for b in counts:
            if b in rows:
                rate = b / best[name, b]
                out.append(BatchBenchRow(name, b, best[name, b], rate * 1e3, rate / one))
    return out


def format_bench_batch(model: LoadedModel, top_k: int, context: int, rows: list[BatchBenchRow]) -> list[str]:
    lines = [f"bench-batch: {model.name}, {model.threads} threads, one decode step of each row at position "
             f"{context}; walk K={top_k} of {model.config.intermediate}",
             f"{'decoder':8s} {'rows':>5s} {'ms/step':>8s} {'tok/s':>7s} {'vs 1 row':>8s}"]
    for r in rows:
        lines.append(f"{r.decoder:8s} {r.rows:5d} {r.ms_per_step:8.2f} {r.tok_per_s:7.1f} {r.vs_one_row:7.2f}x")
    lines.append("vs 1 row: tokens per second of all rows over one row's: the most batching concurrent requests can "
                 "gain here (a server adds prefill, sampling and the FFN cache's lookups around each step).")
    return lines


# ------------------------------------------------------------------------------------------ hitrates
SEED_EXPECTED = {   # the seed's "Expected Hit Rates" table
    "repeated": ("~100%", "—"),
    "paraphrase": ("60–90%", "—"),
    "common_factual": ("10–20%", "60–80%"),
    "novel": ("5–10%", "20–30%"),
}


@dataclass
class ScenarioResult:
    name: str
    l1_hits: int = 0
    l1_lookups: int = 0
    l2_hits: int = 0
    l2_lookups: int = 0
    cross_hits: int = 0           # lookups whose key another prompt of the scenario also looked up
    cross_lookups: int = 0
    fidelity: FidelitySummary | None = None
    agree_tokens: int = 0
    total_tokens: int = 0
    identical_texts: int = 0
    generations: int = 0

    def rate(self, hits, lookups):
        return hits / lookups if lookups else None

    def to_dict(self) -> dict:
        fid = self.fidelity if self.fidelity is not None and self.fidelity.checked else None
        return {
            "l1_hit_rate": self.rate(self.l1_hits, self.l1_lookups), "l1_lookups": self.l1_lookups,
            "l2_hit_rate": self.rate(self.l2_hits, self.l2_lookups), "l2_lookups": self.l2_lookups,
            "cross_prompt_key_overlap": self.rate(self.cross_hits, self.cross_lookups),
            "hit_cosine_mean": fid.mean_cosine if fid else None,
            "hit_cosine_min": fid.min_cosine if fid else None,
            "hit_max_abs_error": fid.max_abs_error if fid else None,
            "greedy_token_agreement": self.rate(self.agree_tokens, self.total_tokens),
            "identical_generations": self.identical_texts, "generations": self.generations,
            "seed_expected": {"L1": SEED_EXPECTED[self.name][0], "L2": SEED_EXPECTED[self.name][1]},
        }


def read_scenarios(path: str | Path) -> dict:
    doc = read_json(path, "scenarios file")
    scenarios = doc.get("scenarios") if isinstance(doc, dict) else None
    if not isinstance(scenarios, dict):
        raise ValueError(f"{path}: expected an object with a 'scenarios' mapping")
    unknown = set(scenarios) - set(SEED_EXPECTED)
    if unknown:
        raise ValueError(f"{path}: unknown scenario(s) {sorted(unknown)}; expected {sorted(SEED_EXPECTED)}")
    return scenarios


class CacheOffReference:
    """Each prompt's greedy tokens under the walk FFN with every cache off: what a cached run should reproduce."""

    def __init__(self, model: LoadedModel, walk: WalkSettings, settings: SamplingSettings):
        self.settings = settings
        self._engine = LarqlEngine(model, walk=walk, l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))
        self._tokens: dict[str, list[int]] = {}

    def tokens(self, prompt: str) -> list[int]:
        if prompt not in self._tokens:
            session = self._engine.new_session()
            self._tokens[prompt] = [s.token_id for s in session.reply(prompt, self.settings)]
            self._engine.close_session(session)
        return self._tokens[prompt]


def run_hitrates(model: LoadedModel, scenarios: dict, walk: WalkSettings, max_tokens: int = 32,
                 log: Log = lambda s: None) -> dict[str, ScenarioResult]:
    kind = "chat" if model.is_chat else "text"
    settings = SamplingSettings(max_tokens=max_tokens)
    cache_off_tokens = CacheOffReference(model, walk, settings).tokens

    measured_walk = WalkSettings(**{**vars(walk), "verify_fraction": 1.0})
    results: dict[str, ScenarioResult] = {}

    for name, sets in scenarios.items():
        prompts = sets.get(kind, [])
        if not prompts:
            continue
        result = results[name] = ScenarioResult(name)
        engine = LarqlEngine(model, walk=measured_walk)

        def measure(session, generate, prompt, tiers=("L1", "L2")):
            """Run one generation; count its decode lookups and hits on the given tiers."""
            before = engine.session_snapshot(session)
            tokens = [s.token_id for s in generate()]
            after = engine.session_snapshot(session)
            if "L1" in tiers:
                result.l1_hits += int(after.tiers["L1"].hits.sum() - before.tiers["L1"].hits.sum())
                result.l1_lookups += int(after.lookups - before.lookups)
            if "L2" in tiers:
                l2_hits = int(after.tiers["L2"].hits.sum() - before.tiers["L2"].hits.sum())
                l2_miss = int(after.tiers["L2"].misses.sum() - before.tiers["L2"].misses.sum())
                result.l2_hits += l2_hits
                result.l2_lookups += l2_hits + l2_miss
            reference = cache_off_tokens(prompt)
            result.agree_tokens += sum(a == b for a, b in zip(tokens, reference))
            result.total_tokens += max(len(tokens), len(reference))
            result.identical_texts += int(tokens == reference)
            result.generations += 1
            return tokens

        if name == "repeated":
            for prompt in prompts:
                session = engine.new_session()
                list(session.reply(prompt, settings))
                measure(session, lambda: session.regenerate(settings), prompt, tiers=("L1",))
                engine.close_session(session)
        elif name == "paraphrase":
            for pair in prompts:
                first, second = pair[0], pair[1]
                session = engine.new_session()
                list(session.reply(first, settings))
                session.reset()               # same session and L1, new conversation
                measure(session, lambda: session.reply(second, settings), second, tiers=("L1",))
                engine.close_session(session)
        else:
            key_logs: list[set] = []
            for prompt in prompts:            # pass 1: fresh sessions, L1 within each; warms L2
                session = engine.new_session()
                log_keys: list = []
                session.ffn.key_log = log_keys
                measure(session, lambda: session.reply(prompt, settings), prompt, tiers=("L1",))
                key_logs.append(set(log_keys))
                engine.close_session(session)
            for prompt in prompts:            # pass 2: fresh sessions against the warmed L2
                session = engine.new_session()
                measure(session, lambda: session.reply(prompt, settings), prompt, tiers=("L2",))
                engine.close_session(session)
            for i, keys in enumerate(key_logs):
                others = set().union(*(k for j, k in enumerate(key_logs) if j != i))
                result.cross_lookups += len(keys)
                result.cross_hits += len(keys & others)
        result.fidelity = engine.snapshot().fidelity   # every hit of the scenario verified
        log(f"{name}: {result.generations} generations, L1 {result.l1_hits}/{result.l1_lookups}, "
            f"L2 {result.l2_hits}/{result.l2_lookups}")
    return results


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def format_hitrates(model: LoadedModel, walk: WalkSettings, results: dict[str, ScenarioResult]) -> list[str]:
    w = walk.resolved(model.config.intermediate)
    lines = [f"hitrates: {model.name}, K={w.top_k} of {model.config.intermediate}, key width {w.key_width}"
             + (f", cosine guard {w.cosine_guard}" if w.cosine_guard is not None else ""),
             f"{'scenario':15s} {'L1':>7s} {'seed L1':>8s} {'L2':>7s} {'seed L2':>8s} {'x-prompt':>8s} "
             f"{'hit cos mean/min':>17s} {'greedy agree':>12s} {'same text':>9s}"]
    for name, r in results.items():
        d = r.to_dict()
        cos = ("—" if d["hit_cosine_mean"] is None
               else f"{d['hit_cosine_mean']:.4f}/{d['hit_cosine_min']:.4f}")
        lines.append(f"{name:15s} {_pct(d['l1_hit_rate']):>7s} {SEED_EXPECTED[name][0]:>8s} "
                     f"{_pct(d['l2_hit_rate']):>7s} {SEED_EXPECTED[name][1]:>8s} "
                     f"{_pct(d['cross_prompt_key_overlap']):>8s} {cos:>17s} "
                     f"{_pct(d['greedy_token_agreement']):>12s} {r.identical_texts:>4d}/{r.generations:<4d}")
    lines.append("L1/L2: decode lookups that hit. x-prompt: share of a prompt's keys that another prompt of the "
                 "scenario also produced (what an L2 warmed by *other* prompts could serve). Hit cosine: cached "
                 "vs freshly computed output on every hit. Greedy agreement: tokens equal to a cache-off run.")
    return lines


# ------------------------------------------------------------------------------------------ frontier
class MeasurementStopped(Exception):
    """The caller's should_stop() said so between two generations."""


def parse_sweep(text: str, what: str, parse) -> list:
    """'K,64,8' or 'off,0.999': comma-separated values, where K / off / none stand for None (k' = K, no guard)."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if part.lower() in ("k", "off", "none"):
            values.append(None)
            continue
        try:
            values.append(parse(part))
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a number") from None
    if not values:
        raise ValueError(f"{what}: give at least one value")
    return values


@dataclass(frozen=True)
class FrontierPoint:
    """One design on the prompts: hit rate of decode lookups against fidelity to the cache-off run."""
    key_width: int | None        # None: the nearest-neighbour bound (no key at all)
    tau: float | None            # cosine guard; None: off
    lookups: int                 # decode lookups
    hits: int
    agree_tokens: int            # greedy tokens equal to the cache-off run's, position by position
    total_tokens: int
    identical: int               # generations identical to the cache-off run
    generations: int
    mean_cosine: float           # cached vs fresh output on every hit (nan without hits)
    min_cosine: float
    feature_set_hits: bool = False   # with tau None: the seed's rule (any entry under the key), else "near"

    @property
    def is_bound(self) -> bool:
        return self.key_width is None

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def agreement(self) -> float:
        return self.agree_tokens / self.total_tokens if self.total_tokens else 1.0

    def to_dict(self) -> dict:
        def finite(v):
            return v if math.isfinite(v) else None
        return {"design": "nearest-neighbour bound" if self.is_bound else "feature key",
                "key_width": self.key_width, "tau": self.tau, "hit_rate": self.hit_rate, "hits": self.hits,
                "lookups": self.lookups, "greedy_agreement": self.agreement, "identical": self.identical,
                "generations": self.generations, "hit_cosine_mean": finite(self.mean_cosine),
                "hit_cosine_min": finite(self.min_cosine), "tau_label": self.tau_label}

    @property
    def tau_label(self) -> str:
        """'0.995'; without a guard 'exact' (a hit needs the entry's own input) or 'seed' (any entry under the key)."""
        if self.tau is not None:
            return f"{self.tau:g}"
        return "seed" if self.feature_set_hits else "exact"


class NearestNeighbourFfn:
    """The frontier's upper bound at a guard tau: every decode lookup is served by the stored output whose input
    is nearest by cosine among those the cache's guard accepts (walk.HitRule "cosine": cos >= tau, norms within
    GUARD_NORM_TOLERANCE), whatever its feature set. No key can hit where this misses (a key only narrows the
    candidates a guard may accept). Like the engine's cache, prefill neither serves nor stores; every decode
    miss stores. Each hit is also computed fresh to measure its output cosine."""

    def __init__(self, walk: WalkFfn, n_layers: int, tau: float):
        self.walk = walk                   # cache-off walk FFN: what a miss computes
        self.tau = tau
        self._inputs: list[list[np.ndarray]] = [[] for _ in range(n_layers)]   # unit vectors
        self._matrix: list[np.ndarray | None] = [None] * n_layers
        self._outputs: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self._norms: list[list[float]] = [[] for _ in range(n_layers)]
        self.lookups = 0
        self.hits = 0
        self.cosines: list[float] = []

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.call_with_scores(layer, x, None)

    def _stored(self, layer: int) -> np.ndarray | None:
        if self._matrix[layer] is None or len(self._matrix[layer]) != len(self._inputs[layer]):
            self._matrix[layer] = np.stack(self._inputs[layer]) if self._inputs[layer] else None
        return self._matrix[layer]

    def call_with_scores(self, layer: int, x: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
        if x.shape[0] != 1:
            return self.walk.call_with_scores(layer, x, scores)
        self.lookups += 1
        norm = float(np.linalg.norm(x[0]))
        x0 = x[0] / (norm + 1e-30)
        stored = self._stored(layer)
        fresh = self.walk.call_with_scores(layer, x, scores)
        if stored is not None:
            norms = np.asarray(self._norms[layer])
            guardable = np.abs(norm / np.maximum(norms, 1e-30) - 1.0) <= GUARD_NORM_TOLERANCE
            cos = np.where(guardable, stored @ x0, -np.inf)
            best = int(np.argmax(cos))
            if cos[best] >= self.tau:
                served = self._outputs[layer][best]
                self.hits += 1
                self.cosines.append(float(served @ fresh[0]) / (float(np.linalg.norm(served) * np.linalg.norm(fresh[0]))
                                                                + 1e-30))
                return served[None, :].copy()
        self._inputs[layer].append(x0.astype(np.float32))
        self._norms[layer].append(norm)
        self._outputs[layer].append(fresh[0].copy())
        return fresh


def _cosine_summary(cosines) -> tuple[float, float]:
    return (float(np.mean(cosines)), float(np.min(cosines))) if len(cosines) else (math.nan, math.nan)


def run_frontier(model: LoadedModel, prompts: list[str], widths: list[int | None], taus: list[float | None],
                 walk: WalkSettings = WalkSettings(), max_tokens: int = 32, log: Log = lambda s: None,
                 should_stop: Callable[[], bool] = lambda: False) -> tuple[list[FrontierPoint], list[FrontierPoint]]:
    """Key width k' x guard tau on the prompts, run one after another with fresh sessions sharing the process
    L2 (so a prompt can hit what an earlier one stored, and its own decode steps what it stored itself); and the
    nearest-neighbour bound at each tau. Returns (designs, bounds). `widths`: None means k' = K. `walk` gives K
    and what tau None means: the engine's default (a hit needs the entry's own input) or, with
    feature_set_hits, the seed's (any entry under the key)."""
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise ValueError("the frontier needs one or more non-empty prompts")
    if not widths or not taus:
        raise ValueError("the frontier needs at least one key width and one tau")
    F = model.config.intermediate
    base = replace(walk, key_width=None, cosine_guard=None, verify_fraction=0.0).resolved(F)
    # Resolved up front: impossible widths or taus are refused before any run, and k' = K reads as a number.
    designs = [replace(base, key_width=w, cosine_guard=t, verify_fraction=1.0).resolved(F)
               for w in widths for t in taus]
    settings = SamplingSettings(max_tokens=max_tokens)
    reference = CacheOffReference(model, base, settings)

    def stop_if_asked() -> None:
        if should_stop():
            raise MeasurementStopped("the frontier was stopped")

    def generate(session, prompt: str) -> list[int]:
        stop_if_asked()
        return [s.token_id for s in session.reply(prompt, settings)]

    def agreement(runs: list[tuple[str, list[int]]]) -> tuple[int, int, int]:
        """(tokens equal to the cache-off run, tokens compared, identical generations) over (prompt, tokens)."""
        agree = total = same = 0
        for prompt, tokens in runs:
            stop_if_asked()          # the cache-off reference is a generation too (once per prompt)
            ref = reference.tokens(prompt)
            agree += sum(a == b for a, b in zip(tokens, ref))
            total += max(len(tokens), len(ref))
            same += int(tokens == ref)
        return agree, total, same

    points = []
    for walk in designs:
        engine = LarqlEngine(model, walk=walk)
        runs, lookups, hits = [], 0, 0
        for prompt in prompts:
            session = engine.new_session()
            runs.append((prompt, generate(session, prompt)))
            snap = engine.session_snapshot(session)
            lookups += snap.lookups
            hits += int(snap.tiers["L1"].hits.sum() + snap.tiers["L2"].hits.sum())
            engine.close_session(session)
        agree, total, same = agreement(runs)
        fid = engine.snapshot().fidelity
        point = FrontierPoint(walk.key_width, walk.cosine_guard, lookups, hits, agree, total, same, len(prompts),
                              fid.mean_cosine if fid.checked else math.nan,
                              fid.min_cosine if fid.checked else math.nan, walk.feature_set_hits)
        points.append(point)
        log(f"k'={walk.key_width} tau={walk.cosine_guard}: hit rate {100 * point.hit_rate:.1f}%, "
            f"agreement {100 * point.agreement:.1f}%")
    bounds = []
    cfg = model.config
    for tau in sorted({t for t in taus if t is not None}, reverse=True):
        off = WalkFfn(model.ffn, base, model_checksum=model.checksum)
        oracle = NearestNeighbourFfn(off, cfg.n_layers, tau)
        runs = []
        for prompt in prompts:
            runs.append((prompt, generate(ChatSession(model, oracle), prompt)))
        agree, total, same = agreement(runs)
        mean, low = _cosine_summary(oracle.cosines)
        bound = FrontierPoint(None, tau, oracle.lookups, oracle.hits, agree, total, same, len(prompts), mean, low)
        bounds.append(bound)
        log(f"bound tau={tau}: hit rate {100 * bound.hit_rate:.1f}%, agreement {100 * bound.agreement:.1f}%")
    return points, bounds


def format_frontier(model: LoadedModel, top_k: int, points: list[FrontierPoint], bounds: list[FrontierPoint],
                    n_prompts: int) -> list[str]:
    lines = [f"frontier: {model.name}, K={top_k} of {model.config.intermediate}, {n_prompts} prompts in one "
             "process (fresh sessions, shared L2)",
             f"{'design':26s} {'tau':>7s} {'hit rate':>9s} {'lookups':>8s} {'greedy agree':>12s} "
             f"{'same text':>9s} {'hit cos mean/min':>17s}"]

    def row(p: FrontierPoint) -> str:
        name = "NN bound (any key)" if p.is_bound else f"key k'={p.key_width}"
        tau = p.tau_label
        cos = "—" if not math.isfinite(p.mean_cosine) else f"{p.mean_cosine:.4f}/{p.min_cosine:.4f}"
        return (f"{name:26s} {tau:>7s} {_pct(p.hit_rate):>9s} {p.lookups:8d} {_pct(p.agreement):>12s} "
                f"{p.identical:>4d}/{p.generations:<4d} {cos:>17s}")

    by_tau: dict = {}
    for p in points:
        by_tau.setdefault(p.tau, []).append(p)
    for tau, group in by_tau.items():
        lines.extend(row(p) for p in group)
        lines.extend(row(b) for b in bounds if b.tau == tau)
    lines.append("tau exact: no guard, a hit needs the entry's own input (the default); seed: no guard, any entry "
                 "under the key (--feature-set-hits).")
    lines.append("hit rate: decode lookups served from a cache. Greedy agreement: tokens equal to the cache-off "
                 "run. NN bound: every lookup served by the nearest stored input when its cosine reaches tau, the "
                 "most any key design with that guard could hit.")
    return lines
