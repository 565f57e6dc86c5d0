"""A chat session: its messages, its KV cache and the FFN it runs through (with its own L1 cache and statistics).

Above the cache and the loader: the engine core makes one per chat tab and per API request."""
from __future__ import annotations

import time
from typing import Callable, Generator, Hashable, Sequence

import numpy as np

from larql_desktop.engine.cache.stats import CacheStats
from larql_desktop.engine.cache.tiers import CacheTier
from larql_desktop.engine.cache.walk import WalkFfn
from larql_desktop.engine.model.generation import SamplingSettings, TokenStep, decode
from larql_desktop.engine.model.stops import StopStringDecoder
from larql_desktop.engine.model.outcomes import LayerOutcome, OutcomeRecorder
from larql_desktop.engine.model.prefix_cache import PrefillSchedule, PrefixCache
from larql_desktop.engine.model.transformer import FfnCall, KvCache
from larql_desktop.engine.formats.tokenizer import StreamDecoder
from larql_desktop.engine.loading import LoadedModel, conversation

ROLES = ("user", "assistant")
# Positions per prefill pass, at multiples of it: a server runs other requests' steps between chunks, and the prefix
# cache reuses whole chunks (prefix_cache.py says why). Small enough that a shared prefix is reused nearly whole,
# large enough that a pass keeps the kernels' efficiency.
PREFILL_CHUNK = 64


def checked_messages(messages: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """A saved conversation's (role, content) pairs, or ValueError naming the first that is not a chat turn."""
    for role, content in messages:
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"a saved chat message has role {role!r}; expected one of {', '.join(ROLES)}")
    return tuple((role, content) for role, content in messages)


class ReplyStream:
    """A reply being generated: iterating it runs the model a token at a time (TokenSteps); `close()` ends it
    early. `text` is the reply as the session stored it, final (with any held-back UTF-8 tail or stop-string
    prefix settled) once `ended`: the reply's result, so nobody has to read it back from the session's messages."""

    def __init__(self) -> None:
        self.text = ""
        self.ended = False
        self._steps: Generator[TokenStep, None, None] | None = None

    def __iter__(self) -> "ReplyStream":
        return self

    def __next__(self) -> TokenStep:
        assert self._steps is not None
        return next(self._steps)

    def run(self, steps: Generator[TokenStep, None, None]) -> "ReplyStream":
        """Iterate `steps` (the session's generator, which settles `text` and `ended` as it ends)."""
        self._steps = steps
        return self

    def close(self) -> None:
        """End the reply where it is (the session keeps what was generated); harmless once it has ended."""
        assert self._steps is not None
        self._steps.close()


