"""L3: the persistent tier of the FFN activation cache, after L1 (per session) and L2 (per process).

Two backends share one contract: `SqliteL3` (embedded, the default: a WAL database in the user cache dir) and
`RedisL3` (the optional `redis` extra: several processes, or machines, share one store). The package is split by
seam: codec.py (the value format and the ids keys are stored under), contract.py (`L3Store`: what both backends
promise), sqlite.py and redis.py (the backends); `open_l3` here picks one from a spec.

Keys survive restarts because they carry everything an output depends on: the walk's namespace (model checksum,
K, key width and the graphs' digest; no patch state, since outputs an override touches are never cached), the
layer, the 64-bit feature key (blake2b, stable across processes), and the numerics that computed the value (this format's version and the
onnxruntime version). A value is the raw FFN output and the input it was computed from, as fp32 or, optionally,
fp16 (half the bytes; its error is measured in tests/test_l3.py), behind a header with an xxh3 checksum of the
value and of the address it was written to: flipped bytes, a truncated write or a value moved to another key
are found on read, counted as a miss and deleted. Both backends cap their size in bytes and evict the least
recently used entries.

The store is an optimisation and never breaks inference: a corrupt, locked or unreachable store is detected,
logged once per kind of problem, and then rebuilt (a corrupt SQLite file is moved aside) or skipped for a while;
a lookup that fails is a miss and a write that fails is dropped. SQLite writes never run on the caller's thread:
`put` queues the value (bounded; a full queue drops the write) and a background thread writes the queue in
batched transactions on its own connection, so a store that is locked by another process, or a slow disk, delays
only that thread; lookups see queued values. The writer waits for a quiet moment (no value put, no hit and no
prefill for a quarter of a second, i.e. between replies; a queue that fills meanwhile drops further writes), so on
a machine with two cores it does not take CPU from decode or prefill. A crash loses at most the queue: every
batch is one transaction.
Nor does a lookup whose key is not in the file read it: the store keeps the file's addresses in memory
(`KeyIndex`: loaded when the file is opened, kept current by this process's writer, refreshed from other
processes' inserts at most every REFRESH_EVERY seconds), so a miss costs a set lookup, and a stale "absent"
costs only a miss. Several processes share one SQLite file: a
rebuild holds an exclusive lock on `<file>.lock` (opening holds it shared), a process moves the file aside only
if it is still the file that process opened, and a process whose file was replaced under it (another process
rebuilt it) reopens the new one instead of going on alone with the old.
"""
from __future__ import annotations

from pathlib import Path

from larql_desktop.engine.cache.l3.codec import (DTYPES, FP16_MAX, L3_FORMAT, decode_entry, encode_entry,  # noqa: F401
                                                 namespace_id, stored_form, stored_forms, value_address)
from larql_desktop.engine.cache.l3.contract import L3Settings, L3Store  # noqa: F401
from larql_desktop.engine.cache.l3.redis import RedisL3
from larql_desktop.engine.cache.l3.sqlite import KeyIndex, SqliteL3, WriteQueue  # noqa: F401


def default_l3_path(paths) -> Path:
    """Where the default L3 lives: the user cache dir (under LARQL_DESKTOP_HOME when that is set)."""
    return Path(paths.cache) / "l3" / "ffn-cache.sqlite3"


def open_l3(spec: str, paths, settings: L3Settings = L3Settings()) -> L3Store | None:
    """`sqlite` (the default file), `sqlite:PATH`, `redis://HOST:PORT/DB` (optionally `#PREFIX`) or `off`."""
    spec = spec.strip()
    if spec == "off":
        return None
    if spec == "sqlite":
        return SqliteL3(default_l3_path(paths), settings)
    if spec.startswith("sqlite:"):
        return SqliteL3(Path(spec[len("sqlite:"):]).expanduser(), settings)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        url, _, prefix = spec.partition("#")
        try:
            return RedisL3(url, prefix or "larql:l3", settings)
        except ImportError as exc:
            raise ValueError("the Redis L3 needs the optional 'redis' package "
                             "(pip install 'larql-desktop[redis]')") from exc
    raise ValueError(f"unknown L3 store {spec!r}: use sqlite, sqlite:PATH, redis://HOST:PORT/DB or off")
