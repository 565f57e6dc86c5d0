"""Saved chats: one SQLite file (WAL mode) under the user data dir, written as a chat happens.

Each chat keeps its title, system prompt, sampling settings, model and messages. A streaming reply is written
at most every FLUSH_INTERVAL seconds and at its end (`StreamingReply`), so an app killed mid-reply keeps it up
to the last write (marked incomplete). Qt-free: the window and any other front-end use it the same way. One thread
per store.

Saved chats are never lost or silently changed (`ChatStore.open` says what it did, the window shows it):
  * a file another program holds (locked past the busy timeout) is never renamed: it is opened read-only if it
    can be read, else this run's chats are kept in memory; the file is left exactly as the other program has it;
  * a file SQLite cannot use (damaged), or a write-ahead log beside an empty or missing main file (SQLite would
    ignore the log and then delete it), is moved aside with every companion (-wal, -shm, -journal) and a fresh
    file started: the old chats stay in the renamed files;
  * a chat with a damaged row (a number or a BLOB where text belongs, text that is not UTF-8, unreadable token
    details) is moved, rows intact, to the tables chats_set_aside / messages_set_aside of the same file and
    reported; the other chats load;
  * the file is stamped with this schema's version and application id (PRAGMA user_version, application_id): a
    newer or foreign one is opened read-only, never written;
  * text that cannot be encoded (a lone surrogate) is refused before anything is written.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from larql_desktop.engine.model.generation import Alternative, TokenStep
from larql_desktop.engine.model.outcomes import LayerOutcome

log = logging.getLogger(__name__)

CHATS_FILE = "chats.sqlite3"
FLUSH_INTERVAL = 0.5        # seconds between writes of a streaming reply
BUSY_TIMEOUT_MS = 2000      # how long a locked file is waited for before it is opened read-only (or not at all)
MAX_TITLE = 200
ROLES = ("user", "assistant")
EXPORT_FORMAT = "larql-desktop-chat/1"
SCHEMA_VERSION = 1                  # PRAGMA user_version of a file this code writes
APPLICATION_ID = 0x4C514443         # PRAGMA application_id: "LQDC"
COMPANIONS = ("-wal", "-shm", "-journal")
CHAT_COLUMNS = ("id", "title", "system_prompt", "sampling", "model", "created", "updated")
MESSAGE_COLUMNS = ("id", "chat_id", "role", "content", "complete", "created", "tokens")
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT,              -- NULL: the chat template's default
    sampling TEXT NOT NULL,          -- JSON of SamplingSettings.to_dict()
    model TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    complete INTEGER NOT NULL DEFAULT 1,   -- 0: a reply still streaming, or cut off by a crash
    created REAL NOT NULL,
    tokens TEXT                             -- a finished reply's token details (JSON, see encode_tokens)
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, id);
"""
# Damaged chats' rows, as they were: columns without a declared type, so SQLite converts nothing on the way in.
_SET_ASIDE_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS chats_set_aside ({", ".join(CHAT_COLUMNS)}, problem, set_aside_at);
CREATE TABLE IF NOT EXISTS messages_set_aside ({", ".join(MESSAGE_COLUMNS)}, set_aside_at);
"""
_OUR_TABLES = {"chats", "messages", "chats_set_aside", "messages_set_aside"}


class ChatStoreError(Exception):
    """The chats database failed (the message says what); the chat in memory is unaffected."""


class ReadOnlyChatStore(ChatStoreError):
    """A write to a store opened read-only (a newer or foreign file, or one another program holds)."""


class DamagedChat(ChatStoreError):
    """A saved chat whose rows cannot be read as written; it has been set aside (if the store is writable)."""


class UnstorableText(ChatStoreError, ValueError):
    """Text that cannot be encoded as UTF-8 (a lone surrogate): refused before anything is written."""


class _RefusedSchema(sqlite3.DatabaseError):
    """A file this code must not write: a newer schema version or another application's database."""


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    complete: bool
    created: float
    tokens: tuple[TokenStep, ...] = ()   # a reply's tokens with their alternatives and FFN outcomes, if kept


