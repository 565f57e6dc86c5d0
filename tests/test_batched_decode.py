"""Batched decode (engine/model/batch.py, graphs/batched.py) through a real server on loopback and the real `openai`
client: concurrent greedy replies decode together in one forward pass per step and equal the same replies decoded
alone (one at a time, the single-path decoder); a client that goes away frees its batch row; the walk, which the
batch does not compute, keeps decoding on its own."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from larql_desktop.api.server import start_server
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from polling import wait_for

QUESTIONS = ["How many legs does a spider have?", "Name three colours of the rainbow.",
             "What is the boiling point of water?", "Write a haiku about the sea.",
             "Why is the sky blue?", "Give me a fact about the moon."]


@pytest.fixture
def dense_servers(smollm2):
    """One engine with the dense FFN, served twice: with the decode batch and without it (replies in turns, the
    single path)."""
    engine = LarqlEngine(smollm2, walk=WalkSettings(dense=True))
    batched = start_server(engine, "127.0.0.1", 0)
    alone = start_server(engine, "127.0.0.1", 0, batch_rows=0)
    yield engine, batched, alone
    batched.stop()
    alone.stop()


def _client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="anything", max_retries=0, timeout=300)


def _batch(handle) -> dict:
    return httpx.get(f"{handle.url}/v1/cache-stats", timeout=30).json()["batch"]


def _concurrently(count: int, fn) -> list:
    """fn(i) for i in range(count), each in a thread of its own, all started together; their results."""
    results: list = [None] * count
    errors: list[str] = []
    start = threading.Barrier(count)

    def one(i: int) -> None:
        try:
            start.wait()
            results[i] = fn(i)
        except Exception as exc:      # reported below: a thread's assertion would be lost
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return results


def test_concurrent_greedy_replies_equal_the_replies_alone(dense_servers):
    engine, batched, alone = dense_servers
    tokens = 40

    def ask(handle, i: int, stream: bool) -> tuple[str, list[float]]:
        messages = [{"role": "user", "content": QUESTIONS[i]}]
        if not stream:
            reply = _client(handle).chat.completions.create(model="smollm2", messages=messages, max_tokens=tokens,
                                                            temperature=0, logprobs=True)
            return reply.choices[0].message.content, [t.logprob for t in reply.choices[0].logprobs.content]
        text, logprobs = "", []
        for chunk in _client(handle).chat.completions.create(model="smollm2", messages=messages, max_tokens=tokens,
                                                             temperature=0, logprobs=True, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].logprobs:
                logprobs += [t.logprob for t in chunk.choices[0].logprobs.content]
        return text, logprobs

    solo = [ask(alone, i, stream=False) for i in range(len(QUESTIONS))]
    assert _batch(alone) is None
    before = _batch(batched)
    together = _concurrently(len(QUESTIONS), lambda i: ask(batched, i, stream=i % 2 == 1))
    after = _batch(batched)

    # Token for token the same replies (texts and every token's log probability: on this host the batched rows'
    # logits are bit-identical to the single path's).
    assert [text for text, _ in together] == [text for text, _ in solo]
    assert [len(lp) for _, lp in together] == [len(lp) for _, lp in solo]
    for (_, got), (_, want) in zip(together, solo):
        assert got == pytest.approx(want, abs=1e-4)
    # They decoded together: every reply joined a row, and the batched calls computed more than one row each.
    joined = after["joined"] - before["joined"]
    steps, row_steps = after["steps"] - before["steps"], after["row_steps"] - before["row_steps"]
    assert joined == len(QUESTIONS)
    assert row_steps > steps > 0
    assert after["solo_steps"] == before["solo_steps"]
    assert after["rows_in_use"] == 0 and after["left"] - before["left"] == joined
    assert engine.sessions == []


def test_a_disconnecting_client_frees_its_row_and_the_others_go_on(dense_servers):
    engine, batched, _ = dense_servers
    before = _batch(batched)
    client = _client(batched)
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=500, temperature=0, stream=True)
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
            if received == 3:
                break
    assert _batch(batched)["rows_in_use"] == 1
    stream.close()            # the client goes away mid-reply
    assert wait_for(lambda: _batch(batched)["rows_in_use"] == 0)
    after = _batch(batched)
    assert after["left"] - before["left"] == 1 == after["joined"] - before["joined"]
    assert wait_for(lambda: engine.sessions == [])
    # It stopped decoding: far fewer rows were computed than the 500 tokens it asked for.
    assert after["row_steps"] - before["row_steps"] < 250
    # The batch serves the next clients as before.
    replies = _concurrently(2, lambda i: client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i + 1]}], max_tokens=8, temperature=0))
    assert all(r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1 for r in replies)
    assert _batch(batched)["rows_in_use"] == 0


def test_the_walk_decodes_on_its_own_beside_the_batch(smollm2):
    # The batched graph computes the dense FFN only: a walk's reply (its cache lookups per row) never joins.
    engine = LarqlEngine(smollm2, walk=WalkSettings())
    handle = start_server(engine, "127.0.0.1", 0)
    try:
        reply = _client(handle).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens >= 1
        stats = _batch(handle)
        assert stats["joined"] == 0 and stats["steps"] == 0
        assert reply.larql_cache["ffn_calls"] > 0     # type: ignore[attr-defined]
    finally:
        handle.stop()


def test_gemma_completions_decoded_together_equal_the_completions_alone(gemma3):
    engine = LarqlEngine(gemma3, walk=WalkSettings(dense=True))
    batched = start_server(engine, "127.0.0.1", 0)
    alone = start_server(engine, "127.0.0.1", 0, batch_rows=0)
    prompts = ["The capital of France is", "Once upon a time, a spider", "def fibonacci(n):"]
    try:
        def complete(handle, i: int) -> str:
            return _client(handle).completions.create(model=gemma3.name, prompt=prompts[i], max_tokens=24,
                                                      temperature=0).choices[0].text
        solo = [complete(alone, i) for i in range(len(prompts))]
        before = _batch(batched)
        together = _concurrently(len(prompts), lambda i: complete(batched, i))
        after = _batch(batched)
        assert together == solo
        assert after["joined"] - before["joined"] == len(prompts)
        assert after["row_steps"] - before["row_steps"] > after["steps"] - before["steps"] > 0
    finally:
        batched.stop()
        alone.stop()
