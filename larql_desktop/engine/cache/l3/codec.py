"""The L3 value format: a header, an xxh3 checksum over the value and the address it was written to, the FFN output
and its input as fp32 or fp16; and the ids a walk namespace and a feature key are stored under."""
from __future__ import annotations

import functools
import hashlib
import json
import struct

import numpy as np
import xxhash

from larql_desktop.engine.cache.tiers import CacheEntry

L3_FORMAT = 2                         # 2: values carry a checksum
DTYPES = ("float32", "float16")
FP16_MAX = 65504.0
_HEADER = struct.Struct("<2sBBI")     # magic, format, dtype code (0 fp32, 1 fp16), vector length
_CHECKSUM = struct.Struct("<Q")       # xxh3-64 of the address, the header and the vectors
_PREFIX = _HEADER.size + _CHECKSUM.size
_MAGIC = b"L3"
_ADDRESS = struct.Struct("<qqq")      # (namespace id, layer, key): what a value's checksum binds it to


def _ort_version() -> str:
    try:
        import onnxruntime
        return onnxruntime.__version__
    except ImportError:       # pragma: no cover - onnxruntime is a dependency
        return "none"

def value_address(ns: int, layer: int, key: int) -> bytes:
    """The bytes a value's checksum covers besides the value: a value copied under another key does not verify."""
    return _ADDRESS.pack(ns, layer, key)


def value_checksum(address: bytes, header: bytes, vectors: bytes) -> int:
    h = xxhash.xxh3_64(address)
    h.update(header)
    h.update(vectors)
    return h.intdigest()


def encode_entry(entry: CacheEntry, dtype: str, address: bytes = b"") -> bytes:
    """Header, checksum, output, residual. fp16 is used only where every value fits (else that entry stays
    fp32). `address`: value_address() of where it is written (decode_entry must be given the same)."""
    out, res = entry.output, entry.residual
    code = _dtype_code(entry, dtype)
    kind = "<f2" if code else "<f4"
    header = _HEADER.pack(_MAGIC, L3_FORMAT, code, out.size)
    vectors = np.ascontiguousarray(out, kind).tobytes() + np.ascontiguousarray(res, kind).tobytes()
    return header + _CHECKSUM.pack(value_checksum(address, header, vectors)) + vectors


def _dtype_code(entry: CacheEntry, dtype: str) -> int:
    """1: the entry is stored as fp16 (that dtype is chosen and every value fits), 0: as fp32."""
    out, res = entry.output, entry.residual
    fits = dtype == "float16" and max(float(np.abs(out).max(initial=0)), float(np.abs(res).max(initial=0))) < FP16_MAX
    return int(fits)


def stored_form(entry: CacheEntry, dtype: str) -> tuple[CacheEntry, int] | None:
    """The entry as the store will give it back, and the bytes encode_entry will make of it: read-only float32
    arrays, rounded through fp16 where encode_entry stores fp16, without the near-miss bits. SQLite queues this
    form (the writer encodes it, off the caller's thread) and serves it from the queue meanwhile, so a value read
    before and after its write is the same, and a caller that changes its arrays later changes nothing here.
    None for an entry holding a non-finite value (never written: see L3Store.put)."""
    return stored_forms([entry], dtype)[0]


def stored_forms(entries, dtype: str) -> list[tuple[CacheEntry, int] | None]:
    """`stored_form` of each entry, converted together: a decode step's misses in one fp16 pass, not one each."""
    outs = np.stack([e.output for e in entries]).astype(np.float32, copy=False)
    res = np.stack([e.residual for e in entries]).astype(np.float32, copy=False)
    finite = np.isfinite(outs).all(axis=1) & np.isfinite(res).all(axis=1)
    fits = np.zeros(len(entries), bool)
    if dtype == "float16":     # as _dtype_code decides it, row by row (a NaN never fits, nor is it written)
        fits = (np.abs(outs).max(axis=1, initial=0) < FP16_MAX) & (np.abs(res).max(axis=1, initial=0) < FP16_MAX)
    if fits.any():
        with np.errstate(over="ignore"):      # the rows that do not fit keep their float32 values
            outs = np.where(fits[:, None], outs.astype(np.float16).astype(np.float32), outs)
            res = np.where(fits[:, None], res.astype(np.float16).astype(np.float32), res)
    outs.flags.writeable = False
    res.flags.writeable = False
    width = 2 * outs.shape[1]
    return [(CacheEntry(outs[i], res[i]), _PREFIX + width * (2 if fits[i] else 4)) if finite[i] else None
            for i in range(len(entries))]


def decode_entry(blob: bytes, address: bytes = b"") -> CacheEntry | None:
    """The entry, or None when the blob is not a well-formed value of this format whose checksum verifies
    for `address`, or when it holds a non-finite number (never written: see L3Store.put)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) < _PREFIX:
        return None
    blob = bytes(blob)
    magic, fmt, code, d = _HEADER.unpack_from(blob)
    width = 2 if code == 1 else 4
    if magic != _MAGIC or fmt != L3_FORMAT or code not in (0, 1) or len(blob) != _PREFIX + 2 * d * width:
        return None
    (stored,) = _CHECKSUM.unpack_from(blob, _HEADER.size)
    if stored != value_checksum(address, blob[:_HEADER.size], memoryview(blob)[_PREFIX:]):
        return None
    vectors = np.frombuffer(blob, "<f2" if code else "<f4", 2 * d, _PREFIX).astype(np.float32)
    if not np.isfinite(vectors).all():
        return None
    out, res = vectors[:d], vectors[d:]
    out.flags.writeable = False
    res.flags.writeable = False
    return CacheEntry(out, res)


def namespace_id(namespace: tuple) -> int:
    """Signed 64-bit id of a walk namespace plus the numerics that computed its values (memoised: it is asked
    on every lookup and write, for a handful of namespaces)."""
    try:
        return _namespace_id(namespace)
    except TypeError:          # an unhashable part: computed each time
        return _namespace_id.__wrapped__(namespace)


@functools.lru_cache(maxsize=256)
def _namespace_id(namespace: tuple) -> int:
    text = json.dumps([L3_FORMAT, _ort_version(), *[str(p) for p in namespace]])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def signed_key(key: int) -> int:
    key &= (1 << 64) - 1
    return key - (1 << 64) if key >= 1 << 63 else key
