"""Saved chats (real SQLite files) and the chat engine's new parts on the real SmolLM2: sampling settings,
stop strings, per-step alternatives and FFN outcomes, restoring a session from saved messages."""
from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from larql_desktop.engine.chats import (CHATS_FILE, ChatStore, ChatStoreError, FLUSH_INTERVAL, chat_to_json,
                                        chat_to_markdown)
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.session import ChatSession
from larql_desktop.engine.model.stops import MAX_STOP_LENGTH, MAX_STOP_STRINGS, StopStringDecoder
from larql_desktop.engine.model.generation import PRESETS, Sampler, SamplingSettings, apply_preset, preset_of
from larql_desktop.engine.model.transformer import KvCache


class Clock:
    """A clock the test moves: flushing depends on time, not on how fast the machine is."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def store(tmp_path):
    s, warning = ChatStore.open(tmp_path / CHATS_FILE)
    assert warning is None
    yield s
    s.close()


def test_a_chat_is_saved_listed_renamed_searched_and_deleted(store, tmp_path):
    settings = SamplingSettings(temperature=0.7, top_k=40, stop=("END",)).to_dict()
    a = store.create_chat("Colours", settings, system_prompt="Be brief.", model="smollm2")
    b = store.create_chat("Dragons", SamplingSettings().to_dict())
    store.add_message(a, "user", "Name three colours.")
    store.add_message(a, "assistant", "Red, green and blue.")
    store.add_message(b, "user", "Tell me about 100% dragons_")
    assert store.conn_journal_mode() == "wal"
    assert [c.id for c in store.list_chats()] == [b, a]          # most recent first
    assert [c.id for c in store.list_chats("GREEN")] == [a]       # message text, any case
    assert [c.id for c in store.list_chats("drag")] == [b]        # titles
    assert [c.id for c in store.list_chats("100%")] == [b]        # LIKE wildcards are literal
    assert store.list_chats("0_d") == [] and store.list_chats("%z") == []
    store.rename(a, "  Three   colours ")
    chat = store.load(a)
    assert chat.title == "Three colours" and chat.system_prompt == "Be brief." and chat.model == "smollm2"
    assert SamplingSettings.from_dict(chat.sampling) == SamplingSettings(temperature=0.7, top_k=40, stop=("END",))
    assert [(m.role, m.content, m.complete) for m in chat.messages] == [
        ("user", "Name three colours.", True), ("assistant", "Red, green and blue.", True)]
    with pytest.raises(ValueError, match="title cannot be empty"):
        store.rename(a, "   ")
    with pytest.raises(ValueError, match="role"):
        store.add_message(a, "system", "no")
    store.delete(b)
    assert [c.id for c in store.list_chats()] == [a]
    with pytest.raises(ChatStoreError, match="no saved chat"):
        store.load(b)
    # Another connection (another process, the next launch) sees everything committed.
    store.close()
    again, warning = ChatStore.open(tmp_path / CHATS_FILE)
    assert warning is None and again.load(a).title == "Three colours"
    again.close()


def test_a_reply_killed_mid_stream_is_kept_up_to_the_last_flush(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    chat = store.create_chat("Story", {})
    store.add_message(chat, "user", "Tell a story.")
    clock = Clock()
    reply = store.begin_reply(chat, clock)
    for i, word in enumerate(["Once", " upon", " a", " time", " there", " was"]):
        reply.append(word)
        clock.now += FLUSH_INTERVAL / 2
    assert reply.flushes == 2                 # after " a" and after " there"
    written = "Once upon a time there"    # the last flush came after " there"; " was" was not written yet
    store._conn.close()                   # the app dies: no final write, no clean close
    reopened, warning = ChatStore.open(path)
    assert warning is None
    last = reopened.load(chat).messages[-1]
    assert last.role == "assistant" and last.content == written and not last.complete
    # A reply that ends is written whole, however little time passed.
    finished = reopened.begin_reply(chat, clock)
    finished.append("The end")
    finished.finish("The end.")
    assert reopened.load(chat).messages[-1].content == "The end." and reopened.load(chat).messages[-1].complete
    reopened.drop_last_reply(chat)
    assert reopened.load(chat).messages[-1].content == written
    reopened.close()


def test_a_corrupt_database_is_set_aside_and_a_fresh_one_started(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    store.create_chat("Precious", {})
    store.close()
    original = path.read_bytes()
    path.write_bytes(b"this is not an SQLite database" + bytes(4096))
    store, warning = ChatStore.open(path)
    assert warning is not None and "damaged" in warning and "moved aside" in warning
    aside = [p for p in tmp_path.iterdir() if ".unusable-" in p.name and p.suffix == ".sqlite3"]
    assert len(aside) == 1 and aside[0].name in warning
    assert aside[0].read_bytes().startswith(b"this is not")     # nothing destroyed: the file is kept as it was
    assert store.list_chats() == []                              # a fresh, working store
    new = store.create_chat("After", {})
    assert store.load(new).title == "After"
    store.close()
    assert original[:16] == b"SQLite format 3\x00"


def test_a_locked_database_is_left_alone_and_reported(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    store.create_chat("Kept", {})
    store.close()
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("PRAGMA journal_mode = DELETE")   # an exclusive lock blocks every reader
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store, warning = ChatStore.open(path)
    finally:
        holder.rollback()
        holder.close()
    assert warning is not None and "in use by another program" in warning and "left as it is" in warning
    assert store.list_chats() == [] and not store.persistent     # this run's chats live in memory
    store.close()
    assert not any(".unusable-" in p.name for p in tmp_path.iterdir())   # never renamed under the holder
    kept, warning = ChatStore.open(path)
    assert warning is None and [c.title for c in kept.list_chats()] == ["Kept"]
    kept.close()


def test_exports_parse_back(store):
    chat_id = store.create_chat("Code", SamplingSettings(top_k=5).to_dict(), model="smollm2")
    store.add_message(chat_id, "user", "Show Python code.")
    store.add_message(chat_id, "assistant", "Here:\n\n```python\nprint('hi')\n```\n")
    chat = store.load(chat_id)
    data = json.loads(chat_to_json(chat))
    assert data["title"] == "Code" and data["system_prompt"] is None and data["sampling"]["top_k"] == 5
    assert [(m["role"], m["content"]) for m in data["messages"]] == [(m.role, m.content) for m in chat.messages]
    md = chat_to_markdown(chat, default_system_prompt="You are helpful")
    assert md.startswith("# Code\n") and "System prompt (the template's default): You are helpful" in md
    assert md.index("## You") < md.index("Show Python code.") < md.index("## Assistant")
    assert "```python\nprint('hi')\n```" in md


def test_sampling_settings_are_validated_and_round_trip():
    s = SamplingSettings(max_tokens=64, temperature=0.8, top_p=0.9, seed=7, top_k=40, min_p=0.05,
                         repeat_penalty=1.1, stop=["\n\n", "User:"])
    assert s.stop == ("\n\n", "User:")
    assert SamplingSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    for bad, message in [(dict(top_k=-1), "top-k"), (dict(min_p=1.5), "min-p"), (dict(repeat_penalty=0), "repeat"),
                         (dict(stop=("",)), "non-empty"), (dict(stop="END"), "list of strings"),
                         (dict(stop=tuple("abcde")), f"up to {MAX_STOP_STRINGS}"),
                         (dict(stop=("x" * (MAX_STOP_LENGTH + 1),)), f"at most {MAX_STOP_LENGTH}"), (dict(seed=-3), "seed"),
                         (dict(max_tokens=0), "max tokens")]:
        with pytest.raises(ValueError, match=message):
            SamplingSettings(**bad)
    with pytest.raises(ValueError, match="unknown sampling settings: colour"):
        SamplingSettings.from_dict({"colour": 1})
    for name in PRESETS:
        assert preset_of(apply_preset(s, name)) == name and apply_preset(s, name).stop == s.stop
    with pytest.raises(ValueError, match="no sampling preset"):
        apply_preset(s, "Wild")


def test_top_k_min_p_and_repeat_penalty_shape_the_choice():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    picks = {Sampler(SamplingSettings(temperature=1.0, top_k=2, seed=i))(logits) for i in range(200)}
    assert picks == {0, 1}
    picks = {Sampler(SamplingSettings(temperature=1.0, min_p=0.25, seed=i))(logits) for i in range(200)}
    assert picks == {0, 1, 2}                              # 0.05 < 0.25 x 0.5
    greedy = SamplingSettings(repeat_penalty=3.0)
    assert Sampler(greedy)(np.array([2.0, 1.0, 0.5])) == 0
    assert Sampler(greedy)(np.array([2.0, 1.0, 0.5]), [0]) == 1   # 2/3 < 1: the repeated token loses
    assert Sampler(greedy)(np.array([-1.0, -2.5, -3.5]), [0]) == 1   # -3 < -2.5 for negative logits


def test_stop_strings_end_the_text_before_them_across_tokens(smollm2):
    tok = smollm2.tokenizer
    text = "Red, green and blue. Then yellow."
    ids = tok.encode(text)
    decoder = StopStringDecoder(tok.stream_decoder(), ("and blue",))
    out = "".join(decoder.feed(i) for i in ids) + decoder.flush()
    assert out == "Red, green " and decoder.stopped
    decoder = StopStringDecoder(tok.stream_decoder(), ("and purple",))
    streamed = [decoder.feed(i) for i in ids]
    assert "".join(streamed) + decoder.flush() == text and not decoder.stopped
    assert "and" not in streamed[ids.index(tok.encode(" and")[0])]   # a possible stop start is held back


def test_steps_carry_alternatives_from_the_logits_and_layer_outcomes(smollm2, tmp_path):
    engine = LarqlEngine(smollm2)
    session = engine.new_session()
    steps = list(session.reply("Name a colour.", SamplingSettings(max_tokens=4)))
    n = smollm2.config.n_layers
    ids = smollm2.encode_prompt(session.conversation(session.messages[:-1]))
    kv = KvCache(smollm2.config)
    # The same walk FFN (top-K features) on a fresh KV cache: the prompt's pass bypasses every cache tier.
    logits = smollm2.transformer.forward(ids, kv, engine.request_walk())[-1]
    z = logits.astype(np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()   # softmax written out, not the engine's
    first = steps[0]
    assert len(first.alternatives) == 5 and first.alternatives[0].token_id == first.token_id   # greedy
    top = np.argsort(-p)[:5]
    assert [a.token_id for a in first.alternatives] == top.tolist()
    # The engine's probabilities come from onnxruntime's float32 softmax (graphs/softmax.py): within 1e-4.
    assert smollm2.transformer.softmax is not None and smollm2.transformer.softmax.size == p.size
    assert np.allclose([a.probability for a in first.alternatives], p[top], rtol=1e-4, atol=1e-7)
    assert first.alternatives[0].text == smollm2.tokenizer.decode([first.token_id], special=True)
    assert [o.layer for o in first.layers] == list(range(n))
    assert all(o.outcome == "bypass" and o.bypass == "prefill" for o in first.layers)
    assert all(o.outcome == "miss" for o in steps[1].layers)    # a fresh engine: every decode lookup misses
    again = engine.new_session()
    repeat = list(again.reply("Name a colour.", SamplingSettings(max_tokens=4)))
    assert [s.token_id for s in repeat] == [s.token_id for s in steps]
    assert all(o.outcome == "hit" and o.tier == "L2" for o in repeat[1].layers)   # the first chat filled L2
    # A prompt rendered by the caller (the API's path) gets the same tokens, and no alternatives unless asked.
    plain = list(engine.new_session().generate(ids, SamplingSettings(max_tokens=4)))
    asked = list(engine.new_session().generate(ids, SamplingSettings(max_tokens=4), alternatives=True))
    assert [s.token_id for s in plain] == [s.token_id for s in asked] == [s.token_id for s in steps]
    assert all(s.alternatives == () for s in plain)
    assert [s.alternatives for s in asked] == [s.alternatives for s in repeat]

    # Saved with the chat and read back for the token view (timings are not kept).
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    chat = store.create_chat("Colour", {})
    reply = store.begin_reply(chat)
    reply.finish("".join(s.text for s in repeat), repeat)
    store.close()
    store, _ = ChatStore.open(path)
    back = store.load(chat).messages[-1].tokens
    store.close()
    assert [(b.token_id, b.text, b.is_stop, b.index) for b in back] == \
        [(s.token_id, s.text, s.is_stop, s.index) for s in repeat]
    assert [[(a.token_id, a.text) for a in b.alternatives] for b in back] == \
        [[(a.token_id, a.text) for a in s.alternatives] for s in repeat]
    assert all(abs(a.probability - c.probability) < 1e-6 for b, s in zip(back, repeat)
               for a, c in zip(b.alternatives, s.alternatives))
    assert [b.layers for b in back] == [s.layers for s in repeat]


def test_a_session_restored_from_saved_messages_continues_as_the_original(smollm2):
    engine = LarqlEngine(smollm2)
    settings = SamplingSettings(max_tokens=6)
    original = engine.new_session()
    original.system_prompt = "You answer in French."
    list(original.reply("Hello!", settings))
    follow_up = list(original.reply("And goodbye?", settings))
    prompt_length = len(original.history) - (len(follow_up) - 1)
    saved = [(m["role"], m["content"]) for m in original.messages[:2]]
    restored = engine.new_session()
    restored.restore(saved, "You answer in French.")
    again = list(restored.reply("And goodbye?", settings))
    # The model sees the same prompt, token for token; the original computed its first reply one token at a
    # time and the restored one in one batch, so the next-token probabilities agree up to rounding (amplified
    # a little by the top-K walk, where a near-tie between features can flip which ones are selected).
    assert restored.history[:prompt_length] == original.history[:prompt_length]
    ours = {a.token_id: a.probability for a in again[0].alternatives}
    theirs = {a.token_id: a.probability for a in follow_up[0].alternatives}
    assert all(abs(ours[t] - theirs[t]) < 0.03 for t in ours.keys() & theirs.keys()) and len(ours.keys() & theirs.keys()) >= 3
    assert restored.messages[:3] == original.messages[:3]
    assert restored.conversation()[0] == {"role": "system", "content": "You answer in French."}
    # Restoring the same saved chat twice gives the same reply: the state is the stored messages alone.
    twin = engine.new_session()
    twin.restore(saved, "You answer in French.")
    assert [s.token_id for s in twin.reply("And goodbye?", settings)] == [s.token_id for s in again]
    with pytest.raises(ValueError, match="role 'system'"):
        restored.restore([("system", "x")])


def test_the_template_default_system_prompt_is_found(smollm2, gemma3):
    assert smollm2.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert gemma3.default_system_prompt is None      # a base model: no template at all
    session = ChatSession(smollm2)
    assert session.conversation([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
