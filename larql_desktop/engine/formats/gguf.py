"""A fast GGUF reader: metadata parsed in bulk, tensors exposed as memory-mapped views.

The `gguf` package's reader parses vocabulary arrays element by element (tens of seconds for
Gemma's 262k-entry vocab); here string arrays are decoded in one pass over a bytes view and
numeric arrays are copied out whole, so a header loads in a fraction of a second. A vocabulary-sized
array is only checked when the file opens and decoded each time it is asked for (GgufMetadata), and
a few rows of a tensor are read from the file rather than through the map (GgufTensor.read_rows).
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GgufError(ValueError):
    """A GGUF file that cannot be read: missing, truncated, corrupt or unsupported."""


# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_DTYPES = {
    _UINT8: np.dtype("<u1"), _INT8: np.dtype("<i1"), _UINT16: np.dtype("<u2"), _INT16: np.dtype("<i2"),
    _UINT32: np.dtype("<u4"), _INT32: np.dtype("<i4"), _FLOAT32: np.dtype("<f4"), _BOOL: np.dtype("<u1"),
    _UINT64: np.dtype("<u8"), _INT64: np.dtype("<i8"), _FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_id: int
    block_elems: int   # weights per block
    block_bytes: int   # bytes per block


# Only the ggml types this engine can dequantise; any other type is refused with a clear error.
QUANT_TYPES = {q.ggml_id: q for q in (
    QuantType("F32", 0, 1, 4),
    QuantType("F16", 1, 1, 2),
    QuantType("Q4_0", 2, 32, 18),
    QuantType("Q4_1", 3, 32, 20),
    QuantType("Q5_0", 6, 32, 22),
    QuantType("Q8_0", 8, 32, 34),
    QuantType("Q4_K", 12, 256, 144),
    QuantType("Q6_K", 14, 256, 210),
)}
_KNOWN_TYPE_NAMES = {4: "Q4_2", 5: "Q4_3", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K",
                     16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
                     22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
                     29: "IQ1_M", 30: "BF16"}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: its numpy shape (GGUF dims reversed), type and raw bytes (a view into the file)."""
    name: str
    shape: tuple[int, ...]
    qtype: QuantType
    raw: np.ndarray  # uint8 view of the tensor's bytes
    # Where those bytes start in the file, and the file open for positional reads (see `read_rows`).
    file_offset: int = 0
    source: BinaryIO | None = field(default=None, repr=False, compare=False)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)     # per embedded token: np.prod's dispatch cost more than the product

    @property
    def blocks(self) -> np.ndarray:
        """Raw bytes reshaped to (rows, blocks_per_row * block_bytes)."""
        return self.raw.reshape(self.shape[0] if len(self.shape) > 1 else 1, -1)

    def read_rows(self, rows: np.ndarray, row_bytes: int) -> np.ndarray:
        """The raw bytes of rows `rows` (valid indices into rows of `row_bytes` bytes) as (len(rows), row_bytes),
        read from the file, not through the memory map. A page touched through the map stays in this process's
        resident set with its neighbours (the page cache maps large folios whole: 120 random token embeddings
        of SmolLM2 left 28 MB resident), so embedding lookups alone grew a chat's RSS by tens of MB; a read
        copies just the row."""
        out = np.empty((len(rows), row_bytes), np.uint8)
        if self.source is None or not hasattr(os, "preadv"):
            out[:] = self.raw.reshape(-1, row_bytes)[rows]
            return out
        fd, base = self.source.fileno(), self.file_offset
        for j, row in enumerate(rows.tolist()):
            if os.preadv(fd, [out[j]], base + row * row_bytes) != row_bytes:
                raise GgufError(f"{self.name}: short read of row {row} (the file changed on disk?)")
        return out


# Metadata arrays of at least this many elements (a vocabulary's tokens, merges, scores and types) are read when
# asked for, each time, not when the file is opened: see GgufMetadata.
DEFERRED_ARRAY_MIN = 4096


