"""Saved chats: one SQLite file (WAL mode) under the user data dir, written as a chat happens.

Each chat keeps its title, system prompt, sampling settings, model and messages. A streaming reply is written
at most every FLUSH_INTERVAL seconds and at its end (`StreamingReply`), so an app killed mid-reply keeps it up
to the last write (marked incomplete). A file SQLite cannot use (corrupt, or locked past the busy timeout) is
renamed aside and a fresh one started: the old chats stay in the renamed file, and `ChatStore.open` says so.
Qt-free: the window and any other front-end use it the same way. One thread per store.
"""
from __future__ import annotations

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
BUSY_TIMEOUT_MS = 2000
MAX_TITLE = 200
ROLES = ("user", "assistant")
EXPORT_FORMAT = "larql-desktop-chat/1"

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


class ChatStoreError(Exception):
    """The chats database failed (the message says what); the chat in memory is unaffected."""


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
    """Rename the database (and its WAL files) to a name beside it that says why and when."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.stem}.unusable-{stamp}{path.suffix}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.stem}.unusable-{stamp}-{n}{path.suffix}")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    path.rename(target)
    return target


def _connect(path: Path | str) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if str(path) != ":memory:":
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise sqlite3.OperationalError(f"could not switch to WAL mode (got {mode})")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {check}")
        conn.executescript(_SCHEMA)
        columns = {row[1] for row in conn.execute("PRAGMA table_info(messages)")}
        if "tokens" not in columns:   # a file from before token details were kept
            conn.execute("ALTER TABLE messages ADD COLUMN tokens TEXT")
        return conn
    except BaseException:
        conn.close()
        raise


class ChatStore:
    def __init__(self, conn: sqlite3.Connection, where: str):
        self._conn = conn
        self.where = where

    @classmethod
    def open(cls, path: Path) -> tuple["ChatStore", str | None]:
        """The store at `path` and a message for the user if the file had to be set aside (None otherwise).
        If even a fresh file cannot be made (e.g. the folder is read-only), chats live in memory for this run."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return cls(_connect(path), str(path)), None
        except sqlite3.Error as exc:
            problem = "locked by another program" if "locked" in str(exc).lower() else "damaged"
            log.warning("the chats database %s is unusable (%s)", path, exc)
            try:
                aside = _set_aside(path)
                store = cls(_connect(path), str(path))
            except (OSError, sqlite3.Error) as exc2:
                log.error("no chats database could be made at %s (%s); chats are kept in memory", path, exc2)
                return cls(_connect(":memory:"), ":memory:"), (
                    f"the saved chats at {path} could not be opened ({exc}) nor a new file made ({exc2}); "
                    "this run's chats will not be saved.")
            return store, (f"the saved chats database was {problem} ({exc}); it was moved aside to {aside} "
                           "(its chats are still in that file) and a new one started.")
        except OSError as exc:
            return cls(_connect(":memory:"), ":memory:"), (
                f"the saved chats folder {path.parent} cannot be used ({exc}); this run's chats will not be saved.")

    def close(self) -> None:
        self._conn.close()

    def conn_journal_mode(self) -> str:
        return self._conn.execute("PRAGMA journal_mode").fetchone()[0].lower()

    def _run(self, sql: str, args=()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, args)
        except sqlite3.Error as exc:
            raise ChatStoreError(f"saving chats failed ({exc}) in {self.where}") from exc

    # --- chats ---

    def create_chat(self, title: str, sampling: dict, system_prompt: str | None = None, model: str = "") -> int:
        now = time.time()
        cur = self._run("INSERT INTO chats(title, system_prompt, sampling, model, created, updated) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (_title(title), system_prompt, json.dumps(sampling), model, now, now))
        return int(cur.lastrowid)

    def exists(self, chat_id: int) -> bool:
        return self._run("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is not None

    def list_chats(self, search: str = "") -> list[ChatSummary]:
        """Most recently updated first; `search` matches titles and message text (case-insensitive)."""
        sql = ("SELECT c.id, c.title, c.model, c.created, c.updated, "
               "(SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id) FROM chats c")
        args: tuple = ()
        if search.strip():
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            sql += (" WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m WHERE "
                    "m.chat_id = c.id AND m.content LIKE ? ESCAPE '\\')")
            args = (pattern, pattern)
        rows = self._run(sql + " ORDER BY c.updated DESC, c.id DESC", args).fetchall()
        return [ChatSummary(int(r[0]), r[1], r[2], r[3], r[4], int(r[5])) for r in rows]

    def load(self, chat_id: int) -> StoredChat:
        row = self._run("SELECT id, title, system_prompt, sampling, model, created, updated FROM chats "
                        "WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise ChatStoreError(f"there is no saved chat {chat_id}")
        try:
            sampling = json.loads(row[3])
        except ValueError:
            sampling = {}
        messages = tuple(StoredMessage(int(m[0]), m[1], m[2], bool(m[3]), m[4], decode_tokens(m[5])) for m in self._run(
            "SELECT id, role, content, complete, created, tokens FROM messages WHERE chat_id = ? ORDER BY id",
            (chat_id,)).fetchall())
        return StoredChat(int(row[0]), row[1], row[2], sampling if isinstance(sampling, dict) else {}, row[4],
                          row[5], row[6], messages)

    def rename(self, chat_id: int, title: str) -> None:
        self._update(chat_id, "title", _title(title))

    def set_system_prompt(self, chat_id: int, system_prompt: str | None) -> None:
        self._update(chat_id, "system_prompt", system_prompt)

    def set_sampling(self, chat_id: int, sampling: dict) -> None:
        self._update(chat_id, "sampling", json.dumps(sampling))

    def set_model(self, chat_id: int, model: str) -> None:
        self._update(chat_id, "model", model)

    def _update(self, chat_id: int, column: str, value) -> None:
        cur = self._run(f"UPDATE chats SET {column} = ?, updated = ? WHERE id = ?", (value, time.time(), chat_id))
        if cur.rowcount == 0:
            raise ChatStoreError(f"there is no saved chat {chat_id}")

    def delete(self, chat_id: int) -> None:
        self._run("DELETE FROM chats WHERE id = ?", (chat_id,))

    # --- messages ---

    def add_message(self, chat_id: int, role: str, content: str, complete: bool = True) -> int:
        if role not in ROLES:
            raise ValueError(f"a chat message's role is one of {', '.join(ROLES)}, not {role!r}")
        now = time.time()
        cur = self._run("INSERT INTO messages(chat_id, role, content, complete, created) VALUES (?, ?, ?, ?, ?)",
                        (chat_id, role, content, int(complete), now))
        self._run("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        return int(cur.lastrowid)

    def update_message(self, message_id: int, content: str, complete: bool, tokens: str | None = None) -> None:
        if tokens is None:
            self._run("UPDATE messages SET content = ?, complete = ? WHERE id = ?",
                      (content, int(complete), message_id))
        else:
            self._run("UPDATE messages SET content = ?, complete = ?, tokens = ? WHERE id = ?",
                      (content, int(complete), tokens, message_id))

    def drop_last_reply(self, chat_id: int) -> None:
        """Regenerating: the chat's last message goes if it is a reply."""
        row = self._run("SELECT id, role FROM messages WHERE chat_id = ? ORDER BY id DESC LIMIT 1",
                        (chat_id,)).fetchone()
        if row is not None and row[1] == "assistant":
            self._run("DELETE FROM messages WHERE id = ?", (row[0],))

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


def decode_tokens(text: str | None) -> tuple[TokenStep, ...]:
    """The tokens `encode_tokens` wrote (timings are not kept); () for none or for anything unreadable."""
    if not text:
        return ()
    try:
        steps = []
        for index, (token_id, token_text, stop, alternatives, layers) in enumerate(json.loads(text)):
            outcomes = []
            for layer, code in enumerate(layers.split(",") if layers else ()):
                outcome, _, detail = code.partition(":")
                outcomes.append(LayerOutcome(layer, outcome, detail if outcome == "hit" else None,
                                             detail if outcome != "hit" and detail else None))
            steps.append(TokenStep(int(token_id), str(token_text), index, 0.0, 0, bool(stop),
                                   tuple(Alternative(int(i), str(t), float(p)) for i, t, p in alternatives),
                                   tuple(outcomes)))
        return tuple(steps)
    except (ValueError, TypeError) as exc:
        log.info("unreadable token details in the chats database (%s); left out", exc)
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
