"""A chat session: its messages, its KV cache and the FFN it runs through (later, its own L1 cache)."""
from __future__ import annotations

from typing import Iterator

from .generation import SamplingSettings, TokenStep, generate
from .model import FfnCall, KvCache
from .runtime import LoadedModel


class ChatSession:
    def __init__(self, model: LoadedModel, ffn: FfnCall | None = None):
        self.model = model
        self.ffn = ffn or model.ffn
        self.messages: list[dict] = []
        self.kv = KvCache(model.config)
        self.history: list[int] = []   # token ids the KV cache holds

    def _generate_for(self, ids: list[int], settings: SamplingSettings) -> Iterator[TokenStep]:
        # Reuse the KV cache for the longest common prefix; at least one token must run to get logits.
        common = 0
        for a, b in zip(self.history, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        self.kv.truncate(common)
        del self.history[common:]
        tok = self.model.tokenizer
        decoder = tok.stream_decoder()
        reply: list[str] = []
        self.messages.append({"role": "assistant", "content": ""})
        try:
            for step in generate(self.model.transformer, self.kv, ids[common:], self.ffn, settings,
                                 tok.stop_ids, decoder, self.model.context_limit, self.history):
                reply.append(step.text)
                self.messages[-1]["content"] = "".join(reply)
                yield step
        finally:
            tail = decoder.flush()
            self.messages[-1]["content"] = "".join(reply) + tail

    def reply(self, user_text: str, settings: SamplingSettings) -> Iterator[TokenStep]:
        """Add a user turn and stream the assistant's reply. Nothing is added if the prompt is refused."""
        if not user_text.strip():
            raise ValueError("the prompt is empty: type something to send")
        ids = self.model.encode_prompt(self.messages + [{"role": "user", "content": user_text}])
        if len(ids) >= self.model.context_limit:
            raise ValueError(f"the prompt is {len(ids)} tokens but the context holds {self.model.context_limit}; "
                             "shorten it or start a new chat")
        self.messages.append({"role": "user", "content": user_text})
        return self._generate_for(ids, settings)

    def regenerate(self, settings: SamplingSettings) -> Iterator[TokenStep]:
        """Drop the last reply and generate it again from the same context."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("there is no reply to regenerate")
        self.messages.pop()
        return self._generate_for(self.model.encode_prompt(self.messages), settings)
