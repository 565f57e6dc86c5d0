"""A chat session: its messages, its KV cache and the FFN it runs through (with its own L1 cache)."""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from larql_desktop.engine.cache.walk import CacheStats, CacheTier
from larql_desktop.engine.model.generation import SamplingSettings, TokenStep, decode
from larql_desktop.engine.model.transformer import FfnCall, KvCache
from larql_desktop.engine.loading import LoadedModel


class ChatSession:
    def __init__(self, model: LoadedModel, ffn: FfnCall | None = None, l1: CacheTier | None = None,
                 stats: CacheStats | None = None):
        self.model = model
        self.ffn = ffn or model.ffn
        self.l1 = l1          # this session's own cache tier (None without a cache engine)
        self.stats = stats    # this session's statistics
        self.messages: list[dict] = []
        self.kv = KvCache(model.config)
        self.history: list[int] = []   # token ids the KV cache holds
        # Next-token logits at the end of the last prompt, so a regeneration starts from exactly the same
        # state (re-running the last prompt token alone would differ from the batched prefill by rounding).
        self._prompt_logits: tuple[tuple[int, ...], np.ndarray] | None = None

    def reset(self) -> None:
        """Start a new conversation in this session; its L1 cache and statistics are kept."""
        self.messages.clear()
        self.kv.truncate(0)
        self.history.clear()
        self._prompt_logits = None

    def _generate_for(self, ids: list[int], settings: SamplingSettings) -> Iterator[TokenStep]:
        tok = self.model.tokenizer
        decoder = tok.stream_decoder()
        reply: list[str] = []
        self.messages.append({"role": "assistant", "content": ""})
        try:
            started = time.perf_counter()
            saved = self._prompt_logits
            if saved is not None and saved[0] == tuple(ids) and self.history[:len(ids)] == ids:
                self.kv.truncate(len(ids))
                del self.history[len(ids):]
                logits, ran = saved[1], 0
            else:
                # Reuse the KV cache for the longest common prefix; at least one token must run.
                common = 0
                for a, b in zip(self.history, ids):
                    if a != b:
                        break
                    common += 1
                common = min(common, len(ids) - 1)
                self.kv.truncate(common)
                del self.history[common:]
                logits = self.model.transformer.forward(ids[common:], self.kv, self.ffn)[-1]
                self.history.extend(ids[common:])
                ran = len(ids) - common
                self._prompt_logits = (tuple(ids), logits)
            for step in decode(self.model.transformer, self.kv, logits, time.perf_counter() - started, ran,
                               self.ffn, settings, tok.stop_ids, decoder, self.model.context_limit, self.history):
                reply.append(step.text)
                self.messages[-1]["content"] = "".join(reply)
                yield step
        finally:
            self.messages[-1]["content"] = "".join(reply) + decoder.flush()

    def reply(self, user_text: str, settings: SamplingSettings) -> Iterator[TokenStep]:
        """Add a user turn and stream the assistant's reply. Nothing is added if the prompt is refused."""
        if not user_text.strip():
            raise ValueError("the prompt is empty: type something to send")
        ids = self.model.encode_prompt(self.messages + [{"role": "user", "content": user_text}])
        self._check_fits(ids)
        self.messages.append({"role": "user", "content": user_text})
        return self._generate_for(ids, settings)

    def generate(self, ids: list[int], settings: SamplingSettings) -> Iterator[TokenStep]:
        """Stream a reply to a prompt the caller has already rendered and tokenised (the OpenAI-compatible API
        renders the client's messages, or takes raw completion text). Refused, changing nothing, if too long."""
        if not ids:
            raise ValueError("the prompt is empty")
        self._check_fits(ids)
        return self._generate_for(list(ids), settings)

    def regenerate(self, settings: SamplingSettings) -> Iterator[TokenStep]:
        """Drop the last reply and generate it again from the same context."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("there is no reply to regenerate")
        self.messages.pop()
        return self._generate_for(self.model.encode_prompt(self.messages), settings)

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.model.context_limit:
            raise ValueError(f"the prompt is {len(ids)} tokens but the context holds {self.model.context_limit}; "
                             "shorten it or start a new chat")
