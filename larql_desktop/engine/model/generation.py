"""Token generation as a generator: each step yields the token, its text, its timing, the model's top
alternatives at that step and what the FFN cache did in the forward pass the token was sampled from."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from larql_desktop.engine.model.outcomes import LayerOutcome, OutcomeRecorder
from larql_desktop.engine.model.transformer import FfnCall, KvCache, TransformerModel

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 200
ALTERNATIVES = 5            # top tokens reported per step


# The smallest temperature above 0 (greedy): float64's smallest normal number. The sampler shifts logits
# before dividing, so any normal temperature however small is greedy in effect; a subnormal one (1e-310) has
# lost its precision and its reciprocal overflows: refused when the settings are made, not when sampling.
MIN_TEMPERATURE = float(np.finfo(np.float64).tiny)


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int = 256
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    # Beyond OpenAI's names, as llama.cpp has them (0 / 0.0 / 1.0: off). Penalties apply before any choice,
    # greedy included: repeat_penalty to the last `repeat_last_n` tokens of the context (prompt and reply), the
    # OpenAI presence and frequency penalties to the reply's own tokens.
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # A chat's stop strings: the reply ends before the first of them (ChatSession applies them; the OpenAI API
    # passes a request's own `stop` to its CompletionRun instead).
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not 1 <= self.max_tokens <= 1_000_000:
            raise ValueError(f"max tokens must be between 1 and 1000000, not {self.max_tokens}")
        if not (np.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be between 0 and 100, not {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.4g} (a normal "
                             f"float), not {self.temperature:g}")
        if not (np.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top-p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.top_k <= 1_000_000:
            raise ValueError(f"top-k must be between 0 (off) and 1000000, not {self.top_k}")
        if not (np.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min-p must be in [0, 1], not {self.min_p}")
        if not (np.isfinite(self.repeat_penalty) and 0.0 < self.repeat_penalty <= 10.0):
            raise ValueError(f"repeat penalty must be in (0, 10], not {self.repeat_penalty}")
        if not 0 <= self.repeat_last_n <= 1_000_000:
            raise ValueError(f"repeat last n must be between 0 and 1000000, not {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (np.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name.replace('_', ' ')} must be in [-2, 2], not {value}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, not {self.seed!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop strings must be a list of strings")
        object.__setattr__(self, "stop", tuple(self.stop))   # a list from JSON becomes hashable
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, not {len(self.stop)}")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise ValueError(f"a stop string must have 1 to {MAX_STOP_LENGTH} characters")

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, values: Mapping) -> "SamplingSettings":
        """Raises ValueError for unknown names or invalid values (nothing is guessed)."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown sampling settings: {', '.join(sorted(unknown))}")
        return cls(**{k: tuple(v) if k == "stop" else v for k, v in values.items()})


# Presets change how tokens are chosen; max tokens, stop strings and the seed stay the user's.
PRESETS: dict[str, dict] = {
    "Greedy": dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0),
    "Balanced": dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1),
    "Creative": dict(temperature=1.0, top_p=0.95, top_k=100, min_p=0.02, repeat_penalty=1.05),
}