class _DeferredArray:
    """Where a large metadata array lies in the file: read by `load` (checked when the file was opened)."""
    __slots__ = ("buf", "pos", "etype", "count", "path")

    def __init__(self, buf, pos: int, etype: int, count: int, path):
        self.buf, self.pos, self.etype, self.count, self.path = buf, pos, etype, count, path

    def load(self):
        cursor = _Cursor(self.buf, self.path)
        cursor.pos = self.pos
        return cursor.array(self.etype, self.count)


class PackedStrings(Sequence[str]):
    """Strings, read-only, as one buffer of their UTF-8 bytes and an array of ends: as Python objects, Gemma 3's
    262k token texts take ~23 MB; packed, ~4 MB. A string is decoded when it is read (~0.2 us), as the file's
    strings are: invalid UTF-8 becomes U+FFFD."""

    def __init__(self, blob: bytes, ends: array):
        self._blob, self._ends = blob, ends

    @classmethod
    def of(cls, texts: Iterable[str]) -> "PackedStrings":
        blob, ends = bytearray(), array("q")
        for text in texts:
            blob += text.encode("utf-8")
            ends.append(len(blob))
        return cls(bytes(blob), ends)

    def __len__(self) -> int:
        return len(self._ends)

    def __iter__(self) -> Iterator[str]:
        blob, start = self._blob, 0
        for end in self._ends:
            yield blob[start:end].decode("utf-8", errors="replace")
            start = end

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} strings")
        return self._blob[self._ends[i - 1] if i else 0:self._ends[i]].decode("utf-8", errors="replace")


class GgufMetadata(dict):
    """The metadata keys and values; a large array is read from the file each time it is asked for, not kept.
    A vocabulary's arrays are read once, by the tokenizer, which keeps what it needs in its own form: kept here
    too they were a second copy for the process's life (Gemma 3's 262k token strings, scores and types), and
    made when the file was opened, they were resident through the onnxruntime sessions' load, whose peak sets
    the process's (the tokenizer is built after it)."""

    def __getitem__(self, key: str):
        value = super().__getitem__(key)
        return value.load() if isinstance(value, _DeferredArray) else value

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def packed_strings(self, key: str) -> PackedStrings | None:
        """A string array as `PackedStrings`, read from the file without making a Python string of each; None
        when the key is missing or is not an array of strings."""
        value = super().get(key)
        if isinstance(value, _DeferredArray) and value.etype == _STRING:
            cursor = _Cursor(value.buf, value.path)
            cursor.pos = value.pos
            return cursor.packed_string_array(value.count)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return PackedStrings.of(value)
        return None

    def values(self):           # type: ignore[override]
        return [self[key] for key in self]

    def items(self):            # type: ignore[override]
        return [(key, self[key]) for key in self]


