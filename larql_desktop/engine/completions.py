"""One completion as a service runs it (the OpenAI-compatible API): a session of its own, stop strings, and what the
FFN cache did for it. No web framework here: the API drives `CompletionRun.step()` one forward pass at a time, so
a scheduler can interleave many requests. What the cache did is counted by `cache.stats.cache_counts`, as the Qt
worker counts a reply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from larql_desktop.engine.cache.stats import CacheCounts, cache_counts
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.graphs.batched import OnnxBatchedDecoder
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.model.batch import BatchRow, DecodeBatch
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.model.stops import StopStrings

# Why a completion ended, in the OpenAI API's words.
FINISH_STOP = "stop"       # a stop token or a stop string
FINISH_LENGTH = "length"   # max tokens or the context limit


DEFAULT_BATCH_ROWS = 8      # replies decoding together at most (more decode on their own, in turns)


class PromptTooLong(ValueError):
    pass


def decode_batch(model: LoadedModel, max_rows: int = DEFAULT_BATCH_ROWS) -> DecodeBatch | None:
    """A DecodeBatch over `model`'s batched decoder graph (exported beside its other graphs on first use), or None
    for a model without decoder graphs (the numpy reference) or `max_rows` 0."""
    batched = batched_decoder(model)
    if batched is None or max_rows == 0:
        return None
    return DecodeBatch(model.transformer, batched, max_rows)


def batched_decoder(model: LoadedModel) -> OnnxBatchedDecoder | None:
    """`model`'s batched decoder graphs (exported beside its other graphs on first use), or None for a model
    without decoder graphs (the numpy reference)."""
    decoder = model.transformer.decoder
    if decoder is None:
        return None
    return OnnxBatchedDecoder(model.gguf, model.config, model.checksum, decoder.directory.parent, model.threads)


@dataclass(frozen=True)
class CompletionResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None     # None: stopped before its end (the client went away)
    cache: CacheCounts
    cached_tokens: int = 0        # prompt positions reused from the KV prefix cache (they ran no FFN)


class CompletionRun:
    """One request's completion: a session of its own (its own L1, the engine's current FFN settings, the shared L2
    and L3), advanced one forward pass per `step()`, closed (session released, cache counts taken) by `close()`.

    Not thread-safe by itself: one caller at a time (the API awaits each step before the next).
    """

    def __init__(self, engine: LarqlEngine, prompt_ids: list[int], settings: SamplingSettings, stop: Sequence[str] = (),
                 logprobs: int | None = None, batch: DecodeBatch | None = None,
                 pause: Callable[[int], bool] | None = None):
        limit = engine.model.context_limit
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= limit:
            raise PromptTooLong(f"the prompt is {len(prompt_ids)} tokens but the context holds {limit}")
        self.engine = engine
        self.prompt_tokens = len(prompt_ids)
        self.wants_logprobs = logprobs is not None
        self.cached_tokens = 0          # prompt positions reused from the engine's KV prefix cache
        self._stop = StopStrings(stop)
        self.session = engine.new_session()
        try:
            self._steps = self.session.generate(prompt_ids, settings, logprobs)
        except Exception:
            engine.close_session(self.session)
            raise
        # The prompt runs in chunks, one per step, before the first token is sampled (no forward pass of its own);
        # `pause` may stop a chunk between two layers (ChatSession.prefill_steps), which then ends its step.
        self._prefill: Generator[int, None, None] | None = self.session.prefill_steps(list(prompt_ids), pause)
        self.started = False                # a step has run (the scheduler favours a request's first step)
        self._pieces: list[str] = []        # text the session produced, before stop strings
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._result: CompletionResult | None = None
        self._emitted: list[str] = []
        # With `logprobs`: (TokenLogprobs, offset of its text in the reply before stop strings) per reply token.
        self.logprobs: list[tuple[object, int]] = []
        self._logprobs_taken = 0
        self._text_length = 0
        # With `batch`: the reply decodes in a row of it once its prompt has run, if its FFN is one the batch
        # computes and a row is free (`row`); its steps are then the batch's to run (DecodeBatch.step).
        self._batch = batch
        self.row: BatchRow | None = None

    def take_logprobs(self) -> list[tuple[object, int]]:
        """The reply tokens' logprobs not taken yet (a stream sends each with the chunk after its token)."""
        new = self.logprobs[self._logprobs_taken:]
        self._logprobs_taken = len(self.logprobs)
        return new

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Whether the next step runs (the rest of) the prompt."""
        return self._prefill is not None and not self.finished

    def step(self) -> str:
        """Run one forward pass (the first ones are the prompt's prefill chunks, or parts of a chunk `pause`
        stopped, which return '') and return the reply text it completed (often '' while a UTF-8 sequence or a
        possible stop string is incomplete). `finished` then says whether it ended."""
        if self.finished or self._result is not None:
            return ""
        self.started = True
        if self._prefill is not None:
            if next(self._prefill):
                return ""                       # more of the prompt to run: other requests' turns first
            self._prefill = None
            self.cached_tokens = self.session.reused_tokens
            if self._batch is not None and self._batch.can_join(self.session.ffn):
                self.row = self._batch.join(self.session)
        try:
            step = next(self._steps)
        except StopIteration:
            self.finish_reason = FINISH_LENGTH
            return self._emit(self._stop.feed(self._tail()) + self._stop.flush())
        if step.is_stop:
            self.finish_reason = FINISH_STOP
            return self._emit(self._stop.feed(self._tail()) + self._stop.flush())
        self.completion_tokens += 1
        if step.logprobs is not None:
            self.logprobs.append((step.logprobs, self._text_length))
        self._pieces.append(step.text)
        self._text_length += len(step.text)
        text = self._stop.feed(step.text)
        if self._stop.stopped:
            self.finish_reason = FINISH_STOP
        return self._emit(text)

    def _tail(self) -> str:
        """Held-back UTF-8 bytes the session flushes when its generator closes."""
        self._steps.close()
        return self._steps.text[len("".join(self._pieces)):]   # the reply's final text, as the session ended it

    def _emit(self, text: str) -> str:
        self._emitted.append(text)
        return text

    def close(self) -> CompletionResult:
        """End the completion (at once if it is still running), release the session; idempotent."""
        if self._result is None:
            if self._prefill is not None:
                self._prefill.close()
            self._steps.close()
            if self.row is not None:
                self.row.batch.leave(self.row)     # the row is free for another reply at once
            self.engine.close_session(self.session)
            counts = cache_counts(None, self.engine.session_snapshot(self.session))
            self._result = CompletionResult("".join(self._emitted), self.prompt_tokens, self.completion_tokens,
                                            self.finish_reason, counts, self.cached_tokens)
            # Every client's completion moved the shared statistics: tell the subscribers (the window's monitor),
            # as a walk request does.
            self.engine.note_activity("api")
        return self._result
