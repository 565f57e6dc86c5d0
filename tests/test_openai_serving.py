"""Serving like an inference server, through the real `openai` client against a real server on loopback over the real
SmolLM2: logprobs (plain and streamed, equal to a log-softmax of the engine's own logits), the KV prefix cache shared by
every request (bit-identical to recomputing, invalidated by patches, bounded in bytes) and chunked prefill."""
from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import openai
import pytest

from larql_desktop.api.openai_compat import FairTurns
from larql_desktop.api.server import start_server
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.completions import CompletionRun
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.model.overlay import Patch, PatchOperation
from larql_desktop.engine.model.prefix_cache import PrefillSchedule
from larql_desktop.tools.serve_load import run_serve_load
from polling import wait_for

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


# ----------------------------------------------------------------------------------------------- prefix cache
SYSTEM = ("You are a careful assistant for a museum of natural history. Answer in one short sentence, name the "
          "exhibit hall where the visitor can see what they ask about, and never invent opening hours. ") * 3


def _ask(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _greedy(client, messages, n: int = 6):
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=n,
                                           logprobs=True, top_logprobs=20)
    entries = [(e.token, e.logprob, tuple(t.logprob for t in e.top_logprobs))
               for e in reply.choices[0].logprobs.content]
    return reply, entries


def _prefill_state(session, ids):
    for _ in session.prefill_steps(ids):
        pass
    kv = session.kv
    return (session._prompt_logits[1].copy(), [k[:, :kv.length].copy() for k in kv.keys],
            [v[:, :kv.length].copy() for v in kv.values])


def _assert_same_state(a, b):
    assert np.array_equal(a[0], b[0])                 # logits, bit for bit
    for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
        assert np.array_equal(x, y)                   # every layer's keys and values


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_prefix_hit_is_bit_identical_to_a_cold_prefill(name, request):
    model = request.getfixturevalue(name)
    text = "The museum's hall of minerals holds quartz, beryl, topaz and a meteorite from Namibia. " * 8
    ids = model.tokenizer.encode(text)[:150]
    cold = _prefill_state(LarqlEngine(model, prefill_chunk=32, prefix_cache_bytes=0).new_session(), ids)
    for stored, reused in ((60, 32), (64, 64), (149, 128), (150, 128)):
        shared = LarqlEngine(model, prefill_chunk=32)
        _prefill_state(shared.new_session(), ids[:stored] if stored < 150 else ids)
        session = shared.new_session()
        _assert_same_state(_prefill_state(session, ids), cold)
        assert session.reused_tokens == reused and shared.prefix_cache.stats().hits == 1
    # A prompt that differs inside the first chunk reuses nothing.
    other = LarqlEngine(model, prefill_chunk=32)
    _prefill_state(other.new_session(), ids[:10] + [ids[11]] + ids[11:])      # differs at position 10
    assert other.prefix_cache.longest(other.kv_namespace(other.new_session().ffn), ids, other.prefill_schedule) is None