@dataclass(frozen=True)
class ChatSummary:
    id: int
    title: str
    model: str
    created: float
    updated: float
    messages: int


@dataclass(frozen=True)
class StoredChat:
    id: int
    title: str
    system_prompt: str | None
    sampling: dict
    model: str
    created: float
    updated: float
    messages: tuple[StoredMessage, ...]


def _set_aside(path: Path) -> Path:
    """Rename the database and every companion file (WAL, shared memory, rollback journal) to names beside it that
    say why and when, together: a journal or log away from its database would be read against the wrong file."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.stem}.unusable-{stamp}{path.suffix}")
    n = 1
    while any(target.with_name(target.name + s).exists() for s in ("",) + COMPANIONS):
        n += 1
        target = path.with_name(f"{path.stem}.unusable-{stamp}-{n}{path.suffix}")
    moved: list[tuple[Path, Path]] = []
    try:
        for suffix in ("",) + COMPANIONS:
            source = path.with_name(path.name + suffix)
            if source.exists():
                source.rename(target.with_name(target.name + suffix))
                moved.append((source, target.with_name(target.name + suffix)))
    except OSError:
        for source, renamed in reversed(moved):      # all or nothing
            renamed.rename(source)
        raise
    return target


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    return "locked" in str(exc).lower() or "busy" in str(exc).lower()


def _orphaned_log(path: Path) -> bool:
    """A write-ahead log with data beside a main file that is missing or empty: SQLite would open the empty file
    as a new database, ignore the log's chats and then delete the log."""
    wal = path.with_name(path.name + "-wal")
    return wal.exists() and wal.stat().st_size > 0 and (not path.exists() or path.stat().st_size == 0)


def _check_header(path: Path) -> None:
    """Refuse a non-empty file that does not start as an SQLite database, before SQLite opens it: opening one
    deletes its rollback journal and, on close, its write-ahead log, which must be kept with it."""
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                raise sqlite3.DatabaseError("file is not a database (it does not start with SQLite's header)")


def _check_schema(conn: sqlite3.Connection) -> None:
    """Raise _RefusedSchema for a file this code must not write (reading its header waits out a lock)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    if app_id not in (0, APPLICATION_ID):
        raise _RefusedSchema(f"it belongs to another application (application_id {app_id:#x})")
    if version > SCHEMA_VERSION:
        raise _RefusedSchema(f"it was written by a newer larql-desktop (schema version {version}; this one "
                             f"knows {SCHEMA_VERSION})")
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                         "AND name NOT LIKE 'sqlite_%'")}
    if tables - _OUR_TABLES:
        raise _RefusedSchema(f"it holds tables that are not larql-desktop's ({', '.join(sorted(tables - _OUR_TABLES))})")
    for table, known in (("chats", set(CHAT_COLUMNS)), ("messages", set(MESSAGE_COLUMNS))):
        columns = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        if columns - known:
            raise _RefusedSchema(f"its {table} table has columns this version does not know "
                                 f"({', '.join(sorted(columns - known))})")


def _is_current(conn: sqlite3.Connection) -> bool:
    """The file already has this schema, complete, and its stamps."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
    return (conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            and conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
            and _OUR_TABLES | {"messages_by_chat"} <= tables
            and {r[1] for r in conn.execute("PRAGMA table_info(messages)")} == set(MESSAGE_COLUMNS))