class ChatSession:
    def __init__(self, model: LoadedModel, ffn: FfnCall | None = None, l1: CacheTier | None = None,
                 stats: CacheStats | None = None, prefix_cache: PrefixCache | None = None,
                 kv_namespace: Callable[[FfnCall], Hashable | None] | None = None,
                 prefill: PrefillSchedule | None = None):
        self.model = model
        # The engine's shared KV prefix cache, and what names the KV an FFN computes (None: not shareable).
        self.prefix_cache = prefix_cache
        self.kv_namespace = kv_namespace
        # Where prompts are cut into passes (the engine's, for every session sharing its prefix cache).
        self.prefill = prefill or PrefillSchedule.for_template(PREFILL_CHUNK, model.template_head,
                                                                model.template_cue)
        self.exact_length = 0           # leading KV positions bit-identical to a cold prefill of `history`
        self.reused_tokens = 0          # positions the latest prefill took from the prefix cache
        self._prefill_ran = 0           # positions the latest prefill ran
        self.ffn = ffn or model.ffn
        self.l1 = l1          # this session's own cache tier (None without a cache engine)
        self.stats = stats    # this session's statistics
        self.messages: list[dict] = []
        # None: the chat template's own default (SmolLM2's names the assistant); "" an explicitly empty one.
        self.system_prompt: str | None = None
        self.kv = KvCache(model.config)
        self.history: list[int] = []   # token ids the KV cache holds
        # Next-token logits at the end of the last prompt (and the FFN outcomes of that pass), so a regeneration
        # starts from exactly the same state (re-running the last prompt token alone would differ from the
        # batched prefill by rounding).
        # The prompt's ids, logits, per-layer outcomes and the walk's pass_end() (cache/stepper.py): a regenerate starts from them.
        self._prompt_logits: tuple[tuple[int, ...], np.ndarray | None, tuple[LayerOutcome, ...], object] | None = None
        self.outcomes = OutcomeRecorder()   # per-layer outcomes of each forward pass, for the token view

    def reset(self) -> None:
        """Start a new conversation in this session; its L1 cache and statistics are kept."""
        self.messages.clear()
        self.kv.truncate(0)
        self.history.clear()
        self.exact_length = 0
        self._prompt_logits = None

    def restore(self, messages: Sequence[tuple[str, str]], system_prompt: str | None = None) -> None:
        """Continue a saved conversation: the messages (role, content) and system prompt become this session's.
        The KV cache keeps whatever prefix still matches, so continuing the live chat costs nothing."""
        self.messages[:] = [{"role": role, "content": content} for role, content in checked_messages(messages)]
        self.system_prompt = system_prompt

    def transcript(self) -> tuple[tuple[str, str], ...]:
        """The conversation as (role, content) pairs: what `restore` takes back (on another model, say)."""
        return tuple((m["role"], m["content"]) for m in self.messages)

    def conversation(self, messages: list[dict] | None = None) -> list[dict]:
        """What the chat template renders: the system prompt (if set and the model is a chat model), then turns."""
        return conversation(self.model, self.messages if messages is None else messages, self.system_prompt)

    def _generate_for(self, ids: list[int], settings: SamplingSettings, logprobs: int | None = None,
                      alternatives: bool = True) -> ReplyStream:
        result = ReplyStream()
        return result.run(self._reply_steps(ids, settings, logprobs, result, alternatives))

    def _reply_steps(self, ids: list[int], settings: SamplingSettings, logprobs: int | None,
                     result: ReplyStream, alternatives: bool = True) -> Generator[TokenStep, None, None]:
        tok = self.model.tokenizer
        decoder: StreamDecoder | StopStringDecoder = tok.stream_decoder()
        if settings.stop:
            decoder = StopStringDecoder(decoder, settings.stop)
        reply: list[str] = []
        self.messages.append({"role": "assistant", "content": ""})
        recorder = self.outcomes
        if isinstance(self.ffn, WalkFfn):   # again each reply: reconfiguring the engine rebuilds the session's walk
            self.ffn.add_observer(recorder)
        try:
            started = time.perf_counter()
            saved = self._prompt_logits
            ran = 0
            if saved is None or saved[0] != tuple(ids) or self.history[:len(ids)] != ids:
                for _ in self.prefill_steps(ids):
                    pass
                saved = self._prompt_logits
                ran = self._prefill_ran
            else:                                        # a regenerate: the prompt's pass is kept
                self.kv.truncate(len(ids))
                del self.history[len(ids):]
                self.exact_length = min(self.exact_length, len(ids))
                if isinstance(self.ffn, WalkFfn):   # the steps follow the prompt's pass again
                    self.ffn.stepper.continue_after(saved[3])
            assert saved is not None and saved[1] is not None   # prefill_steps always leaves the prompt's logits
            logits, layers = saved[1], saved[2]
            for step in decode(self.model.transformer, self.kv, logits, time.perf_counter() - started, ran,
                               self.ffn, settings, tok.stop_ids, decoder, self.model.context_limit, self.history,
                               token_text=self._token_text if alternatives else None, recorder=recorder,
                               first_layers=layers,
                               logprobs=logprobs):
                reply.append(step.text)
                self.messages[-1]["content"] = "".join(reply)
                yield step
        finally:
            result.text = self.messages[-1]["content"] = "".join(reply) + decoder.flush()
            result.ended = True

    def prefill_steps(self, ids: list[int], pause: Callable[[int], bool] | None = None
                      ) -> Generator[int, None, None]:
        """Run the prompt `ids` into the KV cache, one chunk of the prefill schedule per `next()`
        (a server interleaves other requests' steps between them), yielding the positions still to run (0 after the
        last chunk); a reply to `ids` then starts from its logits without running anything. Reuses the KV cache's
        own longest common prefix, or a longer one from the shared prefix cache, and stores the prompt there when
        its whole chunks (those a cold prefill of `ids` computes the same way, bit for bit).

        `pause(positions still to run, this chunk's included)`, asked between the layers of a chunk: True stops
        the chunk there, to go on at the next `next()` (a server serves a newly arrived short prompt first rather
        than make it wait for the rest of a long one's chunk). A chunk stops at most once, so a long prompt still
        advances by a chunk every two steps; a stopped chunk runs the same graph calls on the same inputs as one
        that was not (the same bits)."""
        ffn = self.ffn                      # one FFN for the whole prompt, even if the engine rebinds meanwhile
        common = 0
        for a, b in zip(self.history, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)    # at least one position runs: its logits start the reply
        # Whole chunks only: a cut one was computed beside other tokens.
        exact = self.prefill.floor(min(self.exact_length, common), ids)
        prefix_cache = self.prefix_cache
        namespace = self.kv_namespace(ffn) if self.kv_namespace is not None and prefix_cache is not None else None
        self.reused_tokens = 0
        if namespace is not None and prefix_cache is not None:
            hit = prefix_cache.longest(namespace, ids, self.prefill)
            if hit is not None and hit.length > common:
                hit.copy_into(self.kv)
                self.history[:] = ids[:hit.length]
                common = exact = self.reused_tokens = hit.length
        self.kv.truncate(common)
        del self.history[common:]
        self._prompt_logits = None
        recorder = self.outcomes
        if isinstance(ffn, WalkFfn):
            ffn.add_observer(recorder)
        logits = None
        for start, stop in self.prefill.chunks(common, len(ids), ids):
            recorder.start()
            passing = self.model.transformer.forward_by_layer(ids[start:stop], self.kv, ffn)
            stopped = False
            while True:
                try:
                    next(passing)
                except StopIteration as done:
                    logits = done.value[-1]
                    break
                if pause is not None and not stopped and pause(len(ids) - start):
                    stopped = True
                    yield len(ids) - start
            self.history.extend(ids[start:stop])
            if stop < len(ids):
                yield len(ids) - stop
        layers = recorder.take()
        # Whole chunks run as a cold prefill runs them, after exact positions only, are exact (the last, partial
        # one is not: a longer prompt runs those positions in a whole chunk).
        whole = self.prefill.floor(len(ids), ids)
        self.exact_length = whole if exact == common and self.prefill.floor(common, ids) == common else exact
        self._prefill_ran = len(ids) - common
        self._prompt_logits = (tuple(ids), logits, layers,
                               ffn.stepper.pass_end() if isinstance(ffn, WalkFfn) else None)
        if namespace is not None and prefix_cache is not None and self.exact_length > common:
            prefix_cache.store(namespace, ids[:self.exact_length], self.kv)
        yield 0

    def _token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id], special=True)

    def reply(self, user_text: str, settings: SamplingSettings) -> ReplyStream:
        """Add a user turn and stream the assistant's reply. Nothing is added if the prompt is refused."""
        if not user_text.strip():
            raise ValueError("the prompt is empty: type something to send")
        ids = self.model.encode_prompt(self.conversation(self.messages + [{"role": "user", "content": user_text}]))
        self._check_fits(ids)
        self.messages.append({"role": "user", "content": user_text})
        return self._generate_for(ids, settings)

    def generate(self, ids: list[int], settings: SamplingSettings, logprobs: int | None = None,
                 alternatives: bool = False) -> ReplyStream:
        """Stream a reply to a prompt the caller has already rendered and tokenised (the OpenAI-compatible API
        renders the client's messages, or takes raw completion text). Refused, changing nothing, if too long.
        `logprobs` (0..20): each step carries its token's log probability and that many alternatives'.
        `alternatives`: each step also carries the top alternatives the window's token view shows (a softmax
        and five token texts per step, in each batched row's serial share of the step: the API sends none)."""
        if not ids:
            raise ValueError("the prompt is empty")
        self._check_fits(ids)
        return self._generate_for(list(ids), settings, logprobs, alternatives)

    def regenerate(self, settings: SamplingSettings) -> ReplyStream:
        """Drop the last reply and generate it again from the same context."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("there is no reply to regenerate")
        ids = self.model.encode_prompt(self.conversation(self.messages[:-1]))
        self._check_fits(ids)
        self.messages.pop()
        return self._generate_for(ids, settings)

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.model.context_limit:
            raise ValueError(f"the prompt is {len(ids)} tokens but the context holds {self.model.context_limit}; "
                             "shorten it or start a new chat")