def test_the_prefill_schedule_cuts_at_whole_chunks_and_at_the_template_heads_end():
    head = tuple(range(100, 124))                     # a template head of 24 tokens
    headed, plain = PrefillSchedule(64, head), PrefillSchedule(64)
    chat, other = list(head) + [7] * 126, [7] * 150    # a prompt that starts with the head, and one that does not
    assert list(headed.chunks(0, 150, chat)) == [(0, 24), (24, 64), (64, 128), (128, 150)]
    assert list(headed.chunks(24, 40, chat)) == [(24, 40)] and list(headed.chunks(10, 30, chat)) == [(10, 24), (24, 30)]
    assert list(headed.chunks(0, 150, other)) == list(plain.chunks(0, 150, chat)) == [(0, 64), (64, 128), (128, 150)]
    assert [headed.floor(n, chat) for n in (0, 23, 24, 63, 64, 150)] == [0, 0, 24, 24, 64, 128]
    assert [headed.floor(n, other) for n in (23, 24, 63, 64, 150)] == [0, 0, 0, 64, 128]
    assert [headed.floor(n, chat[:20]) for n in (0, 20)] == [0, 0]           # too short to hold the head
    long_head = PrefillSchedule(64, tuple(range(100)))
    assert list(long_head.chunks(0, 150, list(range(150)))) == [(0, 64), (64, 100), (100, 128), (128, 150)]
    with pytest.raises(ValueError):
        PrefillSchedule(0)
    # A head shorter than a quarter of a chunk (a bare turn opening) is not worth a pass of its own.
    assert PrefillSchedule.for_template(64, head) == headed and PrefillSchedule.for_template(64, head[:15]) == plain
    # After every cue (a user's turn closed and the assistant's opened): a prompt is whole chunks to its end, and
    # so is each earlier turn inside the next one's prompt; a prompt without the cue is cut as before.
    cue = (2, 3)
    cued = PrefillSchedule(64, head, cue)
    turn = list(head) + [7] * 50 + list(cue)                       # 76 tokens, ending with the cue
    follow = turn + [8] * 70 + list(cue)                           # the reply and a new question: 148
    assert list(cued.chunks(0, len(turn), turn)) == [(0, 24), (24, 64), (64, 76)] and cued.floor(76, turn) == 76
    assert list(cued.chunks(0, 148, follow)) == [(0, 24), (24, 64), (64, 76), (76, 128), (128, 148)]
    assert [cued.floor(n, follow) for n in (75, 76, 127, 147, 148)] == [64, 76, 76, 128, 148]
    assert list(cued.chunks(76, 148, follow)) == [(76, 128), (128, 148)]   # from the earlier turn's end: the same
    assert list(cued.chunks(0, 150, chat)) == list(headed.chunks(0, 150, chat))
    assert cued.floor(3, [2, 3, 2, 3]) == 2 and list(cued.chunks(0, 4, [2, 3, 2, 3])) == [(0, 2), (2, 4)]
    assert PrefillSchedule.for_template(64, head, cue) == cued


def test_a_new_conversation_reuses_the_chat_templates_head_bit_for_bit(smollm2, gemma3):
    """Every SmolLM2 chat on the default system prompt starts with the same 24 tokens (its system turn and the
    user turn's opening), fewer than a chunk: the prefill cuts a chunk there, so a new conversation reuses them
    and runs only its own question, with what a cold prefill of it computes."""
    first, second = (smollm2.encode_prompt([{"role": "user", "content": q}])
                     for q in ("Where are the dinosaur skeletons?", "Name three colours of the rainbow."))
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    engine = LarqlEngine(smollm2, walk=WalkSettings())
    # Both prompts are shorter than a chunk: without the head's cut, nothing of them would be reused.
    assert smollm2.template_head == tuple(second[:common]) and 0 < common < len(second) < engine.prefill_chunk
    assert list(engine.prefill_schedule.chunks(0, len(second), second)) == [(0, common), (common, len(second))]
    cold = _prefill_state(LarqlEngine(smollm2, walk=WalkSettings(), prefix_cache_bytes=0).new_session(), second)
    _prefill_state(engine.new_session(), first)
    session = engine.new_session()
    _assert_same_state(_prefill_state(session, second), cold)
    assert session.reused_tokens == common and engine.prefix_cache.stats().hits == 1
    # Every prompt ends with the template's cue: the user's turn closed and the assistant's opened.
    cue = smollm2.template_cue
    assert len(cue) > 1 and tuple(first[-len(cue):]) == tuple(second[-len(cue):]) == cue
    assert smollm2.tokenizer.decode(list(cue)).strip().endswith("assistant")
    # A base model has no template: its prompts are cut at whole chunks only.
    base = LarqlEngine(gemma3)
    assert gemma3.template_head == gemma3.template_cue == ()
    assert base.prefill_schedule == PrefillSchedule(base.prefill_chunk)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_chunked_prefill_agrees_with_one_pass(name, request):
    """onnxruntime rounds a row differently in passes of other lengths (prefix_cache.py), so a chunked prefill is
    not bit-identical to one pass: it must agree to rounding (the same next token, logits within 1 of ~20)."""
    model = request.getfixturevalue(name)
    text = "The museum's hall of minerals holds quartz, beryl, topaz and a meteorite from Namibia. " * 8
    ids = model.tokenizer.encode(text)[:150]
    one_pass = _prefill_state(LarqlEngine(model, prefill_chunk=10 ** 6, prefix_cache_bytes=0).new_session(), ids)
    chunked = _prefill_state(LarqlEngine(model, prefill_chunk=64, prefix_cache_bytes=0).new_session(), ids)
    assert np.argmax(chunked[0]) == np.argmax(one_pass[0])
    assert float(np.abs(chunked[0] - one_pass[0]).max()) < 1.0