class _Cursor:
    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf, path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GgufError(f"{self.path}: truncated GGUF header (needed {n} bytes at offset {self.pos}, "
                            f"file has {self.size}); re-download or re-install the model")

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if count >= DEFERRED_ARRAY_MIN and (etype == _STRING or etype in _SCALAR_DTYPES):
                deferred = _DeferredArray(self.buf, self.pos, etype, count, self.path)
                self.skip_array(etype, count)
                return deferred
            return self.array(etype, count)
        if vtype in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[vtype]
            self.need(dtype.itemsize)
            v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0]
            self.pos += dtype.itemsize
            return bool(v) if vtype == _BOOL else v.item()
        raise GgufError(f"{self.path}: unknown GGUF metadata value type {vtype}")

    def array(self, etype: int, count: int):
        """The `count` elements of type `etype` at the cursor (a list, or a numpy array of numbers)."""
        if etype == _STRING:
            return self.string_array(count)
        if etype in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[etype]
            self.need(count * dtype.itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr.astype(bool) if etype == _BOOL else arr
        if etype == _ARRAY:
            return [self.value(_ARRAY) for _ in range(count)]
        raise GgufError(f"{self.path}: unknown GGUF array element type {etype}")

    def skip_array(self, etype: int, count: int) -> None:
        """Move past `count` strings or numbers of type `etype`, checking they are all in the file."""
        if etype != _STRING:
            nbytes = count * _SCALAR_DTYPES[etype].itemsize
            self.need(nbytes)
            self.pos += nbytes
            return
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise GgufError(f"{self.path}: truncated GGUF string array")
            pos += 8 + unpack("<Q", buf, pos)[0]
        if pos > size:
            raise GgufError(f"{self.path}: truncated GGUF string array")
        self.pos = pos

    def packed_string_array(self, count: int) -> PackedStrings:
        # Strings are length-prefixed: walk the lengths, copying the bytes; each is decoded when it is read.
        buf, pos, size = self.buf, self.pos, self.size
        blob, ends = bytearray(), array("q")
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise GgufError(f"{self.path}: truncated GGUF string array")
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > size:
                raise GgufError(f"{self.path}: truncated GGUF string array")
            blob += buf[pos:pos + n]
            ends.append(len(blob))
            pos += n
        self.pos = pos
        return PackedStrings(bytes(blob), ends)

    def string_array(self, count: int) -> list[str]:
        return list(self.packed_string_array(count))


class GgufFile:
    """An open GGUF file. `metadata` is a GgufMetadata (a dict); `tensors` maps names to GgufTensor views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GgufError(f"{self.path}: no such GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise GgufError(f"{self.path}: file is too small to be a GGUF model ({size} bytes)")
        # Kept open for reads of a few rows (GgufTensor.read_rows), of the very file the map shows.
        self._reader: BinaryIO = open(self.path, "rb", buffering=0)
        self._mmap = mmap.mmap(self._reader.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._mmap)
        self._bytes = bytes(buf[:0])  # keeps nothing; the memoryview holds the map
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GgufError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf, self.path)
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GgufError(f"{self.path}: unsupported GGUF version {self.version} (2 and 3 are supported)")
        n_tensors, n_kv = cur.unpack("<QQ")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GgufError(f"{self.path}: implausible GGUF header counts ({n_tensors} tensors, {n_kv} keys)")
        self.metadata = GgufMetadata()
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("<I")
            self.metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 4:
                raise GgufError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            infos.append((name, dims, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.data_offset = data_start
        self.tensors: dict[str, GgufTensor] = {}
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        for name, dims, ggml_type, offset in infos:
            qtype = QUANT_TYPES.get(ggml_type)
            if qtype is None:
                tname = _KNOWN_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")
                raise GgufError(f"{self.path}: tensor {name!r} uses unsupported quantisation {tname}; "
                                f"supported: {', '.join(q.name for q in QUANT_TYPES.values())}")
            n_el = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % qtype.block_elems:
                raise GgufError(f"{self.path}: tensor {name!r} row of {dims[0]} is not a multiple of "
                                f"{qtype.name}'s block of {qtype.block_elems}")
            nbytes = n_el // qtype.block_elems * qtype.block_bytes
            start = data_start + offset
            if start + nbytes > size:
                raise GgufError(f"{self.path}: truncated: tensor {name!r} ends at byte {start + nbytes} "
                                f"but the file has {size} bytes; re-download or re-install the model")
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = GgufTensor(name, shape, qtype, whole[start:start + nbytes], start, self._reader)

    def release_header_pages(self) -> None:
        """Hand back the pages of the header (metadata and tensor index) this process has read: once the
        tokenizer has its packed copy of the vocabulary nothing reads them again (SmolLM2: 1.7 MB resident for
        nothing). The map is read-only, so a later read of a metadata value only reads them back."""
        header_pages = self.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED") and header_pages and not self._mmap.closed:
            self._mmap.madvise(mmap.MADV_DONTNEED, 0, header_pages)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default=None):
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def sha256(self) -> str:
        """Checksum of the whole file (used to key exported ONNX files and cache entries). Read through one reused
        buffer, not through the memory map: every page hashed through the map stays mapped into this process, so
        a first load's peak RSS counted the whole file (Gemma 3 270M: +235 MB) on top of the weights."""
        digest = hashlib.sha256()
        chunk = bytearray(4 << 20)
        view = memoryview(chunk)
        with open(self.path, "rb", buffering=0) as fh:
            while n := fh.readinto(chunk):
                digest.update(view[:n])
        return digest.hexdigest()