def _connect(path: Path | str) -> sqlite3.Connection:
    """A read-write connection to a checked file with the current schema, stamped with its version."""
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _check_schema(conn)     # before anything is written: a refused file is left as it is
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {check}")
        if str(path) != ":memory:":
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise sqlite3.OperationalError(f"could not switch to WAL mode (got {mode})")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        if _is_current(conn):
            return conn         # nothing to set up: no write, so another instance writing now costs no wait
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in filter(str.strip, (_SCHEMA + _SET_ASIDE_SCHEMA).split(";")):
                conn.execute(statement)
            columns = {row[1] for row in conn.execute("PRAGMA table_info(messages)")}
            if "tokens" not in columns:   # a file from before token details were kept
                conn.execute("ALTER TABLE messages ADD COLUMN tokens TEXT")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return conn
    except BaseException:
        conn.close()
        raise


def _connect_read_only(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000,
                           isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()    # waits out a lock, or fails
        return conn
    except BaseException:
        conn.close()
        raise


def _storable(what: str, value) -> None:
    """Refuse (before anything is written) text SQLite cannot store: a lone surrogate has no UTF-8 encoding."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnstorableText(f"the {what} holds a character that cannot be saved (a lone surrogate, "
                                 f"{value[exc.start]!r} at {exc.start}); nothing was written") from None


class _StoredText(bytes):
    """A TEXT value's bytes as SQLite holds them (the connection's text_factory), told apart from a BLOB's."""


def _text(value) -> str:
    """A stored text, strictly: anything else (a number, a BLOB, text that is not UTF-8) is damage."""
    if isinstance(value, _StoredText):
        return value.decode("utf-8")       # UnicodeDecodeError: damage
    if isinstance(value, bytes):
        raise TypeError("a BLOB where text belongs")
    if not isinstance(value, str):
        raise TypeError(f"{type(value).__name__} where text belongs")
    return value


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "text" if isinstance(value, _StoredText) else "a BLOB" if isinstance(value, bytes) else type(value).__name__
        raise TypeError(f"{kind} where a time belongs")
    return float(value)


def _read_chat_row(row) -> tuple:
    cid, title, system_prompt, sampling, model, created, updated = row
    sampling = json.loads(_text(sampling))
    if not isinstance(sampling, dict):
        raise TypeError("the sampling settings are not a JSON object")
    return (int(cid), _text(title), None if system_prompt is None else _text(system_prompt), sampling,
            _text(model), _number(created), _number(updated))


def _read_message_row(row, with_tokens: bool) -> StoredMessage:
    mid, role, content, complete, created, tokens = row
    role = _text(role)
    if role not in ROLES:
        raise ValueError(f"role {role!r}")
    if complete not in (0, 1) or isinstance(complete, float):
        raise ValueError(f"complete flag {complete!r}")
    steps = _decode_tokens_strict(None if tokens is None else _text(tokens)) if with_tokens else ()
    return StoredMessage(int(mid), role, _text(content), bool(complete), _number(created), steps)