def test_a_prefix_hit_serves_exactly_what_a_cold_cache_does(served):
    engine, handle = served
    client = _client(handle)
    first, _ = _greedy(client, _ask("Where are the dinosaur skeletons?"))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    warm, warm_entries = _greedy(client, _ask("Where can I see meteorites?"))
    shared = warm.usage.prompt_tokens_details.cached_tokens
    schedule = engine.prefill_schedule
    a, b = (engine.model.encode_prompt(_ask(q)) for q in ("Where are the dinosaur skeletons?",
                                                           "Where can I see meteorites?"))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared == common - common % schedule.size > 0      # the shared system prompt, in whole chunks
    stats = client.get("/cache-stats", cast_to=object)["prefix_cache"]
    assert stats["hits"] == 1 and stats["reused_tokens"] == shared and 0 < stats["bytes"] <= stats["max_bytes"]

    engine.clear_caches()                             # the prefix cache, L2 and every L1: all cold
    cold, cold_entries = _greedy(client, _ask("Where can I see meteorites?"))
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm_entries == cold_entries and warm.choices[0].message.content == cold.choices[0].message.content
    # The FFN counts are what the request ran: a prefill pass per chunk it computed (reused chunks ran no FFN),
    # then the same decode steps.
    warm_cache, cold_cache = warm.model_extra["larql_cache"], cold.model_extra["larql_cache"]
    layers, n = engine.model.config.n_layers, warm.usage.prompt_tokens
    assert warm_cache["bypasses"]["prefill"] == layers * len(list(schedule.chunks(shared, n, b)))
    assert cold_cache["bypasses"]["prefill"] == layers * len(list(schedule.chunks(0, n, b)))
    assert warm_cache["lookups"] == cold_cache["lookups"] > 0
    assert warm_cache["ffn_calls"] - warm_cache["bypasses"]["prefill"] == \
        cold_cache["ffn_calls"] - cold_cache["bypasses"]["prefill"]


def test_a_resent_conversation_reuses_its_previous_prompt(served):
    """A prompt ends with the template's cue, where the prefill cuts a chunk: each turn reuses the whole prompt
    of the turn before (not only its whole multiples of a chunk), and serves what a cold prefill computes."""
    engine, handle = served
    client = _client(handle)
    messages = _ask("Where are the dinosaur skeletons?")
    previous_prompt = 0
    for turn in range(3):
        sent = messages
        reply, entries = _greedy(client, sent, n=12)
        if turn:
            # The previous turn's prompt, all of it (its reply was decoded: it is prefilled once, now).
            assert reply.usage.prompt_tokens_details.cached_tokens == previous_prompt
            assert previous_prompt % engine.prefill_chunk        # more than its whole chunks
        previous_prompt = reply.usage.prompt_tokens
        messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                               {"role": "user", "content": f"And what else is in hall {turn + 2}?"}]
    assert engine.prefix_cache.stats().entries == 1   # each turn's prompt replaced the one it extends
    engine.clear_caches()                             # the prefix cache, L2 and every L1: all cold
    cold, cold_entries = _greedy(client, sent, n=12)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold_entries == entries and cold.choices[0].message.content == reply.choices[0].message.content


def test_a_patch_between_two_turns_invalidates_the_prefix(served):
    engine, handle = served
    client = _client(handle)
    _greedy(client, _ask("Where are the dinosaur skeletons?"))
    before, before_entries = _greedy(client, _ask("Where can I see meteorites?"))
    assert before.usage.prompt_tokens_details.cached_tokens > 0
    cfg = engine.model.config
    down = np.random.default_rng(3).standard_normal(cfg.hidden).astype(np.float32)
    engine.apply_patch(Patch((PatchOperation("update", 1, 11, down=down),), engine.model.name,
                             engine.model.checksum))
    after, after_entries = _greedy(client, _ask("Where can I see meteorites?"))
    assert after.usage.prompt_tokens_details.cached_tokens == 0      # the old KV is never served
    assert after_entries != before_entries                           # the patch changes what the model computes
    again, again_entries = _greedy(client, _ask("Where can I see meteorites?"))
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and again_entries == after_entries


