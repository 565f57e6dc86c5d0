"""The saved-chats store under locks, corruption and bad text, on real SQLite files: every case keeps every chat it
held, compared row by row with what was written."""
from __future__ import annotations

import hashlib
import sqlite3

import pytest

from larql_desktop.engine.chats import (APPLICATION_ID, CHATS_FILE, SCHEMA_VERSION, ChatStore, DamagedChat,
                                        ReadOnlyChatStore, UnstorableText, chat_to_json, chat_to_markdown)

CHATS = [  # (title, system prompt, sampling, model, [(role, content, complete)])
    ("Colours", "Be brief.", {"temperature": 0.7, "top_k": 40}, "smollm2",
     [("user", "Name three colours."), ("assistant", "Red, green and blue.")]),
    ("Dragons", None, {}, "", [("user", "Tell me about 100% dragons_ é 😀")]),
    ("Long", None, {"max_tokens": 64}, "gemma3-270m", [("user", "word " * 2000), ("assistant", "ok " * 2000)]),
    ("Code", "You write Python.", {}, "smollm2", [("user", "Show code."), ("assistant", "```python\nx = 1\n```")]),
    ("Empty", None, {}, "", []),
]


def _write(store: ChatStore, chats=CHATS) -> list:
    """Write `chats`; what each should read back as: (id, title, system prompt, sampling, model, messages)."""
    written = []
    for title, system, sampling, model, messages in chats:
        chat_id = store.create_chat(title, sampling, system, model)
        ids = [store.add_message(chat_id, role, content) for role, content in messages]
        written.append((chat_id, title, system, sampling, model,
                        [(mid, role, content, True) for mid, (role, content) in zip(ids, messages)]))
    return written


def _read(store: ChatStore, ids) -> list:
    out = []
    for chat_id in ids:
        c = store.load(chat_id)
        out.append((c.id, c.title, c.system_prompt, c.sampling, c.model,
                    [(m.id, m.role, m.content, m.complete) for m in c.messages]))
    return out