class ChatStore:
    def __init__(self, conn: sqlite3.Connection, where: str, read_only: str | None = None):
        self._conn = conn
        self.where = where
        self.read_only = read_only          # why the store is read-only, or None
        self.damaged: dict[int, str] = {}   # chats found damaged: id -> what (set aside, or hidden when read-only)
        # Text columns are read as bytes and decoded here, so text that is not UTF-8 costs its chat, not a query.
        conn.text_factory = _StoredText

    @property
    def persistent(self) -> bool:
        return self.where != ":memory:"

    @classmethod
    def open(cls, path: Path) -> tuple["ChatStore", str | None]:
        """The store at `path` and a message for the user if anything was not as it should be (None otherwise):
        the file moved aside, opened read-only, not opened at all (chats kept in memory this run), or damaged
        chats set aside."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return cls(_connect(":memory:"), ":memory:"), (
                f"the saved chats folder {path.parent} cannot be used ({exc}); this run's chats will not be saved.")
        notes: list[str] = []
        store = None
        if _orphaned_log(path):
            aside = _set_aside(path)
            notes.append(f"the saved chats file was empty but its write-ahead log held data: both were moved aside "
                         f"to {aside} (with {aside.name}-wal as it was) and a new one started.")
        try:
            _check_header(path)
            store = cls(_connect(path), str(path))
        except _RefusedSchema as exc:
            log.warning("the chats database %s is not ours to write (%s)", path, exc)
            try:
                store = cls(_connect_read_only(path), str(path), read_only=str(exc))
                notes.append(f"the saved chats at {path} are open read-only: {exc}. New chats are not saved.")
            except sqlite3.Error as exc2:
                return cls._in_memory(path, f"{exc}; it cannot be read either ({exc2})")
        except sqlite3.Error as exc:
            if _is_busy(exc):
                # Another program holds the file: never rename it under its feet (its journal would be separated
                # from it). Read it if it can be read; otherwise leave it alone for this run.
                log.warning("the chats database %s is held by another program (%s)", path, exc)
                try:
                    store = cls(_connect_read_only(path), str(path), read_only="another program is using it")
                    notes.append(f"the saved chats at {path} are in use by another program ({exc}): they are open "
                                 "read-only and new chats are not saved until the app is restarted.")
                except sqlite3.Error as exc2:
                    return cls._in_memory(path, f"it is in use by another program ({exc2}); it was left as it is")
            else:
                log.warning("the chats database %s is unusable (%s)", path, exc)
                try:
                    aside = _set_aside(path)
                    store = cls(_connect(path), str(path))
                except (OSError, sqlite3.Error) as exc2:
                    log.error("no chats database could be made at %s (%s); chats are kept in memory", path, exc2)
                    return cls._in_memory(path, f"it could not be opened ({exc}) nor a new file made ({exc2})")
                notes.append(f"the saved chats database was damaged ({exc}); it was moved aside to {aside} (its "
                             "chats are still in that file) and a new one started.")
        damaged = store.set_aside_damaged()
        if damaged:
            where = ("they are hidden this run" if store.read_only else
                     "their rows were moved, as they were, to the tables chats_set_aside and messages_set_aside "
                     f"of {path}")
            notes.append(f"{len(damaged)} saved chat(s) could not be read ({'; '.join(damaged.values())}): {where}. "
                         "The other chats are fine.")
        return store, " ".join(notes) or None

    @classmethod
    def _in_memory(cls, path: Path, why: str) -> tuple["ChatStore", str]:
        return cls(_connect(":memory:"), ":memory:"), (
            f"the saved chats at {path} could not be opened: {why}. This run's chats are kept in memory only.")

    def close(self) -> None:
        self._conn.close()

    def conn_journal_mode(self) -> str:
        return self._text_of(self._conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()

    @staticmethod
    def _text_of(value) -> str:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    def _run(self, sql: str, args=()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, args)
        except sqlite3.Error as exc:
            raise ChatStoreError(f"saving chats failed ({exc}) in {self.where}") from exc

    def _write(self, sql: str, args=()) -> sqlite3.Cursor:
        if self.read_only:
            raise ReadOnlyChatStore(f"the saved chats are open read-only ({self.read_only}); this change is not saved")
        return self._run(sql, args)

    @contextlib.contextmanager
    def _transaction(self):
        """Several writes as one: all of them or none."""
        self._write("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._run("COMMIT")

    # --- damage ---

    def _check_chat(self, chat_id: int) -> str | None:
        """What is wrong with a saved chat's rows (None: nothing)."""
        try:
            row = self._run(f"SELECT {', '.join(CHAT_COLUMNS)} FROM chats WHERE id = ?", (chat_id,)).fetchone()
            title = _read_chat_row(row)[1]
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            return f"chat {chat_id}: {exc}"
        for m in self._run("SELECT id, role, content, complete, created, tokens FROM messages WHERE chat_id = ? "
                           "ORDER BY id", (chat_id,)):
            try:
                _read_message_row(m, with_tokens=True)
            except (TypeError, ValueError, UnicodeDecodeError) as exc:
                return f"{title!r} (chat {chat_id}), message {m[0]}: {exc}"
        return None

    def set_aside_damaged(self) -> dict[int, str]:
        """Check every saved chat; move each damaged one (its rows as they are) to the set-aside tables, or hide it
        if the store is read-only. Returns the damaged chats found now: id -> what is wrong."""
        found = {}
        for (chat_id,) in self._run("SELECT id FROM chats ORDER BY id").fetchall():
            problem = self._check_chat(int(chat_id))
            if problem is not None:
                found[int(chat_id)] = problem
                self._set_chat_aside(int(chat_id), problem)
        return found

    def _set_chat_aside(self, chat_id: int, problem: str) -> None:
        log.warning("saved chat %s is damaged (%s); set aside", chat_id, problem)
        self.damaged[chat_id] = problem
        if self.read_only:
            return
        now = time.time()
        with self._transaction():
            self._write(f"INSERT INTO chats_set_aside SELECT {', '.join(CHAT_COLUMNS)}, ?, ? FROM chats WHERE id = ?",
                        (problem, now, chat_id))
            self._write(f"INSERT INTO messages_set_aside SELECT {', '.join(MESSAGE_COLUMNS)}, ? FROM messages "
                        "WHERE chat_id = ? ORDER BY id", (now, chat_id))
            self._write("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
            self._write("DELETE FROM chats WHERE id = ?", (chat_id,))

    # --- chats ---

    def create_chat(self, title: str, sampling: dict, system_prompt: str | None = None, model: str = "") -> int:
        title = _title(title)
        sampling_json = json.dumps(sampling, ensure_ascii=False)
        for what, value in (("title", title), ("system prompt", system_prompt), ("sampling settings", sampling_json),
                            ("model name", model)):
            _storable(what, value)
        now = time.time()
        cur = self._write("INSERT INTO chats(title, system_prompt, sampling, model, created, updated) "
                          "VALUES (?, ?, ?, ?, ?, ?)", (title, system_prompt, sampling_json, model, now, now))
        return int(cur.lastrowid)

    def exists(self, chat_id: int) -> bool:
        return chat_id not in self.damaged and \
            self._run("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is not None

    def list_chats(self, search: str = "") -> list[ChatSummary]:
        """Most recently updated first; `search` matches titles and message text (case-insensitive)."""
        sql = ("SELECT c.id, c.title, c.model, c.created, c.updated, "
               "(SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id) FROM chats c")
        args: tuple = ()
        if search.strip():
            _storable("search", search)
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            sql += (" WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m WHERE "
                    "m.chat_id = c.id AND m.content LIKE ? ESCAPE '\\')")
            args = (pattern, pattern)
        out = []
        for r in self._run(sql + " ORDER BY c.updated DESC, c.id DESC", args).fetchall():
            if int(r[0]) in self.damaged:
                continue
            try:
                out.append(ChatSummary(int(r[0]), _text(r[1]), _text(r[2]), _number(r[3]), _number(r[4]), int(r[5])))
            except (TypeError, ValueError, UnicodeDecodeError) as exc:    # damaged since the store was opened
                self._set_chat_aside(int(r[0]), f"chat {r[0]}: {exc}")
        return out

    def load(self, chat_id: int) -> StoredChat:
        """A saved chat as written. A chat found damaged is set aside and raises DamagedChat."""
        if chat_id in self.damaged:
            raise DamagedChat(f"saved chat {chat_id} is damaged and was set aside: {self.damaged[chat_id]}")
        row = self._run(f"SELECT {', '.join(CHAT_COLUMNS)} FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise ChatStoreError(f"there is no saved chat {chat_id}")
        try:
            fields = _read_chat_row(row)
            messages = tuple(_read_message_row(m, with_tokens=True) for m in self._run(
                "SELECT id, role, content, complete, created, tokens FROM messages WHERE chat_id = ? ORDER BY id",
                (chat_id,)).fetchall())
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            problem = f"chat {chat_id}: {exc}"
            self._set_chat_aside(chat_id, problem)
            raise DamagedChat(f"saved chat {chat_id} is damaged ({exc}); it was set aside") from None
        return StoredChat(*fields, messages)

    def rename(self, chat_id: int, title: str) -> None:
        title = _title(title)
        _storable("title", title)
        self._update(chat_id, "title", title)

    def set_system_prompt(self, chat_id: int, system_prompt: str | None) -> None:
        _storable("system prompt", system_prompt)
        self._update(chat_id, "system_prompt", system_prompt)

    def set_sampling(self, chat_id: int, sampling: dict) -> None:
        sampling_json = json.dumps(sampling, ensure_ascii=False)
        _storable("sampling settings", sampling_json)
        self._update(chat_id, "sampling", sampling_json)

    def set_model(self, chat_id: int, model: str) -> None:
        _storable("model name", model)
        self._update(chat_id, "model", model)

    def _update(self, chat_id: int, column: str, value) -> None:
        cur = self._write(f"UPDATE chats SET {column} = ?, updated = ? WHERE id = ?", (value, time.time(), chat_id))
        if cur.rowcount == 0:
            raise ChatStoreError(f"there is no saved chat {chat_id}")

    def delete(self, chat_id: int) -> None:
        self._write("DELETE FROM chats WHERE id = ?", (chat_id,))

    # --- messages ---

    def add_message(self, chat_id: int, role: str, content: str, complete: bool = True) -> int:
        if role not in ROLES:
            raise ValueError(f"a chat message's role is one of {', '.join(ROLES)}, not {role!r}")
        _storable("message", content)
        now = time.time()
        with self._transaction():
            cur = self._write("INSERT INTO messages(chat_id, role, content, complete, created) VALUES (?, ?, ?, ?, ?)",
                              (chat_id, role, content, int(complete), now))
            self._write("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return int(cur.lastrowid)

    def update_message(self, message_id: int, content: str, complete: bool, tokens: str | None = None) -> None:
        _storable("message", content)
        _storable("token details", tokens)
        if tokens is None:
            self._write("UPDATE messages SET content = ?, complete = ? WHERE id = ?",
                        (content, int(complete), message_id))
        else:
            self._write("UPDATE messages SET content = ?, complete = ?, tokens = ? WHERE id = ?",
                        (content, int(complete), tokens, message_id))

    def drop_last_reply(self, chat_id: int) -> None:
        """Regenerating: the chat's last message goes if it is a reply."""
        row = self._run("SELECT id, role FROM messages WHERE chat_id = ? ORDER BY id DESC LIMIT 1",
                        (chat_id,)).fetchone()
        if row is not None and row[1] in ("assistant", b"assistant"):
            self._write("DELETE FROM messages WHERE id = ?", (row[0],))

    def begin_reply(self, chat_id: int, clock: Callable[[], float] = time.monotonic) -> "StreamingReply":
        return StreamingReply(self, self.add_message(chat_id, "assistant", "", complete=False), clock)


class StreamingReply:
    """The reply being streamed into one message row: written at most every FLUSH_INTERVAL s and at the end."""

    def __init__(self, store: ChatStore, message_id: int, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.message_id = message_id
        self._clock = clock
        self._text: list[str] = []
        self._last_flush = clock()
        self.flushes = 0

    @property
    def text(self) -> str:
        return "".join(self._text)

    def append(self, text: str) -> None:
        self._text.append(text)
        if self._clock() - self._last_flush >= FLUSH_INTERVAL:
            self.flush()

    def flush(self) -> None:
        self.store.update_message(self.message_id, self.text, complete=False)
        self._last_flush = self._clock()
        self.flushes += 1

    def finish(self, full_text: str | None = None, tokens: Sequence | None = None) -> None:
        """The reply ended (complete, stopped or failed): store its whole text as final, and its tokens' details
        (TokenSteps or anything with their fields) for the token view."""
        self.store.update_message(self.message_id, self.text if full_text is None else full_text, complete=True,
                                  tokens=encode_tokens(tokens) if tokens else None)


def encode_tokens(steps: Sequence) -> str:
    """Compact JSON of a reply's tokens: [id, text, is_stop, [[id, text, p], …], "outcome:tier-or-reason,…"]."""
    return json.dumps([[int(s.token_id), s.text, bool(s.is_stop),
                        [[a.token_id, a.text, round(a.probability, 7)] for a in s.alternatives],
                        ",".join(f"{o.outcome}:{o.tier or o.bypass or ''}" for o in s.layers)] for s in steps],
                      ensure_ascii=False, separators=(",", ":"))


def _decode_tokens_strict(text: str | None) -> tuple[TokenStep, ...]:
    """The tokens `encode_tokens` wrote (timings are not kept); () for none. Anything else raises (TypeError,
    ValueError): the row is damaged."""
    if not text:
        return ()
    steps = []
    for index, (token_id, token_text, stop, alternatives, layers) in enumerate(json.loads(text)):
        if not isinstance(token_text, str) or not isinstance(layers, str) or not isinstance(stop, bool):
            raise TypeError(f"token {index}'s details are not what was written")
        outcomes = []
        for layer, code in enumerate(layers.split(",") if layers else ()):
            outcome, _, detail = code.partition(":")
            outcomes.append(LayerOutcome(layer, outcome, detail if outcome == "hit" else None,
                                         detail if outcome != "hit" and detail else None))
        steps.append(TokenStep(int(token_id), token_text, index, 0.0, 0, stop,
                               tuple(Alternative(int(i), str(t), float(p)) for i, t, p in alternatives),
                               tuple(outcomes)))
    return tuple(steps)


def decode_tokens(text: str | None) -> tuple[TokenStep, ...]:
    """The tokens `encode_tokens` wrote; () for none or for anything unreadable."""
    try:
        return _decode_tokens_strict(text)
    except (ValueError, TypeError) as exc:
        log.info("unreadable token details (%s); left out", exc)
        return ()


def _title(title: str) -> str:
    title = " ".join(str(title).split())[:MAX_TITLE]
    if not title:
        raise ValueError("a chat's title cannot be empty")
    return title


# --- export ---

def chat_to_dict(chat: StoredChat) -> dict:
    return {"format": EXPORT_FORMAT, "title": chat.title, "model": chat.model,
            "system_prompt": chat.system_prompt, "sampling": chat.sampling,
            "created": chat.created, "updated": chat.updated,
            "messages": [{"role": m.role, "content": m.content, "complete": m.complete, "created": m.created}
                         for m in chat.messages]}


def chat_to_json(chat: StoredChat) -> str:
    return json.dumps(chat_to_dict(chat), ensure_ascii=False, indent=2) + "\n"


def chat_to_markdown(chat: StoredChat, default_system_prompt: str | None = None) -> str:
    """A readable Markdown file: the title, what produced the chat, then each turn under its own heading
    (a reply's Markdown is kept as written, so its code blocks and lists stay what they were)."""
    lines = [f"# {chat.title}", ""]
    if chat.model:
        lines.append(f"- Model: {chat.model}")
    system = chat.system_prompt if chat.system_prompt is not None else default_system_prompt
    if system is not None:
        note = "" if chat.system_prompt is not None else " (the template's default)"
        lines.append(f"- System prompt{note}: {system}" if "\n" not in system
                     else f"- System prompt{note}:\n\n" + "\n".join(f"  > {x}" for x in system.splitlines()))
    if chat.sampling:
        lines.append("- Sampling: " + ", ".join(f"{k} {v}" for k, v in chat.sampling.items()))
    lines.append(f"- Saved: {time.strftime('%Y-%m-%d %H:%M', time.localtime(chat.updated))}")
    for m in chat.messages:
        heading = "You" if m.role == "user" else "Assistant" + ("" if m.complete else " (interrupted)")
        lines += ["", f"## {heading}", "", m.content.rstrip()]
    return "\n".join(lines) + "\n"