def test_the_prefix_caches_byte_bound_holds_under_a_flood_of_distinct_prompts(smollm2):
    cfg = smollm2.config
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    chunk = 64
    budget = per_token * chunk * 3                    # three prompts' whole chunks
    engine = LarqlEngine(smollm2, walk=WalkSettings(), prefix_cache_bytes=budget, prefill_chunk=chunk)
    handle = start_server(engine, "127.0.0.1", 0)
    try:
        client = _client(handle)
        for i in range(12):
            prompt = f"Visitor {i} asks about exhibit {i * 37}. " + "The hall of minerals holds quartz. " * 12
            assert chunk < len(smollm2.tokenizer.encode(prompt)) < 2 * chunk
            client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=1)
            stats = engine.prefix_cache.stats()
            assert 0 < stats.bytes <= budget and stats.bytes == sum(
                e.nbytes for e in engine.prefix_cache._entries.values())
        assert stats.evictions > 0 and stats.stored == 12 and stats.entries == stats.stored - stats.evictions
    finally:
        handle.stop()


# ----------------------------------------------------------------------------------------------- chunked prefill
def test_a_long_prefill_lets_another_request_run_between_its_chunks_and_stops_at_a_chunk(smollm2):
    engine = LarqlEngine(smollm2, walk=WalkSettings(), prefill_chunk=16)
    text = "The museum's hall of minerals holds quartz, beryl, topaz and a meteorite from Namibia. " * 8
    long_ids = smollm2.tokenizer.encode(text)[:150]
    short_ids = smollm2.encode_prompt(QUESTION)
    greedy = SamplingSettings(max_tokens=3)
    long_run, short_run = CompletionRun(engine, long_ids, greedy), CompletionRun(engine, short_ids, greedy)
    turns = FairTurns()
    seen: list[tuple[str, int, bool]] = []

    async def drive(name: str, run: CompletionRun) -> None:
        while not run.finished:
            await turns.run(run.step)
            seen.append((name, run.session.kv.length, run.finished))

    async def both() -> None:
        await asyncio.gather(drive("long", long_run), drive("short", short_run))

    asyncio.run(both())
    # Every prefill step ran one chunk, and the short request ended while the long prompt was still prefilling.
    long_lengths = [n for name, n, _ in seen if name == "long"]
    assert long_lengths[:3] == [16, 32, 48]
    short_end = next(i for i, (name, _, done) in enumerate(seen) if name == "short" and done)
    assert max(n for name, n, _ in seen[:short_end] if name == "long") < len(long_ids)
    reply_alone = CompletionRun(engine, short_ids, greedy)
    while not reply_alone.finished:
        reply_alone.step()
    assert short_run.close().text == reply_alone.close().text    # interleaving changes nothing it computes
    long_run.close()

    # A run closed in the middle of its prefill (a client gone) runs no further chunk and frees its session.
    engine.clear_caches()                             # the long prompt's chunks are stored: start cold
    stopped = CompletionRun(engine, long_ids, greedy)
    stopped.step()
    stopped.step()
    result = stopped.close()
    assert stopped.session.kv.length == 32 and stopped.session not in engine.sessions
    assert result.finish_reason is None and result.completion_tokens == 0
    assert stopped.step() == "" and stopped.session.kv.length == 32


MINERALS = "The museum's hall of minerals holds quartz, beryl, topaz and a meteorite from Namibia. "


def _prefill_yields(session, ids, pause):
    """What prefill_steps yielded, and the state it left (as _prefill_state)."""
    yielded = list(session.prefill_steps(ids, pause))
    kv = session.kv
    return yielded, (session._prompt_logits[1].copy(), [k[:, :kv.length].copy() for k in kv.keys],
                     [v[:, :kv.length].copy() for v in kv.values])


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_prefill_chunk_stopped_between_layers_computes_the_same_bits(name, request):
    """A server stops a long prompt's chunk between two layers for a newly arrived short prompt (`pause`): the chunk
    then goes on through the same graph calls on the same inputs, so the prefill is bit for bit the one not stopped,
    and a chunk stops at most once (the long prompt still advances)."""
    model = request.getfixturevalue(name)
    ids = model.tokenizer.encode(MINERALS * 8)[:100]              # chunks of 32: 32, 32, 32 and 4 positions
    engine = LarqlEngine(model, walk=WalkSettings(), prefill_chunk=32, prefix_cache_bytes=0)
    asked_always: list[int] = []
    asked_never: list[int] = []

    def always(positions: int) -> bool:
        asked_always.append(positions)
        return True

    def never(positions: int) -> bool:
        asked_never.append(positions)
        return False

    stopped_yields, stopped = _prefill_yields(engine.new_session(), ids, always)
    plain_yields, plain = _prefill_yields(engine.new_session(), ids, never)
    # Stopped once in each chunk (with the positions still to run, that chunk's included), then ran to its end.
    assert stopped_yields == [100, 68, 68, 36, 36, 4, 4, 0] and asked_always == [100, 68, 36, 4]
    assert plain_yields == [68, 36, 4, 0]
    # Asked between every two layers of every chunk, never after the last (the chunk is then as good as done).
    assert asked_never == [n for n in (100, 68, 36, 4) for _ in range(model.config.n_layers - 1)]
    _assert_same_state(stopped, plain)
    _assert_same_state(plain, _prefill_state(engine.new_session(), ids))     # no pause at all: the same too


