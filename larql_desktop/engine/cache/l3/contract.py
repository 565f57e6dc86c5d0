"""The L3 contract both backends keep: get/put by (layer, namespace, feature key), checked on read, and never
raising on a backend failure (a failing store is reported once per kind of problem and skipped for a while)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from larql_desktop.engine.cache.l3.codec import (DTYPES, CacheEntry, decode_entry, encode_entry, namespace_id,
                                                 signed_key, stored_form, stored_forms, value_address)

log = logging.getLogger("larql_desktop.engine.cache.l3")   # one logger for the store, whichever part logs

RETRY_AFTER = 5.0                     # seconds a failing backend is skipped before it is tried again


@dataclass(frozen=True)
class L3Settings:
    enabled: bool = True
    max_bytes: int = 512 * 1024 * 1024       # total size cap; least recently used entries are evicted
    dtype: str = "float32"                   # "float16" halves the bytes at a measured rounding error

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"L3 storage type must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if not 4096 <= self.max_bytes <= 1 << 44:
            raise ValueError(f"L3 size cap must be between 4 KiB and 16 TiB, not {self.max_bytes} bytes")


class L3Store:
    """The tier's contract: get/put by (layer, namespace, feature key); never raises on a backend failure."""

    name = "L3"
    backend = "none"

    def __init__(self, settings: L3Settings):
        self.settings = settings
        self._reported: set[str] = set()
        self.errors: dict[str, int] = {}
        self._skip_until = 0.0
        self._state_lock = threading.Lock()

    # -- reporting -----------------------------------------------------------------------------------------
    def _report(self, kind: str, exc: BaseException, action: str) -> None:
        with self._state_lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            first = kind not in self._reported
            self._reported.add(kind)
        if first:
            log.warning("L3 cache (%s %s): %s: %s; %s", self.backend, self.where, kind, exc, action)

    def _skip(self, seconds: float = RETRY_AFTER) -> None:
        self._skip_until = time.monotonic() + seconds

    def _available(self) -> bool:
        return self.settings.enabled and time.monotonic() >= self._skip_until

    @property
    def where(self) -> str:
        return ""

    def configure(self, settings: L3Settings) -> None:
        self.settings = settings

    def status(self) -> dict:
        return {"backend": self.backend, "where": self.where, "enabled": self.settings.enabled,
                "dtype": self.settings.dtype, "max_bytes": self.settings.max_bytes, "errors": dict(self.errors),
                "skipping": time.monotonic() < self._skip_until}

    # -- the contract ----------------------------------------------------------------------------------------
    def get(self, layer: int, namespace: tuple, key: int) -> CacheEntry | None:
        if not self._available():
            return None
        return self._lookup(layer, namespace_id(namespace), signed_key(key))

    def get_many(self, wanted) -> list[CacheEntry | None]:
        """`get(layer, namespace, key)` for each (layer, namespace, key) of `wanted` (a decode step's layers),
        the store's availability looked at once."""
        if not self._available():
            return [None] * len(wanted)
        return [self._lookup(layer, namespace_id(namespace), signed_key(key)) for layer, namespace, key in wanted]

    def _lookup(self, layer: int, ns: int, key: int) -> CacheEntry | None:
        if not self._may_hold(layer, ns, key):
            return None
        blob = self._get(layer, ns, key)
        if blob is None:
            return None
        if isinstance(blob, CacheEntry):      # still in the write queue, as it was put
            return blob
        entry = decode_entry(blob, value_address(ns, layer, key))
        if entry is None:
            self._report("bad value", ValueError("a stored value does not verify (checksum, format or NaN)"),
                         "each is deleted and counted as a miss")
            self._delete_if(layer, ns, key, bytes(blob))
        return entry

    def put(self, layer: int, namespace: tuple, key: int, entry: CacheEntry) -> bool:
        if not self._available():
            return False
        form = stored_form(entry, self.settings.dtype)
        if form is None:
            return False          # a hit may serve only what a computation could have returned
        return self._put(layer, namespace_id(namespace), signed_key(key), *form)

    def put_many(self, items) -> None:
        """`put(layer, namespace, key, entry)` for each (layer, namespace, key, entry) of `items` (a decode step's
        misses): their stored forms made together, and a queueing store takes them under one lock."""
        if not items or not self._available():
            return
        forms = stored_forms([entry for *_, entry in items], self.settings.dtype)
        self._put_many([(layer, namespace_id(namespace), signed_key(key), *form)
                        for (layer, namespace, key, _), form in zip(items, forms) if form is not None])

    def _put_many(self, items) -> None:
        """`_put` for each (layer, ns, key, entry, nbytes); a store with a queue takes them under one lock."""
        for item in items:
            self._put(*item)

    def _encode(self, layer: int, ns: int, key: int, entry: CacheEntry) -> bytes:
        return encode_entry(entry, self.settings.dtype, value_address(ns, layer, key))

    def occupancy(self, n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, entries, bytes, evictions, dropped) per layer over the whole store (every model in it)."""
        z = [np.zeros(n_layers, np.int64) for _ in range(5)]
        return tuple(z)

    def engine_busy(self) -> None:
        """The engine is computing beside the store (a prefill, which puts nothing): a store that writes behind
        waits for a quiet moment counted from now. Nothing for a store that writes at once."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted write is in the store (a backend that writes synchronously: at once)."""
        return True

    def clear(self) -> None: ...
    def close(self) -> None: ...
    def _get(self, layer: int, ns: int, key: int) -> bytes | CacheEntry | None: ...
    def _put(self, layer: int, ns: int, key: int, entry: CacheEntry, nbytes: int) -> bool: ...

    def _may_hold(self, layer: int, ns: int, key: int) -> bool:
        """False only when the value is certainly not there (a lookup then costs no lock and no I/O)."""
        return True

    def _delete_if(self, layer: int, ns: int, key: int, blob: bytes) -> None:
        """Delete the value at the address if it is still `blob` (another writer may have replaced it)."""