def apply_preset(settings: SamplingSettings, name: str) -> SamplingSettings:
    if name not in PRESETS:
        raise ValueError(f"no sampling preset named {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(settings, **PRESETS[name])


def preset_of(settings: SamplingSettings) -> str | None:
    """The preset these settings match, if any."""
    return next((name for name, values in PRESETS.items()
                 if all(getattr(settings, k) == v for k, v in values.items())), None)


@dataclass(frozen=True)
class Alternative:
    token_id: int
    text: str
    probability: float   # softmax of the model's raw logits at this step (before sampling settings)


@dataclass(frozen=True)
class TokenStep:
    token_id: int
    text: str            # newly completed text (may be empty while a UTF-8 sequence is incomplete)
    index: int           # 0 for the first generated token
    seconds: float       # wall time of the forward pass that produced this token (prefill for index 0)
    prompt_tokens: int   # tokens run in that forward pass
    is_stop: bool        # a stop token (or the token completing a stop string): the reply ends here
    # The model's most likely tokens at this step, most likely first, and what the FFN did per layer in the
    # forward pass whose logits this token was sampled from (empty when not recorded).
    alternatives: tuple[Alternative, ...] = ()
    layers: tuple[LayerOutcome, ...] = ()
    # The sampled token's log probability and the top ones (logprobs.TokenLogprobs), when asked for.
    logprobs: object = None


def top_alternatives(logits: np.ndarray, token_text: Callable[[int], str], n: int = ALTERNATIVES,
                     softmax: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[Alternative, ...]:
    """The n most likely tokens with their softmax probabilities. Runs every step: the top n come from the
    logits (_top_ids), the probabilities from `softmax` (a function of the logits, as OnnxSoftmax.bound()
    gives: 3x faster than numpy's float32 exp on AVX2, within ~5e-5 relative) or else from one numpy pass."""
    z = np.asarray(logits, dtype=np.float32).reshape(-1)
    top = _top_ids(z, n)
    if softmax is not None:
        p = softmax(z)
        probabilities = [float(p[i]) for i in top]
    else:
        peak = float(z[top[0]])
        total = float(np.exp(z - peak).sum())   # numpy's pairwise sum: relative error near 1e-7 here
        probabilities = [float(np.exp(np.float64(z[i]) - peak) / total) for i in top]
    return tuple(Alternative(int(i), token_text(int(i)), p) for i, p in zip(top, probabilities))


TOP_GROUPS = 512            # groups of logits when looking for the top few (see _top_ids)


def _top_ids(z: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest of z (finite, 1-D), largest first, a tie to the lower id, without partitioning the
    whole vocabulary (0.66 ms for Gemma's 262,144 logits, 5% of a decode step): the n-th largest group maximum
    is a floor that at least n values reach (the n group maxima at or above it), so the n largest are among
    the few values at or above it. The groups are strided (id mod TOP_GROUPS): their maxima are one reduction
    over whole rows, 5x faster than one per contiguous block (12 vs 62 us for Gemma's logits)."""
    if z.size <= n:
        return np.argsort(-z, kind="stable")
    rows = -(-z.size // TOP_GROUPS)
    if TOP_GROUPS <= n or rows == 1:
        floor = np.partition(z, z.size - n)[z.size - n]
    else:
        padded = z      # both models' vocabularies fill whole rows: the groups are a view, not a copy
        if z.size % TOP_GROUPS:
            padded = np.full(rows * TOP_GROUPS, -np.inf, np.float32)
            padded[:z.size] = z
        maxima = padded.reshape(rows, TOP_GROUPS).max(axis=0)
        floor = np.partition(maxima, TOP_GROUPS - n)[TOP_GROUPS - n]
    candidates = np.flatnonzero(z >= floor)
    return candidates[np.argsort(-z[candidates], kind="stable")[:n]]


class Sampler:
    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray, context: Sequence[int] = (), reply: Sequence[int] = ()) -> int:
        """The next token from `logits`; `context`: the token ids so far (prompt and reply), `reply`: the
        reply's own (both only read when a penalty is set)."""
        s = self.settings
        if not np.isfinite(logits).all():
            # argmax of NaNs is token 0, often a stop token: the reply would end empty, and look like one.
            raise FloatingPointError("the model computed non-finite logits (a damaged graph or weight file?); "
                                     "no token can be sampled")
        if s.penalised:
            logits = self._penalise(logits, context, reply)
        if s.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64)
        if 0 < s.top_k < z.size:
            cut = np.partition(z, z.size - s.top_k)[z.size - s.top_k]
            z = np.where(z >= cut, z, -np.inf)
        # Shift before dividing: a tiny temperature then sends every other logit to -inf (greedy), never NaN.
        z = (z - z.max()) / s.temperature
        p = np.exp(z)
        p /= p.sum()
        if s.top_p < 1.0:
            order = np.argsort(-p)
            cumulative = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cumulative, s.top_p)) + 1]
            kept = np.zeros_like(p)
            kept[keep] = p[keep]
            p = kept / kept.sum()
        if s.min_p > 0.0:
            p = np.where(p >= s.min_p * p.max(), p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))

    def _penalise(self, logits: np.ndarray, context: Sequence[int], reply: Sequence[int]) -> np.ndarray:
        s = self.settings
        z = logits.astype(np.float64)
        if s.repeat_penalty != 1.0 and s.repeat_last_n and len(context):
            seen = np.unique(np.asarray(context[-s.repeat_last_n:], np.int64))
            z[seen] = np.where(z[seen] > 0, z[seen] / s.repeat_penalty, z[seen] * s.repeat_penalty)
        if (s.presence_penalty or s.frequency_penalty) and len(reply):
            ids, counts = np.unique(np.asarray(reply, np.int64), return_counts=True)
            z[ids] -= counts * s.frequency_penalty + s.presence_penalty
        return z