def test_a_short_prompt_arriving_during_a_long_prefill_runs_before_the_rest_of_its_chunk(smollm2):
    """The scheduler's part: a request waiting for its first turn with a prompt shorter than what a running
    prefill still has to run stops that prefill's chunk after the layer running (FairTurns tells the run), takes
    the next turn, and the long prompt's reply is the one it gives alone."""
    engine = LarqlEngine(smollm2, walk=WalkSettings())
    chunk = engine.prefill_chunk
    long_ids = smollm2.tokenizer.encode(MINERALS * 20)[:5 * chunk]
    short_ids = smollm2.encode_prompt(QUESTION)
    assert len(short_ids) < chunk
    greedy = SamplingSettings(max_tokens=3)
    # A chat served before, as on any running server, left the chat template's head in the prefix cache: the
    # short prompt's own question is what runs, in one step, which samples its first token.
    earlier = CompletionRun(engine, smollm2.encode_prompt([{"role": "user", "content": "Hi."}]), greedy)
    while not earlier.finished:
        earlier.step()
    earlier.close()
    turns = FairTurns()
    runs = {"long": CompletionRun(engine, long_ids, greedy, pause=turns.newcomer_shorter_than),
            "short": CompletionRun(engine, short_ids, greedy, pause=turns.newcomer_shorter_than)}
    seen: list[tuple[str, int, int]] = []           # (run, prompt positions in its KV, tokens) after each step

    async def drive(name: str) -> None:
        run = runs[name]
        while not run.finished:
            await turns.run(run.step, newcomer=None if run.started else run.prompt_tokens)
            seen.append((name, len(run.session.history), run.completion_tokens))

    async def queued(count: int) -> None:
        while turns.waiting < count:
            await asyncio.sleep(0)                  # a turn of the event loop, not a timed wait

    async def scenario() -> None:
        async with turns:                           # the engine is busy: the long request queues, then the short
            tasks = [asyncio.create_task(drive("long"))]
            await queued(1)
            tasks.append(asyncio.create_task(drive("short")))
            await queued(2)
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    # The long prompt's first chunk stopped after its first layer (nothing in its KV history yet), the short
    # request then ran its whole prompt and sampled its first token, and the long chunk went on to its end.
    assert seen[:3] == [("long", 0, 0), ("short", len(short_ids), 1), ("long", chunk, 0)]
    assert turns.chunk_stops == 1
    for name, ids in (("long", long_ids), ("short", short_ids)):
        alone = CompletionRun(engine, ids, greedy)
        while not alone.finished:
            alone.step()
        result, alone_result = runs[name].close(), alone.close()
        assert (result.text, result.completion_tokens) == (alone_result.text, alone_result.completion_tokens)


