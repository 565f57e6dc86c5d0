"""One completion as a service runs it (the OpenAI-compatible API): a session of its own, stop strings, and what the
FFN cache did for it. No web framework here: the API drives `CompletionRun.step()` one forward pass at a time, so
a scheduler can interleave many requests. What the cache did is counted by `cache.stats.cache_counts`, as the Qt
worker counts a reply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from larql_desktop.engine.cache.stats import CacheCounts, cache_counts
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.model.stops import StopStrings

# Why a completion ended, in the OpenAI API's words.
FINISH_STOP = "stop"       # a stop token or a stop string
FINISH_LENGTH = "length"   # max tokens or the context limit


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

    def __init__(self, engine: LarqlEngine, prompt_ids: list[int], settings: SamplingSettings, stop: Sequence[str] = ()):
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
        return self._result
