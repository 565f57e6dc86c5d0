"""The negatives' captures kept on disk between launches, so an insert under a relation this model has met before
does not run them again after the app restarts.

An insert's negatives are ~45 contexts, ~3,500 tokens, most of them the relation's (decoys, frames, conversations
about real entities, invented names) and the same for every insert under it: a third of a cold insert's time goes
to their forward passes (SmolLM2: 5.8 of 17.4 s). An Inserter remembers them in memory (capture.py); this store
keeps the same half-precision rows in one SQLite file in the user cache directory, least recently used dropped
first within a byte bound.

Entries are keyed on the context's token ids and a namespace naming everything the pass's numbers depend on
(the model's checksum, the attention and FFN graphs' numerics, the walk settings, onnxruntime's version and thread
count, the rows' precision): a capture from other weights, graphs or settings is never read. Each value carries
its ids and namespace, checked on reading; a value that cannot be read is deleted and computed again. The store
never fails an insert: if its file cannot be opened or written, the insert runs as without it.
"""
from __future__ import annotations

import io
import logging
import sqlite3
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import xxhash

log = logging.getLogger(__name__)
T = TypeVar("T")

# Bump when a value's layout changes, or what a continuation is (the rules that stop one: phrasings.py's `enough`
# callables): older rows are then never read. (2: every value names its kind.)
STORE_FORMAT = 2
CAPTURE_KIND = "capture"   # a capture's kind; a continuation's names its memory, length and key
# What np.load raises on a value that is not a whole archive of the arrays asked for.
UNREADABLE = (ValueError, KeyError, OSError, EOFError, IndexError, zipfile.BadZipFile)
# ~14 relations' negatives on SmolLM2 (~73 MB each: 734 MB after 12 facts of 10 relations, measured after the
# own-reply negatives; 68 MB each before them); about 12 since the conversations after six same-relation replies
# joined them (86 MB a relation in memory; not measured on disk)
DEFAULT_STORE_BYTES = 1024 * 2 ** 20


class StoredCapture(NamedTuple):
    """What `CaptureStore.get` returns: per layer the inputs (None below `from_layer`), and the residual after
    attention at one layer when the capture was made to resume from there (capture.RememberedInputs' fields)."""
    from_layer: int
    inputs: list
    residual: tuple[int, np.ndarray] | None