def test_a_short_request_sent_during_a_long_prefill_gets_its_first_token_first(served):
    """Through the server and the `openai` client: a short chat sent while a long completion prefills streams its
    first token before the long one's, and both replies are what each gets alone."""
    engine, handle = served
    client = _client(handle)
    long_prompt = MINERALS * 60                      # ~1,200 tokens: many chunks
    short_messages = [{"role": "user", "content": "Hi"}]

    def stream_long(events: list[str]) -> str:
        pieces = []
        for chunk in client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=3, temperature=0,
                                               stream=True):
            if chunk.choices and chunk.choices[0].text:
                if not pieces:
                    events.append("long first token")
                pieces.append(chunk.choices[0].text)
        return "".join(pieces)

    def stream_short(events: list[str]) -> str:
        pieces = []
        for chunk in client.chat.completions.create(model="smollm2", messages=short_messages, max_tokens=3,
                                                    temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                if not pieces:
                    events.append("short first token")
                pieces.append(chunk.choices[0].delta.content)
        return "".join(pieces)

    alone: list[str] = []
    short_alone, long_alone = stream_short(alone), stream_long(alone)
    engine.clear_caches()                            # the long prompt's chunks are stored: prefill it again
    events: list[str] = []
    long_text: list[str] = []
    worker = threading.Thread(target=lambda: long_text.append(stream_long(events)), daemon=True)
    worker.start()
    chunk = engine.prefill_chunk
    # The long prompt is prefilling (a chunk of it is in a session's KV) and has many chunks to go.
    assert wait_for(lambda: any(len(s.history) >= chunk for s in list(engine.sessions)), within=300)
    short_text = stream_short(events)
    worker.join(timeout=600)
    assert events == ["short first token", "long first token"]
    assert (short_text, long_text) == (short_alone, [long_alone])
    stats = httpx.get(f"{handle.url}/v1/cache-stats", timeout=30).json()
    assert stats["scheduling"]["chunk_stops"] <= 1      # at most the long chunk running when the short one came


def test_the_serve_load_mode_runs_against_the_server(served):
    engine, handle = served
    report = run_serve_load(handle.url, None, turns=3, max_tokens=4, shared_clients=2, client_counts=(1, 2),
                            replies=1, long_tokens=128, beside_delay=0.0, sizes=(64,))
    assert report["model"] == "smollm2" and [r["turn"] for r in report["multi_turn"]] == [1, 2, 3]
    for before, after in zip(report["multi_turn"], report["multi_turn"][1:]):
        # (a system prompt of its own, so no template head; the whole prompt before: it ends with the cue)
        assert after["cached_tokens"] == before["prompt_tokens"]
    assert report["shared_prefix"][1]["cached_tokens"] > 0 == report["shared_prefix"][0]["cached_tokens"]
    assert [r["clients"] for r in report["aggregate"]] == [1, 2]
    assert all(not r["errors"] and r["tokens"] == 4 * r["clients"] for r in report["aggregate"])
    # Every client's prompt is new (none repeats the 1-client row's): each row's steps are walked, none replayed
    # from the FFN cache, which would flatter the ratio.
    assert all(set(r["rows_per_batched_step_by_kind"]) == {"walked"} for r in report["aggregate"])
    # The server's seconds by kind of step: each row prefilled its prompts and decoded in the batch (one client
    # alone too: its reply takes a batch row), and its busy seconds fit in its wall time.
    for r in report["aggregate"]:
        busy = r["server_seconds"]
        assert busy["prefill"] > 0 and busy["batched decode"] > 0 and busy["decode"] == 0, busy
        assert busy["prefill"] + busy["batched decode"] + busy["idle"] == pytest.approx(r["seconds"], abs=0.01)
        assert r["decode_tok_per_s"] >= r["tok_per_s"]
    assert report["aggregate"][1]["decode_vs_one_client"] > 0
    assert report["beside_long"]["long_prompt_tokens"] > 64 and report["prefill"][0]["prompt_tokens"] > 32
    assert report["conversations"] == "chat" and report["beside_long"]["chunk_stops"] in (0, 1)


def test_the_serve_load_mode_runs_against_a_base_model(gemma3):
    """Gemma 3 270M has no chat template (its chat requests get a 400): the load test sends its conversations as
    plain-text completions, which still share their prefix turn after turn."""
    engine = LarqlEngine(gemma3, walk=WalkSettings())
    handle = start_server(engine, "127.0.0.1", 0)
    try:
        report = run_serve_load(handle.url, None, turns=2, max_tokens=2, shared_clients=2, client_counts=(1,),
                                replies=1, long_tokens=128, beside_delay=0.0, sizes=(64,))
    finally:
        handle.stop()
    assert report["model"] == "gemma3-270m" and report["conversations"] == "completions"
    first, second = report["multi_turn"]
    assert first["prompt_tokens"] >= engine.prefill_chunk and second["cached_tokens"] >= engine.prefill_chunk
    assert report["shared_prefix"][1]["cached_tokens"] > 0 == report["shared_prefix"][0]["cached_tokens"]
    assert not report["aggregate"][0]["errors"] and report["aggregate"][0]["tokens"] == 2
    assert report["beside_long"]["long_prompt_tokens"] > 64 and report["beside_long"]["chunk_stops"] in (0, 1)
    assert report["prefill"][0]["prompt_tokens"] > 32
