"""The embedded L3 backend: one SQLite file (WAL) with a background writer, an in-memory index of its keys, and
file locks that let several processes share it (see the package docstring)."""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import sqlite3
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

from larql_desktop.engine.cache.l3.codec import namespace_id, signed_key
from larql_desktop.engine.cache.l3.contract import RETRY_AFTER, L3Settings, L3Store

log = logging.getLogger("larql_desktop.engine.cache.l3")   # one logger for the store, whichever part logs

LOCKED_RETRY = 1.0                    # seconds a locked SQLite file is skipped
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    ns INTEGER NOT NULL, layer INTEGER NOT NULL, key INTEGER NOT NULL,
    value BLOB NOT NULL, nbytes INTEGER NOT NULL, last_used INTEGER NOT NULL,
    PRIMARY KEY (ns, layer, key));
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_layer ON entries (layer, nbytes);
"""
SCHEMA_VERSION = "1"


_OPEN_STORES: "weakref.WeakSet[SqliteL3]" = None   # set below; closed at exit so queued writes are written


def _close_open_stores() -> None:
    for store in list(_OPEN_STORES):
        store.close()


def _close_quietly(conn: sqlite3.Connection | None) -> None:
    """Close a connection that may already be broken (what matters is that it is not used again)."""
    if conn is not None:
        try:
            conn.close()
        except sqlite3.Error:
            pass


class KeyIndex:
    """The addresses (ns, layer, key) in one SQLite file, in memory: what lets a miss skip the file.

    Only "absent" is acted on, and a wrong "absent" (an insert by another process not yet seen, a reused rowid)
    costs a miss, never a wrong value; a wrong "present" (evicted or deleted elsewhere) costs the read it saves
    today and is dropped when that read finds nothing. Entries are held as Python hashes of the address (one
    int each; a hash collision is a wrong "present"). Other processes' inserts are found by rowid: SQLite gives
    a new row (INSERT OR REPLACE too) a rowid above every one in the table, so `rowid > seen` is what arrived
    since the last look, read from the rows' leading columns (the values' overflow pages are not touched)."""

    def __init__(self):
        self._hashes: set[int] = set()
        self._seen_rowid = 0
        self._refreshed = 0.0

    def __contains__(self, address: tuple[int, int, int]) -> bool:
        return hash(address) in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, address: tuple[int, int, int]) -> None:
        self._hashes.add(hash(address))

    def discard(self, address: tuple[int, int, int]) -> None:
        self._hashes.discard(hash(address))

    def clear(self) -> None:
        self._hashes = set()

    def load(self, conn: sqlite3.Connection) -> None:
        """Every address in the file (the primary key's index covers the scan: no value is read)."""
        seen = int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM entries").fetchone()[0])   # first: a row
        hashes = {hash(row) for row in conn.execute("SELECT ns, layer, key FROM entries")}     # added between
        self._hashes, self._seen_rowid = hashes, seen                                           # is above it
        self._refreshed = time.monotonic()

    def due(self, every: float) -> bool:
        return time.monotonic() - self._refreshed >= every

    def refresh(self, conn: sqlite3.Connection) -> int:
        """Add what was inserted since the last look (by any connection); returns how many rows that was."""
        rows = conn.execute("SELECT rowid, ns, layer, key FROM entries WHERE rowid > ?",
                            (self._seen_rowid,)).fetchall()
        for rowid, ns, layer, key in rows:
            self._hashes.add(hash((ns, layer, key)))
            if rowid > self._seen_rowid:
                self._seen_rowid = rowid
        self._refreshed = time.monotonic()
        return len(rows)


class WriteQueue(dict):
    """The write-behind queue: (ns, layer, key) -> (entry, time.time_ns() put, encoded size), in arrival order,
    keeping per layer how many values and bytes it holds as it changes. The statistics ask for that every second
    while a reply streams, when the queue holds a reply's thousands of values: summing them cost the engine
    thread ~2 ms each time."""

    def __init__(self):
        super().__init__()
        self.by_layer: dict[int, list[int]] = {}    # layer -> [values, bytes]

    def _count(self, address, value, sign: int) -> None:
        counts = self.by_layer.setdefault(address[1], [0, 0])
        counts[0] += sign
        counts[1] += sign * value[2]

    def __setitem__(self, address, value) -> None:
        old = self.get(address)
        if old is not None:
            self._count(address, old, -1)
        super().__setitem__(address, value)
        self._count(address, value, 1)

    def __delitem__(self, address) -> None:
        self._count(address, self[address], -1)
        super().__delitem__(address)

    def clear(self) -> None:
        super().clear()
        self.by_layer.clear()

    def pop(self, *args):
        raise TypeError("remove queued values with del, which keeps the per-layer counts")

    popitem = setdefault = update = pop


class SqliteL3(L3Store):
    """L3 in one SQLite file (WAL). Thread-safe; several processes may open the same file.

    Two connections: lookups (and the rare clear and bad-value delete) on the caller's, writes on the writer
    thread's. WAL readers never wait for a writer, so a lookup is never held up by the store's write lock."""

    backend = "sqlite"
    QUEUE_LIMIT = 8192      # values waiting to be written; beyond it a write is dropped (never waited for)
    BATCH = 512             # values per write transaction
    # The writer waits for a quiet moment: QUIET seconds without a value offered (decode offers one per layer every
    # few milliseconds, so it writes between replies) or a prefill (engine_busy: a server prefilling eight prompts
    # one after another puts nothing for a second, and a writer running then took ~0.5 s of CPU from them), unless
    # flush() asks or the store closes. On two cores a writer that runs during decode takes CPU and the GIL from it:
    # with 8 clients decoding, writing whenever the queue was three-quarters full gave the writer ~30% of the
    # samples and cost a quarter of the aggregate tok/s. So a queue that fills while decode goes on drops further
    # values (counted in dropped_writes): the persistent tier keeps the first QUEUE_LIMIT values of a busy spell,
    # and serves them from the queue until the writer gets its quiet moment.
    QUIET = 0.25
    CLOSE_FLUSH = 5.0       # seconds close() gives the writer to write what is queued
    TOUCH_BATCH = 64        # hits whose recency the writer is woken to write (it writes them with values too)
    # Seconds between re-reads of the file's total size (other processes write too). Not per so many puts: the
    # SUM scans the whole table (~100k values at the default cap), which at every batch of a busy server cost
    # the writer, and the decode beside it on two cores, more than the batch's own writes.
    RESYNC_EVERY = 5.0
    OCCUPANCY_EVERY = 2.0   # seconds between the writer's recounts of per-layer occupancy (kept up to date in between)
    REFRESH_EVERY = 0.5     # seconds between looks for other processes' inserts (KeyIndex.refresh)
    FILE_CHECK_EVERY = 0.05  # seconds between looks, by a lookup that cannot hit, for a file rebuilt elsewhere

    def __init__(self, path: str | Path, settings: L3Settings = L3Settings(), timeout: float = 0.1):
        super().__init__(settings)
        self.path = Path(path)
        self.timeout = timeout
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._touched: dict[tuple[int, int, int], int] = {}   # hits' recency, written by the writer
        # Values waiting for the writer, in arrival order; lookups see them. Guarded by _queued's lock.
        # Entries are encoded (checksummed) by the writer, not on the caller's thread.
        self._pending = WriteQueue()
        self._queued = threading.Condition(threading.Lock())
        self._writer_lock = threading.Lock()              # the writer's connection and the batch in flight
        self._writer: threading.Thread | None = None
        self._wconn: sqlite3.Connection | None = None
        self._wopened_id: tuple[int, int] | None = None
        self._closing = threading.Event()
        self._file_checked = 0.0                          # time.monotonic() of _may_hold's last stat
        self._last_activity = 0.0                         # time.monotonic() of the newest queued value or hit
        self._flushes = 0                                 # flush() calls waiting: the writer writes at once
        self.dropped_writes = 0                           # puts refused because the queue was full
        self._dropped: dict[int, int] = {}                # the same, per layer (occupancy's `dropped`)
        self._bytes = 0
        self._resynced = time.monotonic()                 # of the total size from the file (RESYNC_EVERY)
        self._evictions: dict[int, int] = {}
        # Per-layer [entries, bytes], counted from the file at most every OCCUPANCY_EVERY seconds and updated
        # by this process's writes in between, so a statistics poll does not scan the table each time.
        self._occ: dict[int, list[int]] | None = None
        self._occ_time = 0.0
        self._opened_id: tuple[int, int] | None = None    # the file (not the name) the connection has open
        self._index = KeyIndex()      # addresses in the file; loaded with the lookup connection
        self.file_reads = 0           # lookups that read the file (the rest were answered by the queue or index)
        with self._lock:
            self._open()
        _OPEN_STORES.add(self)

    @property
    def where(self) -> str:
        return str(self.path)

    def _connect(self) -> sqlite3.Connection:
        """The lookup connection (the file it opened is recorded before its schema is checked: _rebuild needs it),
        and the index of that file's addresses."""
        conn = self._connect_file(lookups=True)[0]
        try:
            self._index.load(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect_file(self, lookups: bool = False) -> tuple[sqlite3.Connection, tuple[int, int] | None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(self._lock_path, exclusive=False):     # not while another process is rebuilding
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
            opened = _file_id(self.path)
            if lookups:
                self._opened_id = opened
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            if row is None:
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {row[0]!r}, this app writes {SCHEMA_VERSION}")
            self._bytes = int(conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0])
        except BaseException:
            conn.close()
            raise
        return conn, opened

    def _open(self) -> None:
        try:
            self._conn = self._connect()
        except sqlite3.Error as exc:
            self._conn = None
            self._failed(exc)
        except OSError as exc:
            self._conn = None
            self._report("unavailable", exc, f"skipped for {RETRY_AFTER:.0f} s")
            self._skip()

    @property
    def _lock_path(self) -> Path:
        return Path(f"{self.path}.lock")

    def _drop_connection(self) -> None:
        _close_quietly(self._conn)
        self._conn = None
        with self._queued:
            self._touched.clear()
        self._occ = None

    def _rebuild(self, exc: BaseException) -> None:
        """Move a corrupt database aside and start an empty one; if even that fails, run without L3. When the
        file is no longer the one this process opened, another process has rebuilt it already: reopen that."""
        opened = self._opened_id
        self._drop_connection()
        try:
            with _file_lock(self._lock_path, exclusive=True):
                if _file_id(self.path) != opened:
                    self._report("replaced", exc, "another process rebuilt it; reopened")
                else:
                    self._report("corrupt", exc, f"moved aside to {self.path.name}.corrupt and rebuilt")
                    for suffix in ("", "-wal", "-shm"):
                        p = Path(f"{self.path}{suffix}")
                        if p.exists():
                            os.replace(p, f"{self.path}.corrupt{suffix}")
            self._conn = self._connect()
        except (sqlite3.Error, OSError) as again:
            self._report("unrecoverable", again, "the persistent cache is off for this run")
            self._conn = None
            self._skip(float("inf"))

    def _failed(self, exc: sqlite3.Error) -> None:
        """Locked: skip a moment. Other operational errors (no such file, disk full): skip a while. Corruption
        (SQLITE_CORRUPT / NOTADB raise DatabaseError proper): move the file aside and rebuild."""
        if isinstance(exc, sqlite3.OperationalError) or not isinstance(exc, sqlite3.DatabaseError):
            if _is_locked(exc):
                self._report("locked", exc, "lookups and writes are skipped while it is locked")
                self._skip(LOCKED_RETRY)
            else:
                self._report("error", exc, f"skipped for {RETRY_AFTER:.0f} s")
                self._skip()
        else:
            self._rebuild(exc)

    def _conn_or_none(self) -> sqlite3.Connection | None:
        if self._conn is not None and _file_id(self.path) != self._opened_id:
            # Another process moved the file aside and rebuilt it (or it was deleted): share the new one.
            self._report("replaced", FileNotFoundError(f"{self.path} is not the file opened"), "reopened")
            self._drop_connection()
        if self._conn is None and self._available():
            self._open()
        return self._conn

    def _may_hold(self, layer, ns, key):
        # Without a lock: the writer adds an address to the index before it leaves the queue, so reading the
        # queue first and the index second never misses a value on its way between them. When the index is
        # due for a look at other processes' inserts, or the file is no longer the one opened (another process
        # rebuilt it: _get reopens and reloads the index; looked at every FILE_CHECK_EVERY), _get takes the long
        # way.
        address = (ns, layer, key)
        if address in self._pending or address in self._index or self._index.due(self.REFRESH_EVERY):
            return True
        now = time.monotonic()     # a stat costs ~20 us here, a lookup per layer: look at most every so often
        if now - self._file_checked < self.FILE_CHECK_EVERY:
            return False
        self._file_checked = now
        return _file_id(self.path) != self._opened_id

    def _get(self, layer, ns, key):
        address = (ns, layer, key)
        with self._queued:
            queued = self._pending.get(address)
            if queued is not None:
                self._touched[address] = time.time_ns()   # written after the value (same or later batch)
                return queued[0]
        with self._lock:
            conn = self._conn_or_none()
            if conn is None:
                return None
            try:
                if address not in self._index:
                    if not self._index.due(self.REFRESH_EVERY) or not self._index.refresh(conn) \
                            or address not in self._index:
                        return None
                self.file_reads += 1
                row = conn.execute("SELECT value FROM entries WHERE ns=? AND layer=? AND key=?",
                                   (ns, layer, key)).fetchone()
            except sqlite3.Error as exc:
                self._failed(exc)
                return None
            if row is None:
                self._index.discard(address)      # evicted or deleted by another process
        if row is None:
            return None
        with self._queued:
            self._touched[address] = time.time_ns()
            self._last_activity = time.monotonic()
            if len(self._touched) >= self.TOUCH_BATCH:
                self._wake_writer()
        return row[0]

    def _delete_if(self, layer, ns, key, blob):
        with self._queued:
            self._touched.pop((ns, layer, key), None)
        with self._lock:
            conn = self._conn_or_none()
            if conn is None:
                return
            try:
                gone = conn.execute("DELETE FROM entries WHERE ns=? AND layer=? AND key=? AND value=?",
                                    (ns, layer, key, blob)).rowcount
            except sqlite3.Error as exc:
                self._failed(exc)
                return
            if gone:
                self._index.discard((ns, layer, key))
                self._bytes -= len(blob)
                with self._queued:
                    self._count(layer, -1, -len(blob))

    # -- the write-behind queue --------------------------------------------------------------------------
    def _put(self, layer, ns, key, entry, nbytes):
        return self._queue([(layer, ns, key, entry, nbytes)]) == 1

    def _put_many(self, items):
        self._queue(items)

    def put_many(self, items) -> None:
        # Under sustained decode the queue stays full (the writer waits for a quiet moment) and drops each new
        # value, so making their stored forms first (an fp16 pass over a step's values, in every batched row's
        # serial share of the step) was work thrown away: a full queue drops them before they are formed.
        if items and len(self._pending) >= self.QUEUE_LIMIT and self._available():
            items = self._take(items, lambda item: (namespace_id(item[1]), item[0], signed_key(item[2])))
        super().put_many(items)

    def _queue(self, items) -> int:
        """Queue each (layer, ns, key, entry, nbytes) for the writer, under one lock; returns how many it took."""
        taken = 0

        def queue(item) -> None:
            nonlocal taken
            layer, ns, key, entry, nbytes = item
            self._pending[(ns, layer, key)] = (entry, time.time_ns(), nbytes)   # recency: when it was computed
            taken += 1
            # Only the first value of a burst wakes the writer (to wait for the quiet moment): a wake-up per
            # value would hand the GIL to it 30 times a token.
            if len(self._pending) == 1:
                self._wake_writer()
        self._take(items, lambda item: (item[1], item[0], item[2]), queue)
        return taken

    def _take(self, items, address_of, queue=None) -> list:
        """The items (their layer first) the queue has room for, under one lock: a full queue takes only those
        whose address it holds (they replace it); the rest are dropped, counted per layer. `queue(item)` is
        called for each taken one. Nothing is taken once the store is closing."""
        taken, dropped = [], 0
        with self._queued:
            if self._closing.is_set():
                return []
            for item in items:
                if address_of(item) not in self._pending and len(self._pending) >= self.QUEUE_LIMIT:
                    dropped += 1
                    self._dropped[item[0]] = self._dropped.get(item[0], 0) + 1
                    continue
                taken.append(item)
                if queue is not None:
                    queue(item)
            if taken or dropped:    # a dropped value is activity too: decode goes on, so the writer waits
                self._last_activity = time.monotonic()
            self.dropped_writes += dropped
        if dropped:
            self._report("queue full", RuntimeError(f"{self.QUEUE_LIMIT} values wait to be written"),
                         "further writes are dropped until the writer catches up")
        return taken

    def engine_busy(self) -> None:
        self._last_activity = time.monotonic()    # a float's assignment: no lock, read by the writer's wait

    @property
    def quiet_since(self) -> float:
        """time.monotonic() of the latest value offered, hit or engine_busy: the writer writes QUIET seconds after."""
        return self._last_activity

    def _wake_writer(self) -> None:
        """Called with _queued held: start the writer thread on first use, wake it otherwise."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._writer_loop, name="l3-writer", daemon=True)
            self._writer.start()
        self._queued.notify_all()

    def _writer_loop(self) -> None:
        while True:
            with self._queued:
                while not (self._pending or self._touched) and not self._closing.is_set():
                    self._queued.wait()
                if not (self._pending or self._touched):
                    return                      # closing, and everything is written
                self._wait_for_quiet()
            delay = self._write_batch()
            if delay:
                if self._closing.is_set():      # closing and the store refuses writes: give up the queue
                    with self._queued:
                        self._pending.clear()
                        self._touched.clear()
                        self._queued.notify_all()
                    return
                self._closing.wait(delay)

    def _wait_for_quiet(self) -> None:
        """With _queued held: until QUIET seconds have passed since the last put (taken or dropped), hit or
        engine_busy, flush() waits or the store closes."""
        while not (self._closing.is_set() or self._flushes):
            left = self.QUIET - (time.monotonic() - self._last_activity)
            if left <= 0:
                return
            self._queued.wait(left)

    def _writer_connection(self) -> sqlite3.Connection | None:
        if self._wconn is not None and _file_id(self.path) != self._wopened_id:
            self._drop_writer_connection()      # the file was rebuilt or replaced: write to the new one
        if self._wconn is None:
            try:
                self._wconn, self._wopened_id = self._connect_file()
            except (sqlite3.Error, OSError) as exc:
                self._report("unavailable", exc, f"writes wait in the queue, retried every {RETRY_AFTER:.0f} s")
                return None
        return self._wconn

    def _drop_writer_connection(self) -> None:
        _close_quietly(self._wconn)
        self._wconn = None

    def _write_batch(self) -> float:
        """Write up to BATCH queued values (and the hits' recency) in one transaction; 0.0 when done, else the
        seconds to wait before trying again. Values leave the queue only once committed."""
        with self._queued:
            items = list(itertools.islice(self._pending.items(), self.BATCH))
            touches, self._touched = self._touched, {}
        with self._writer_lock:
            conn = self._writer_connection()
            if conn is None:
                return RETRY_AFTER
            changes: list[tuple[int, int, int]] = []
            evicted: list[tuple[int, int, int]] = []
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for (ns, layer, key), (entry, put_at, _) in items:
                        blob = self._encode(layer, ns, key, entry)
                        old = conn.execute("SELECT nbytes FROM entries WHERE ns=? AND layer=? AND key=?",
                                           (ns, layer, key)).fetchone()
                        conn.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                                     (ns, layer, key, blob, len(blob), put_at))
                        changes.append((layer, 0 if old else 1, len(blob) - (old[0] if old else 0)))
                    if touches:
                        conn.executemany("UPDATE entries SET last_used=? WHERE ns=? AND layer=? AND key=?",
                                         [(t, ns, layer, key) for (ns, layer, key), t in touches.items()])
                    self._bytes += sum(c[2] for c in changes)
                    if time.monotonic() - self._resynced >= self.RESYNC_EVERY:
                        self._resync(conn)
                    if self._bytes > self.settings.max_bytes:
                        self._evict(conn, changes, evicted)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                return self._write_failed(exc)
            with self._queued:
                for address, queued in items:
                    self._index.add(address)                   # before it leaves the queue: never unseen
                    if self._pending.get(address) is queued:   # not replaced meanwhile
                        del self._pending[address]
                for address in evicted:
                    self._index.discard(address)
                for change in changes:
                    self._count(*change)
                self._queued.notify_all()                  # flush() waits for this
            if time.monotonic() - self._occ_time > self.OCCUPANCY_EVERY:
                try:
                    self._recount(conn)
                except sqlite3.Error:
                    pass        # the counts kept by this process serve; the next batch meets the error itself
        return 0.0

    def _recount(self, conn: sqlite3.Connection) -> None:
        """Count the file's values and bytes per layer. With the writer's lock held: no batch is between its
        commit and leaving the queue, so nothing is counted twice or not at all."""
        rows = conn.execute("SELECT layer, COUNT(*), SUM(nbytes) FROM entries GROUP BY layer").fetchall()
        with self._queued:
            self._occ = {layer: [count, total] for layer, count, total in rows}
        self._occ_time = time.monotonic()

    def _write_failed(self, exc: sqlite3.Error) -> float:
        """The writer's share of _failed: a locked file is waited out (lookups go on), other errors back off,
        corruption rebuilds the file (through the lookup connection, which owns that)."""
        self._drop_writer_connection()
        if isinstance(exc, sqlite3.OperationalError) or not isinstance(exc, sqlite3.DatabaseError):
            if _is_locked(exc):
                self._report("locked", exc, f"writes wait in the queue (up to {self.QUEUE_LIMIT}) while it is "
                             "locked; lookups go on")
                return LOCKED_RETRY
            self._report("error", exc, f"writes wait in the queue, retried every {RETRY_AFTER:.0f} s")
            return RETRY_AFTER
        with self._lock:
            self._rebuild(exc)
        return 0.01

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued value is written; False if that did not happen within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queued:
            self._flushes += 1
            try:
                while self._pending or self._touched:
                    self._wake_writer()         # starts it, or ends its wait for a quiet moment
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._queued.wait(left if left is not None else 1.0)
            finally:
                self._flushes -= 1
        with self._writer_lock:   # the batch in flight, if any, has been committed
            return True

    def _resync(self, conn) -> None:
        self._bytes = int(conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0])
        self._resynced = time.monotonic()

    def _evict(self, conn, changes: list, evicted: list) -> None:
        """Delete least recently used entries down to 90% of the cap (hits' recency is written first); their
        addresses go to `evicted`."""
        self._resync(conn)
        target = int(self.settings.max_bytes * 0.9)
        while self._bytes > target:
            victims = conn.execute("SELECT rowid, ns, layer, key, nbytes FROM entries ORDER BY last_used "
                                   "LIMIT 256").fetchall()
            if not victims:
                break
            chosen = []
            for rowid, ns, layer, key, nbytes in victims:
                chosen.append(rowid)
                evicted.append((ns, layer, key))
                self._bytes -= nbytes
                changes.append((layer, -1, -nbytes))
                self._evictions[layer] = self._evictions.get(layer, 0) + 1
                if self._bytes <= target:
                    break
            conn.execute(f"DELETE FROM entries WHERE rowid IN ({','.join('?' * len(chosen))})", chosen)

    def _count(self, layer: int, entries: int, nbytes: int) -> None:
        if self._occ is not None:
            counts = self._occ.setdefault(layer, [0, 0])
            counts[0] += entries
            counts[1] += nbytes

    def occupancy(self, n_layers):
        """The file's counts plus the values still queued. The file's are counted when it is opened and by the
        writer after a batch at most every OCCUPANCY_EVERY seconds (other processes' writes show then), and kept
        up to date by this process's writes in between."""
        keys, entries, nbytes, evictions, dropped = super().occupancy(n_layers)
        with self._lock:
            for layer, count in self._evictions.items():
                if 0 <= layer < n_layers:
                    evictions[layer] = count
            with self._queued:
                for layer, count in self._dropped.items():
                    if 0 <= layer < n_layers:
                        dropped[layer] = count
            conn = self._conn_or_none()
            if conn is None:
                return keys, entries, nbytes, evictions, dropped
            # Only the first count after opening (or clearing) the file is made here; the writer recounts after
            # its batches (_write_batch). A full store's count takes 15-25 ms, which a statistics poll on the
            # engine thread would take from a token every OCCUPANCY_EVERY seconds.
            if self._occ is None and self._writer_lock.acquire(blocking=False):
                try:
                    self._recount(conn)
                except sqlite3.Error as exc:
                    self._failed(exc)
                    return keys, entries, nbytes, evictions, dropped
                finally:
                    self._writer_lock.release()
            with self._queued:
                for layer, (count, total) in (self._occ or {}).items():
                    if 0 <= layer < n_layers:
                        keys[layer] = entries[layer] = count
                        nbytes[layer] = total
                for layer, (count, total) in self._pending.by_layer.items():
                    if 0 <= layer < n_layers:
                        keys[layer] += count
                        entries[layer] += count
                        nbytes[layer] += total
        return keys, entries, nbytes, evictions, dropped

    def status(self) -> dict:
        out = super().status()
        with self._queued:
            out["queued_writes"] = len(self._pending)
        out["dropped_writes"] = self.dropped_writes
        out["indexed_keys"] = len(self._index)
        out["file_reads"] = self.file_reads
        return out

    def total_bytes(self) -> int:
        """Bytes in the file (queued values not yet written are not counted)."""
        with self._lock:
            conn = self._conn_or_none()
            if conn is None:
                return 0
            return int(conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0])

    def clear(self) -> None:
        with self._writer_lock:      # after the batch in flight; nothing queued survives
            with self._queued:
                self._pending.clear()
                self._touched.clear()
                self._queued.notify_all()
            with self._lock:
                conn = self._conn_or_none()
                if conn is None:
                    return
                try:
                    conn.execute("DELETE FROM entries")
                    self._index.clear()
                    self._bytes = 0
                    self._occ = None
                except sqlite3.Error as exc:
                    self._failed(exc)

    def close(self) -> None:
        """Write what is queued (for at most CLOSE_FLUSH seconds), then close both connections."""
        with self._queued:
            self._closing.set()
            self._queued.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(self.CLOSE_FLUSH)
        with self._writer_lock:
            self._drop_writer_connection()
        with self._lock:
            _close_quietly(self._conn)
            self._conn = None


_OPEN_STORES = weakref.WeakSet()
atexit.register(_close_open_stores)   # before the writer (a daemon thread) is stopped with the interpreter


def _file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file now at `path`: which file, not which name (None when there is none)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextmanager
def _file_lock(path: Path, exclusive: bool):
    """An advisory lock shared by the processes using one store: exclusive to rebuild it, shared to open it."""
    try:
        import fcntl
    except ImportError:      # Windows: msvcrt has only exclusive locks, taken for both
        fcntl = None
    with open(path, "a+b") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        else:                # pragma: no cover - Windows
            import msvcrt
            fh.seek(0)
            msvcrt.locking(fh.fileno(), msvcrt.LK_LOCK, 1)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            else:            # pragma: no cover - Windows
                fh.seek(0)
                msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)


def _is_locked(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text