class CaptureStore:
    """One SQLite file of captures, shared by every Inserter of the process (and other processes on the same
    cache directory: SQLite's own locking). Thread-safe."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_STORE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 (off) or more, not {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.hits = self.misses = self.writes = self.dropped = 0
        self._lock = threading.Lock()
        self._last_use = 0.0
        self._db: sqlite3.Connection | None = None
        if max_bytes:
            self._db = self._open()

    def _open(self) -> sqlite3.Connection | None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False, isolation_level=None)
            # A cache: a write lost to a power cut is computed again, so commits need not wait for the disk
            # (in WAL mode the file stays whole either way).
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS captures (key BLOB PRIMARY KEY, nbytes INTEGER NOT NULL, "
                       "used REAL NOT NULL, value BLOB NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS captures_used ON captures (used)")
            return db
        except (sqlite3.Error, OSError) as e:
            log.warning("INSERT's capture store at %s is off: %s", self.path, e)
            return None

    @property
    def enabled(self) -> bool:
        return self._db is not None

    @staticmethod
    def _key(namespace: str, ids: np.ndarray, kind: str) -> bytes:
        return xxhash.xxh3_128(f"{STORE_FORMAT}\0{namespace}\0{kind}\0".encode() + ids.tobytes()).digest()

    def get(self, namespace: str, ids: Sequence[int]) -> StoredCapture | None:
        """The stored capture of `ids` under `namespace`, or None (never stored, dropped, or unreadable)."""
        arr = np.asarray(ids, dtype="<i8")
        return self._read(self._key(namespace, arr, CAPTURE_KIND),
                          lambda value: _decoded(value, namespace, CAPTURE_KIND, arr, _capture_from))

    def put(self, namespace: str, ids: Sequence[int], capture: StoredCapture) -> None:
        """Store (or replace) the capture of `ids`; then drop the least recently used rows past the byte bound."""
        arr = np.asarray(ids, dtype="<i8")
        self._write(self._key(namespace, arr, CAPTURE_KIND),
                    lambda: _encoded(namespace, CAPTURE_KIND, arr, _capture_arrays(capture)))

    def get_tokens(self, namespace: str, kind: str, ids: Sequence[int]) -> list[int] | None:
        """The base model's continuation of `ids` of this kind (capture.Capturing.remembered_greedy: which of
        its memories, how many tokens, what stops it), or None."""
        arr = np.asarray(ids, dtype="<i8")
        return self._read(self._key(namespace, arr, kind),
                          lambda value: _decoded(value, namespace, kind, arr, _tokens_from))

    def put_tokens(self, namespace: str, kind: str, ids: Sequence[int], tokens: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype="<i8")
        self._write(self._key(namespace, arr, kind),
                    lambda: _encoded(namespace, kind, arr, {"tokens": np.asarray(tokens, dtype="<i8")}))

    def _read(self, key: bytes, decode: Callable[[bytes], T | None]) -> T | None:
        if self._db is None:
            return None
        with self._lock:
            try:
                row = self._db.execute("SELECT value FROM captures WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    self._db.execute("UPDATE captures SET used = ? WHERE key = ?", (self._now(), key))
            except sqlite3.Error as e:
                log.warning("INSERT's capture store: reading failed: %s", e)
                row = None
            found = None if row is None else decode(row[0])
            if row is not None and found is None:
                self._delete(key)
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
            return found

    def _write(self, key: bytes, encode: Callable[[], bytes]) -> None:
        if self._db is None:
            return
        value = encode()
        if len(value) > self.max_bytes:
            return
        with self._lock:
            try:
                self._db.execute("INSERT OR REPLACE INTO captures (key, nbytes, used, value) VALUES (?, ?, ?, ?)",
                                 (key, len(value), self._now(), value))
                self.writes += 1
                total = self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM captures").fetchone()[0]
                while total > self.max_bytes:
                    oldest = self._db.execute("SELECT key, nbytes FROM captures ORDER BY used LIMIT 1").fetchone()
                    if oldest is None:
                        break
                    self._db.execute("DELETE FROM captures WHERE key = ?", (oldest[0],))
                    total -= oldest[1]
                    self.dropped += 1
            except sqlite3.Error as e:
                log.warning("INSERT's capture store: writing failed: %s", e)

    def _now(self) -> float:
        """The time of a use, later than this store's last one (two uses within the clock's resolution keep their
        order: the least recently used row is the one dropped)."""
        self._last_use = max(time.time(), self._last_use + 1e-6)
        return self._last_use

    def _delete(self, key: bytes) -> None:
        try:
            self._db.execute("DELETE FROM captures WHERE key = ?", (key,))      # type: ignore[union-attr]
        except sqlite3.Error:
            pass

    def stored_bytes(self) -> int:
        if self._db is None:
            return 0
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM captures").fetchone()[0])

    def stats(self) -> dict:
        return {"enabled": self.enabled, "path": str(self.path), "hits": self.hits, "misses": self.misses,
                "writes": self.writes, "dropped": self.dropped, "bytes": self.stored_bytes(),
                "max_bytes": self.max_bytes}

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), np.uint8)


def _encoded(namespace: str, kind: str, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> bytes:
    """A value: `arrays` with the ids, namespace and kind it was stored under (checked on reading)."""
    buf = io.BytesIO()
    # (numpy's stub takes the first keyword argument for allow_pickle)
    np.savez(buf, ids=ids, namespace=_text(namespace), kind=_text(kind), **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def _decoded(value: bytes, namespace: str, kind: str, ids: np.ndarray, read: Callable[[Any, int], T | None]
             ) -> T | None:
    """`read(archive, len(ids))` of a value stored for these ids, namespace and kind; None for another's or one
    that cannot be read."""
    try:
        with np.load(io.BytesIO(value), allow_pickle=False) as z:
            if (not np.array_equal(z["ids"], ids) or z["namespace"].tobytes() != namespace.encode()
                    or z["kind"].tobytes() != kind.encode()):
                return None
            return read(z, len(ids))
    except UNREADABLE as e:
        log.warning("INSERT's capture store: an unreadable entry was dropped: %s", e)
        return None


def _capture_arrays(capture: StoredCapture) -> dict[str, np.ndarray]:
    arrays = {"from_layer": np.array(capture.from_layer, np.int64),
              "layers": np.array([i for i, x in enumerate(capture.inputs) if x is not None], np.int64),
              "n_layers": np.array(len(capture.inputs), np.int64)}
    for i, x in enumerate(capture.inputs):
        if x is not None:
            arrays[f"layer{i}"] = x
    if capture.residual is not None:
        arrays["residual_layer"] = np.array(capture.residual[0], np.int64)
        arrays["residual"] = capture.residual[1]
    return arrays


def _capture_from(z, length: int) -> StoredCapture | None:
    inputs: list = [None] * int(z["n_layers"])
    for i in z["layers"]:
        x = z[f"layer{int(i)}"]
        if x.ndim != 2 or x.shape[0] != length:
            return None
        inputs[int(i)] = x
    residual = (int(z["residual_layer"]), z["residual"]) if "residual" in z.files else None
    return StoredCapture(int(z["from_layer"]), inputs, residual)


def _tokens_from(z, length: int) -> list[int] | None:
    tokens = z["tokens"]
    return [int(t) for t in tokens] if tokens.ndim == 1 else None
