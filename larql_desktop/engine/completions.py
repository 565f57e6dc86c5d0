"""One completion as a service runs it (the OpenAI-compatible API): a session of its own, stop strings, and what the
FFN cache did for it. No web framework here: the API drives `CompletionRun.step()` one forward pass at a time, so
a scheduler can interleave many requests, and the Qt worker reads the same `cache_counts`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from larql_desktop.engine.cache.stats import StatsSnapshot
from larql_desktop.engine.model.generation import SamplingSettings

# Why a completion ended, in the OpenAI API's words.
FINISH_STOP = "stop"       # a stop token or a stop string
FINISH_LENGTH = "length"   # max tokens or the context limit


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


class StopStrings:
    """Cuts streamed text at the first of some stop strings, which never reach the client: text that could be
    the start of a stop string is held back until the next piece shows whether it is."""

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("a stop string cannot be empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of held + `text` that is certainly reply text; after a stop string, nothing more."""
        if self.stopped:
            return ""
        buffer = self._held + text
        cuts = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return buffer[:min(cuts)]
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """At the natural end: what was held back was reply text after all."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


class PromptTooLong(ValueError):
    pass


@dataclass(frozen=True)
class CompletionResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None     # None: stopped before its end (the client went away)
    cache: CacheCounts


class CompletionRun:
    """One request's completion: a session of its own (its own L1, the engine's current FFN settings, the shared L2
    and L3), advanced one forward pass per `step()`, closed (session released, cache counts taken) by `close()`.

    Not thread-safe by itself: one caller at a time (the API awaits each step before the next).
    """

    def __init__(self, engine, prompt_ids: list[int], settings: SamplingSettings, stop: Sequence[str] = ()):
        limit = engine.model.context_limit
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= limit:
            raise PromptTooLong(f"the prompt is {len(prompt_ids)} tokens but the context holds {limit}")
        self.engine = engine
        self.prompt_tokens = len(prompt_ids)
        self._stop = StopStrings(stop)
        self.session = engine.new_session()
        try:
            self._steps = self.session.generate(prompt_ids, settings)
        except Exception:
            engine.close_session(self.session)
            raise
        self._pieces: list[str] = []        # text the session produced, before stop strings
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._result: CompletionResult | None = None
        self._emitted: list[str] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> str:
        """Run one forward pass (the first one is the prefill) and return the reply text it completed (often ''
        while a UTF-8 sequence or a possible stop string is incomplete). `finished` then says whether it ended."""
        if self.finished or self._result is not None:
            return ""
        try:
            step = next(self._steps)
        except StopIteration:
            self.finish_reason = FINISH_LENGTH
            return self._emit(self._stop.feed(self._tail()) + self._stop.flush())
        if step.is_stop:
            self.finish_reason = FINISH_STOP
            return self._emit(self._stop.feed(self._tail()) + self._stop.flush())
        self.completion_tokens += 1
        self._pieces.append(step.text)
        text = self._stop.feed(step.text)
        if self._stop.stopped:
            self.finish_reason = FINISH_STOP
        return self._emit(text)

    def _tail(self) -> str:
        """Held-back UTF-8 bytes the session flushes when its generator closes."""
        self._steps.close()
        content = self.session.messages[-1]["content"] if self.session.messages else ""
        return content[len("".join(self._pieces)):]

    def _emit(self, text: str) -> str:
        self._emitted.append(text)
        return text

    def close(self) -> CompletionResult:
        """End the completion (at once if it is still running), release the session; idempotent."""
        if self._result is None:
            self._steps.close()
            self.engine.close_session(self.session)
            counts = cache_counts(None, self.engine.session_snapshot(self.session))
            self._result = CompletionResult("".join(self._emitted), self.prompt_tokens, self.completion_tokens,
                                            self.finish_reason, counts)
            # Every client's completion moved the shared statistics: tell the subscribers (the window's monitor),
            # as a walk request does.
            self.engine.note_activity("api")
        return self._result
