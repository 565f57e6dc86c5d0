"""Serving like an inference server, through the real `openai` client against a real server on loopback over the real
SmolLM2: logprobs (plain and streamed, equal to a log-softmax of the engine's own logits), the KV prefix cache shared by
every request (bit-identical to recomputing, invalidated by patches, bounded in bytes) and chunked prefill."""
from __future__ import annotations

import numpy as np
import openai
import pytest

from larql_desktop.api.server import start_server
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture
def served(smollm2):
    engine = LarqlEngine(smollm2, walk=WalkSettings())
    handle = start_server(engine, "127.0.0.1", 0)
    yield engine, handle
    handle.stop()


def _client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="anything", max_retries=0, timeout=300)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    shifted = z - z.max()
    return shifted - np.log(np.exp(shifted).sum())


def _greedy_logprobs(engine, ids: list[int], steps: int) -> list[np.ndarray]:
    """The log-softmax of the engine's logits at the prompt's end and after each greedy token (a session of its
    own, the same FFN settings): what the server must report."""
    session = engine.new_session()
    try:
        model = engine.model.transformer
        kv = KvCache(engine.model.config)
        logits = model.forward(ids, kv, session.ffn)[-1]
        out = []
        for _ in range(steps):
            out.append(_log_softmax(logits))
            logits = model.forward([int(np.argmax(logits))], kv, session.ffn)[-1]
        return out
    finally:
        engine.close_session(session)


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.piece_bytes(token_id, special=True).decode("utf-8", errors="replace")


def _check_chat_logprobs(engine, content: list, top_n: int) -> None:
    tok = engine.model.tokenizer
    expected = _greedy_logprobs(engine, engine.model.encode_prompt(QUESTION), len(content))
    for entry, lp in zip(content, expected, strict=True):
        chosen = int(np.argmax(lp))
        assert entry.token == _text(tok, chosen) and entry.bytes == list(tok.piece_bytes(chosen, special=True))
        assert entry.logprob == pytest.approx(lp[chosen], abs=1e-6)
        top = np.argsort(-lp, kind="stable")[:top_n]
        assert [t.token for t in entry.top_logprobs] == [_text(tok, int(i)) for i in top]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], lp[top], atol=1e-6)


def test_chat_logprobs_plain_and_streamed_equal_the_engines_log_softmax(served):
    engine, handle = served
    client = _client(handle)
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=8,
                                           logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    _check_chat_logprobs(engine, content, 5)
    # The sampling settings do not change the reported distribution (it is the raw logits'), only the choice.
    hot = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=1.5, top_p=0.5,
                                         max_tokens=1, logprobs=True, top_logprobs=3, seed=1)
    assert [t.logprob for t in hot.choices[0].logprobs.content[0].top_logprobs] == \
        [t.logprob for t in content[0].top_logprobs[:3]]

    streamed = []
    for chunk in client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=8,
                                                logprobs=True, top_logprobs=5, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

    plain = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=4)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="smollm2", messages=QUESTION, logprobs=True, top_logprobs=21)


def test_completion_logprobs_plain_and_streamed_equal_the_engines_log_softmax(served):
    engine, handle = served
    client = _client(handle)
    tok = engine.model.tokenizer
    prompt = "The three primary colours are"
    reply = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=6, logprobs=4)
    lps = reply.choices[0].logprobs
    n = reply.usage.completion_tokens
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == len(lps.text_offset) == n
    expected = _greedy_logprobs(engine, tok.encode(prompt), n)
    for i, lp in enumerate(expected):
        chosen = int(np.argmax(lp))
        assert lps.tokens[i] == _text(tok, chosen)
        assert lps.token_logprobs[i] == pytest.approx(lp[chosen], abs=1e-6)
        top = np.argsort(-lp, kind="stable")[:4]
        assert list(lps.top_logprobs[i]) == [_text(tok, int(t)) for t in top]
        np.testing.assert_allclose(list(lps.top_logprobs[i].values()), lp[top], atol=1e-6)
    assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)
    assert reply.choices[0].text.startswith(lps.tokens[0])

    tokens, logprobs = [], []
    for chunk in client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=6,
                                           logprobs=4, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lps.tokens and logprobs == lps.token_logprobs
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="smollm2", prompt=prompt, logprobs=25)