def _raw_rows(path, table: str, where: str = "", columns: str = "*") -> list:
    """Rows exactly as stored (text as bytes), read by a plain SQLite connection."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    conn.text_factory = bytes
    try:
        return conn.execute(f"SELECT {columns} FROM {table} {where} ORDER BY id").fetchall()
    finally:
        conn.close()


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_database_held_mid_transaction_in_journal_mode_is_never_moved(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    written = _write(store, CHATS * 20)
    store.close()
    # Another program: rollback-journal mode, an exclusive transaction and an update too big for its page cache,
    # so it spills into the main file before commit (the journal then holds the only copy of the old pages).
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("PRAGMA journal_mode = DELETE")
    holder.execute("PRAGMA cache_size = 10")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE messages SET content = content || ' (edited)'")
    journal = path.with_name(path.name + "-journal")
    assert journal.exists()
    journal_bytes = journal.read_bytes()
    try:
        store, warning = ChatStore.open(path)
        assert "in use by another program" in warning and "left as it is" in warning
        assert store.list_chats() == [] and not store.persistent
        store.close()
        assert journal.read_bytes() == journal_bytes           # nothing moved, nothing deleted
        assert not any(".unusable-" in p.name for p in tmp_path.iterdir())
        holder.execute("COMMIT")                                # the other program's commit goes through
    finally:
        holder.close()
    store, warning = ChatStore.open(path)
    assert warning is None
    edited = [(*c[:5], [(mid, role, content + " (edited)", done) for mid, role, content, done in c[5]])
              for c in written]
    assert _read(store, [c[0] for c in written]) == edited
    store.close()


def test_another_instance_reading_or_writing_in_wal_mode_leaves_the_store_writable(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    written = _write(store)
    store.close()
    for begin, statement in (("BEGIN", "SELECT COUNT(*) FROM messages"),
                             ("BEGIN IMMEDIATE", "UPDATE chats SET model = model")):   # a read, a write in progress
        other = sqlite3.connect(str(path), isolation_level=None)
        other.execute(begin)
        other.execute(statement).fetchall()
        try:
            store, warning = ChatStore.open(path)
            assert warning is None and store.read_only is None and store.persistent, begin
            assert _read(store, [c[0] for c in written]) == written
        finally:
            other.execute("COMMIT")
            other.close()
        message = store.add_message(written[0][0], "user", f"after {begin}")
        written[0][5].append((message, "user", f"after {begin}", True))
        store.close()


def test_a_write_ahead_log_beside_an_empty_main_file_is_kept_aside(tmp_path):
    path = tmp_path / CHATS_FILE
    wal = path.with_name(path.name + "-wal")
    store, _ = ChatStore.open(path)
    written = _write(store, CHATS[:3])
    # What a crash can leave: the chats are in the log, not yet copied into the main file.
    main_bytes, wal_bytes = path.read_bytes(), wal.read_bytes()
    store.close()
    path.write_bytes(b"")                 # the main file truncated to nothing
    wal.write_bytes(wal_bytes)
    store, warning = ChatStore.open(path)
    assert "write-ahead log held data" in warning and "moved aside" in warning
    assert store.list_chats() == []       # a fresh store...
    store.close()
    aside = next(p for p in tmp_path.iterdir() if ".unusable-" in p.name and p.suffix == ".sqlite3")
    aside_wal = aside.with_name(aside.name + "-wal")
    assert aside.name in warning and aside.read_bytes() == b"" and aside_wal.read_bytes() == wal_bytes
    # ...and the log kept as it was holds every chat: beside the main file it belonged to, they all read back.
    aside.write_bytes(main_bytes)
    kept, warning = ChatStore.open(aside)
    assert warning is None and _read(kept, [c[0] for c in written]) == written
    kept.close()


def test_a_damaged_main_file_is_moved_aside_with_every_companion(tmp_path):
    path = tmp_path / CHATS_FILE
    files = {"": b"this is not an SQLite database" + bytes(4096), "-wal": b"a log" * 100,
             "-journal": b"a journal" * 100, "-shm": bytes(32768)}
    for suffix, data in files.items():
        path.with_name(path.name + suffix).write_bytes(data)
    store, warning = ChatStore.open(path)
    assert "damaged" in warning and "moved aside" in warning
    store.close()
    aside = next(p for p in tmp_path.iterdir() if ".unusable-" in p.name and p.suffix == ".sqlite3")
    for suffix, data in files.items():
        if suffix != "-shm":           # SQLite may rewrite its shared-memory index; the rest is kept byte for byte
            assert aside.with_name(aside.name + suffix).read_bytes() == data, suffix
        assert aside.with_name(aside.name + suffix).exists(), suffix


def test_a_damaged_row_costs_only_its_chat_which_is_kept_aside(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    written = _write(store)
    store.close()
    colours, dragons, long, code, empty = (c[0] for c in written)
    damage = sqlite3.connect(str(path), isolation_level=None)
    damage.execute("UPDATE messages SET content = CAST('valid text' AS BLOB) WHERE chat_id = ?", (dragons,))
    damage.execute("UPDATE messages SET tokens = '[[1, \"a\", false, [], 5]]' WHERE id = ?",       # a number
                   (written[3][5][1][0],))
    damage.execute("UPDATE chats SET title = CAST(X'ff41' AS TEXT) WHERE id = ?", (empty,))       # not UTF-8
    damage.close()
    damaged = {dragons, code, empty}
    before = {cid: (_raw_rows(path, "chats", f"WHERE id = {cid}"), _raw_rows(path, "messages", f"WHERE chat_id = {cid}"))
              for cid in damaged}
    store, warning = ChatStore.open(path)
    assert "3 saved chat(s) could not be read" in warning and "chats_set_aside" in warning
    assert set(store.damaged) == damaged and "BLOB" in store.damaged[dragons]
    assert "'Code'" in store.damaged[code] and "message" in store.damaged[code]
    assert {c.id for c in store.list_chats()} == {colours, long}
    assert _read(store, [colours, long]) == [written[0], written[2]]     # the others load, as written
    for chat_id in (colours, long):
        chat = store.load(chat_id)
        assert chat_to_json(chat) and chat_to_markdown(chat)             # and export
    with pytest.raises(DamagedChat, match="set aside"):
        store.load(dragons)
    store.close()
    # The damaged chats' rows, as they were, in the set-aside tables of the same file.
    n_chat, n_message = 7, 7
    for cid in damaged:
        chats = [r[:n_chat] for r in _raw_rows(path, "chats_set_aside", f"WHERE id = {cid}")]
        messages = [r[:n_message] for r in _raw_rows(path, "messages_set_aside", f"WHERE chat_id = {cid}")]
        assert (chats, messages) == before[cid]
    # Reopened, nothing more is damaged and nothing more is said.
    again, warning = ChatStore.open(path)
    assert warning is None and {c.id for c in again.list_chats()} == {colours, long}
    again.close()


def test_the_schema_version_is_stamped_and_a_newer_or_foreign_file_is_not_written(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    written = _write(store)
    store.close()
    conn = sqlite3.connect(str(path))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    conn.execute("ALTER TABLE chats ADD COLUMN mood TEXT")
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    digest = _sha(path)
    store, warning = ChatStore.open(path)
    assert "read-only" in warning and "newer" in warning and store.read_only
    assert _read(store, [c[0] for c in written]) == written              # readable, row by row
    with pytest.raises(ReadOnlyChatStore, match="read-only"):
        store.create_chat("New", {})
    with pytest.raises(ReadOnlyChatStore, match="read-only"):
        store.add_message(written[0][0], "user", "more")
    store.close()
    assert _sha(path) == digest                                           # not one byte written
    conn = sqlite3.connect(str(path))
    conn.execute("PRAGMA user_version = 1")
    conn.execute("PRAGMA application_id = 1234")
    conn.commit()
    conn.close()
    store, warning = ChatStore.open(path)
    assert "another application" in warning and store.read_only
    store.close()


def test_a_file_from_before_versions_is_upgraded_and_stamped(tmp_path):
    path = tmp_path / CHATS_FILE
    conn = sqlite3.connect(str(path))
    conn.executescript("""
        CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT, sampling TEXT NOT NULL,
                            model TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY, chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
                               role TEXT NOT NULL, content TEXT NOT NULL, complete INTEGER NOT NULL DEFAULT 1,
                               created REAL NOT NULL);
        INSERT INTO chats VALUES (1, 'Old', NULL, '{}', '', 1.0, 2.0);
        INSERT INTO messages VALUES (1, 1, 'user', 'hello', 1, 1.5);
    """)
    conn.close()
    store, warning = ChatStore.open(path)
    assert warning is None and _read(store, [1]) == [(1, "Old", None, {}, "", [(1, "user", "hello", True)])]
    store.close()
    conn = sqlite3.connect(str(path))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


def test_text_that_cannot_be_encoded_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / CHATS_FILE
    store, _ = ChatStore.open(path)
    written = _write(store)
    chat_id = written[0][0]
    reply = store.begin_reply(chat_id)
    reply.finish("done")
    written[0][5].append((reply.message_id, "assistant", "done", True))
    snapshot = (_raw_rows(path, "chats"), _raw_rows(path, "messages"))
    bad = "hi \ud800 there"
    for call in (lambda: store.add_message(chat_id, "user", bad), lambda: store.create_chat(bad, {}),
                 lambda: store.create_chat("ok", {"stop": [bad]}), lambda: store.rename(chat_id, bad),
                 lambda: store.set_system_prompt(chat_id, bad), lambda: store.set_model(chat_id, bad),
                 lambda: store.update_message(reply.message_id, bad, True)):
        with pytest.raises(UnstorableText, match="lone surrogate"):
            call()
    with pytest.raises(ValueError, match="nothing was written"):       # a ValueError too, for callers of either
        store.add_message(chat_id, "assistant", "\udfff")
    assert (_raw_rows(path, "chats"), _raw_rows(path, "messages")) == snapshot
    assert _read(store, [c[0] for c in written]) == written
    store.close()
