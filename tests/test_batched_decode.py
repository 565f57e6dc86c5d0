"""Batched decode (engine/model/batch.py, graphs/batched.py) through a real server on loopback and the real `openai`
client: concurrent greedy replies decode together in one forward pass per step and equal the same replies decoded
alone (one at a time, the single-path decoder), with the dense FFN and with the walk and its cache (whose stores
made in a batch then serve the replies alone, and whose per-request counts stay exact; a warm cache's served and
replayed steps are batched too, beside walked ones in one mixed call); a client that goes away frees its batch
row."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from larql_desktop.api.server import start_server
from larql_desktop.engine.cache.l3 import SqliteL3
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from polling import wait_for
from resident import resident_kb_at

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


def _engine_counts(engine) -> dict:
    snap = engine.snapshot()
    return {"calls": snap.calls, "lookups": snap.lookups, "full_misses": int(snap.full_misses.sum()),
            **{f"{t}_{f}": int(getattr(snap.tiers[t], f).sum()) for t in snap.tiers for f in ("hits", "misses")}}


def _request_counts(cache: dict) -> dict:
    return {"calls": cache["ffn_calls"], "lookups": cache["lookups"], "full_misses": cache["misses"],
            **{f"{t}_hits": n for t, n in cache["hits"].items()},
            **{f"{t}_misses": n for t, n in cache["tier_misses"].items()}}


def test_walk_replies_batched_on_a_cold_cache_equal_the_replies_alone_served_from_it(smollm2, tmp_path):
    # The walk with its L1/L2/L3 cache: cold, the batch computes each row's walk and the rows store their entries
    # as single steps do; the same questions asked alone afterwards are served from those entries bit for bit.
    engine = LarqlEngine(smollm2, walk=WalkSettings(), l3=SqliteL3(tmp_path / "l3.sqlite3"))
    batched = start_server(engine, "127.0.0.1", 0)
    alone = start_server(engine, "127.0.0.1", 0, batch_rows=0)
    count, tokens = 4, 24
    try:
        def ask(handle, i: int):
            return _client(handle).chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=tokens,
                temperature=0)
        engine_before, before = _engine_counts(engine), _batch(batched)
        together = _concurrently(count, lambda i: ask(batched, i))
        engine_after, after = _engine_counts(engine), _batch(batched)
        assert after["row_steps"] - before["row_steps"] > after["steps"] - before["steps"] > 0
        assert after["joined"] - before["joined"] == count and after["rows_in_use"] == 0
        # Each request's larql_cache counts stay exact: together they are what the engine counted.
        summed: dict = {}
        for reply in together:
            for key, n in _request_counts(reply.larql_cache).items():    # type: ignore[attr-defined]
                summed[key] = summed.get(key, 0) + n
        delta = {k: engine_after[k] - engine_before.get(k, 0) for k in engine_after}
        assert {k: v for k, v in summed.items() if v} == {k: v for k, v in delta.items() if v}
        assert summed["calls"] > 0 and summed.get("L2_hits", 0) == 0     # cold: nothing to serve yet

        solo = [ask(alone, i) for i in range(count)]
        assert [r.choices[0].message.content for r in together] == [r.choices[0].message.content for r in solo]
        assert sum(r.larql_cache["hits"]["L2"] for r in solo) > 0       # type: ignore[attr-defined]
    finally:
        batched.stop()
        alone.stop()
        engine.l3.close()


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


def _rows_per_step(after: dict, before: dict, kinds: tuple[str, ...]) -> tuple[int, int]:
    """Batched calls of `kinds` between two batch snapshots, and the rows they computed."""
    def total(doc: dict, field: str) -> int:
        return sum(doc["by_kind"].get(kind, {}).get(field, 0) for kind in kinds)
    return total(after, "steps") - total(before, "steps"), total(after, "row_steps") - total(before, "row_steps")


def test_walk_replies_served_from_a_warm_cache_decode_together_and_equal_the_replies_alone(smollm2):
    # The default walk server (L1/L2): two questions asked alone first fill the cache and its key trace; asked
    # again beside two new ones, their steps are planned from it (served or replayed) while the new ones' steps
    # are walked: each kind of call is batched, and every reply is the one asked alone.
    engine = LarqlEngine(smollm2, walk=WalkSettings())
    batched = start_server(engine, "127.0.0.1", 0)
    alone = start_server(engine, "127.0.0.1", 0, batch_rows=0)
    warm, count, tokens = 2, 4, 24
    try:
        def ask(handle, i: int):
            return _client(handle).chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=tokens,
                temperature=0, logprobs=True)
        solo = [ask(alone, i) for i in range(warm)]
        engine_before, before = _engine_counts(engine), _batch(batched)
        together = _concurrently(count, lambda i: ask(batched, i))
        engine_after, after = _engine_counts(engine), _batch(batched)
        solo += [ask(alone, i) for i in range(warm, count)]       # served from what the batch stored

        assert [r.choices[0].message.content for r in together] == [r.choices[0].message.content for r in solo]
        for got, want in zip(together, solo):        # bit-identical logits: the same log probabilities
            assert [t.logprob for t in got.choices[0].logprobs.content] == \
                [t.logprob for t in want.choices[0].logprobs.content]
        # Warm steps decoded together (the batched calls that held served or replayed rows held several each),
        # and so did the new questions' walked steps, in the same calls (the mixed decoder) where they met.
        for kinds in (("served", "replay"), ("walked",)):
            steps, rows = _rows_per_step(after, before, kinds)
            assert rows > steps > 0, (kinds, after["by_kind"])
        assert after["mixed_steps"] > before["mixed_steps"]
        assert all(r.larql_cache["hits"]["L2"] > 0 for r in together[:warm])       # type: ignore[attr-defined]
        # Each request's larql_cache counts stay exact: together they are what the engine counted.
        summed: dict = {}
        for reply in together:
            for key, n in _request_counts(reply.larql_cache).items():    # type: ignore[attr-defined]
                summed[key] = summed.get(key, 0) + n
        delta = {k: engine_after[k] - engine_before.get(k, 0) for k in engine_after}
        assert {k: v for k, v in summed.items() if v} == {k: v for k, v in delta.items() if v}
        assert after["rows_in_use"] == 0 and after["joined"] - before["joined"] == count
    finally:
        batched.stop()
        alone.stop()


def test_gemma_walk_completions_warm_and_cold_past_the_window_decode_together_as_alone(gemma3):
    # Gemma 3's walk with L1/L2, one prompt longer than its sliding window: two completions asked alone first are
    # replayed or served from the cache beside two new ones walked, in batched calls, each as it is alone.
    engine = LarqlEngine(gemma3, walk=WalkSettings())
    batched = start_server(engine, "127.0.0.1", 0)
    alone = start_server(engine, "127.0.0.1", 0, batch_rows=0)
    long_prompt = "The river flows past the old mill and under the stone bridge. " * 60 + "Then the river"
    assert len(gemma3.tokenizer.encode(long_prompt)) > gemma3.config.sliding_window
    prompts = [long_prompt, "The capital of France is", "Once upon a time, a spider", "def fibonacci(n):"]
    warm = 2
    try:
        def complete(handle, i: int):
            return _client(handle).completions.create(model=gemma3.name, prompt=prompts[i], max_tokens=16,
                                                      temperature=0, logprobs=1)
        solo = [complete(alone, i) for i in range(warm)]
        before = _batch(batched)
        together = _concurrently(len(prompts), lambda i: complete(batched, i))
        after = _batch(batched)
        solo += [complete(alone, i) for i in range(warm, len(prompts))]
        assert [r.choices[0].text for r in together] == [r.choices[0].text for r in solo]
        for got, want in zip(together, solo):
            assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
        assert after["row_steps"] - before["row_steps"] > after["steps"] - before["steps"] > 0
        assert _rows_per_step(after, before, ("served", "replay"))[1] > 0      # the warm ones' steps were batched
        assert after["solo_steps"] - before["solo_steps"] < after["row_steps"] - before["row_steps"]
    finally:
        batched.stop()
        alone.stop()


def test_the_batch_pool_grows_keeping_each_rows_positions_and_writing_no_others(smollm2):
    import numpy as np

    from larql_desktop.engine.completions import decode_batch
    from larql_desktop.engine.model.transformer import KvCache

    class Reply:           # what a row holds of a session
        def __init__(self, length: int, seed: int):
            self.kv = KvCache(smollm2.config, capacity=length + 1)
            rng = np.random.default_rng(seed)
            for store in (self.kv.keys, self.kv.values):
                for array in store:
                    array[:, :length] = rng.standard_normal(array[:, :length].shape, dtype=np.float32)
            self.kv.length = length
            self.history, self.exact_length = [], length

    batch = decode_batch(smollm2, 8)
    # Five replies join one by one: the pool grows from one row to eight, and past 256 positions for the last.
    lengths = [12, 40, 7, 90, 300]
    replies = [Reply(n, seed) for seed, n in enumerate(lengths)]
    expected = [([k[:, :n].copy() for k in r.kv.keys], [v[:, :n].copy() for v in r.kv.values])
                for r, n in zip(replies, lengths)]
    rows = [batch.join(r) for r in replies]
    for row, n, (keys, values) in zip(rows, lengths, expected):
        assert row.kv.length == n
        assert all(np.array_equal(row.kv.keys[i][:, :n], keys[i]) for i in range(smollm2.config.n_layers))
        assert all(np.array_equal(row.kv.values[i][:, :n], values[i]) for i in range(smollm2.config.n_layers))
    resident, size = resident_kb_at(rows[0].kv.keys[0].ctypes.data)
    # The replies' 449 positions of 8 x 512 rows' room: a little over a tenth of the pool, not the half that
    # copying the four first rows' whole room wrote.
    assert size > 100_000 and resident < size // 5, (resident, size)
    for row in rows:
        batch.leave(row)