def decode(model: TransformerModel, kv: KvCache, first_logits: np.ndarray, first_seconds: float,
           first_tokens: int, ffn: FfnCall, settings: SamplingSettings, stop_ids: frozenset[int], decoder,
           context_limit: int, history: list[int], *, token_text: Callable[[int], str] | None = None,
           recorder: OutcomeRecorder | None = None, first_layers: tuple[LayerOutcome, ...] = (),
           logprobs: int | None = None) -> Iterator[TokenStep]:
    """Sample from `first_logits` (the prompt's last position), then decode up to max_tokens.

    `history` (the token ids the KV cache holds) is extended as tokens are consumed. Stops on a stop id
    (yielded with is_stop=True), when `decoder` says it has `stopped` (a stop string: that step, carrying the
    text before it, has is_stop=True), at max_tokens, or when the context is full. With `token_text`, each step
    carries the top alternatives; with `recorder` (attached to `ffn`), the per-layer FFN outcomes of the
    forward pass (`first_layers` for the prompt's pass). With `logprobs` (0..20), each step carries the sampled
    token's log probability and that many most likely tokens' (logprobs.TokenLogprobs).
    """
    if logprobs is not None:
        from larql_desktop.engine.model.logprobs import token_logprobs   # it imports this module
    sampler = Sampler(settings)
    logits, seconds, ran, layers = first_logits, first_seconds, first_tokens, first_layers
    # The model's softmax graph when it has one (its buffer is this reply's: replies run on several threads).
    softmax = model.softmax.bound() if token_text is not None and model.softmax is not None else None
    reply: list[int] = []
    for index in range(settings.max_tokens):
        token = sampler(logits, history, reply) if settings.penalised else sampler(logits)
        reply.append(token)
        stop = token in stop_ids
        text = "" if stop else decoder.feed(token)
        stop = stop or getattr(decoder, "stopped", False)
        alternatives = top_alternatives(logits, token_text, softmax=softmax) if token_text is not None else ()
        chosen = token_logprobs(logits, token, logprobs) if logprobs is not None else None
        yield TokenStep(token, text, index, seconds, ran, stop, alternatives, layers, chosen)
        if stop or index + 1 == settings.max_tokens or kv.length + 1 >= context_limit:
            return
        started = time.perf_counter()
        if recorder is not None:
            recorder.start()
        logits = model.forward([token], kv, ffn)[-1]
        layers = recorder.take() if recorder is not None else ()
        history.append(token)
        seconds, ran = time.perf_counter() - started, 1


def greedy(model: TransformerModel, ids: Sequence[int], ffn: FfnCall, kv: KvCache | None = None,
           context_limit: int | None = None) -> Iterator[int]:
    """Greedy tokens after the prompt `ids`, one at a time: the prompt runs on the first `next()`, every later
    token costs one decode forward, run only when it is asked for (so `islice(greedy(...), n)` runs n - 1 decode
    steps). Stops when the context is full. The one greedy loop of the project: bench, measure, INSERT and the
    reference check all read from it."""
    kv = kv if kv is not None else KvCache(model.config)
    logits = model.forward(list(ids), kv, ffn)[-1]
    while True:
        token = int(np.argmax(logits))
        yield token
        if context_limit is not None and kv.length + 1 >= context_limit:
            return
        logits = model.forward([token], kv, ffn)[-1]
