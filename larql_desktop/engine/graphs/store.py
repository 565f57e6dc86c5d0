"""Exported ONNX graphs on disk: one folder per GGUF checksum, a manifest per family of graphs.

Every family (the FFN graphs, the attention/head graphs, the whole-model decoder) keeps its files under
<cache>/onnx/<gguf sha256>/ and lists each file's xxh3-128 digest and size in its own manifest, stamped with the
family's export format. Every load hashes every file's whole content (xxh3 runs at several GB/s, so this costs a
fraction of a second per model: see tests/test_integrity.py): a file whose digest does not match (missing,
truncated, bytes flipped even with its size and modification time put back, from an older format) is exported
again from the GGUF, and so is one that onnxruntime refuses to load. Within one process a file verified once is
not hashed again while its identity and change time (ctime, which no one can set back) stay the same.
`digest(names)` names the content of a set of files: part of the cache namespace of what they compute.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import xxhash
import onnxruntime as ort

from larql_desktop.engine.graphs.onnx_deferred import START_MODEL

if TYPE_CHECKING:
    import onnx
    from onnx import helper
else:
    from larql_desktop.engine.graphs.onnx_deferred import helper, onnx

log = logging.getLogger(__name__)
OPSET = 21          # Gelu with approximate="tanh" needs opset 20+
Progress = Callable[[str, float], None]
PROVIDERS = ["CPUExecutionProvider"]


def make_model(nodes, inits, inputs, outputs, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="larql-desktop")
    model.ir_version = 10
    return model


# onnxruntime's process-wide intra-op thread pool, when main() asks for it (share_thread_pool). One pool
# instead of one per session: a walk step alternates ~60 small calls between ~90 sessions, and each
# per-session pool had to wake its sleeping worker for every call (SmolLM2, attention + gate of 30 layers:
# 14.3 ms per token with per-session pools, 8.2 ms with the shared one; a dense per-layer FFN 360 -> 253 us).
# onnxruntime creates that pool once per process, cannot resize it, and then refuses sessions with pools of
# their own, so whether it exists is a fact about the process, remembered here.
_shared_pool_size = 0
_shared_pool_workers: tuple[int, ...] = ()   # native thread ids of the pool's worker threads (Linux)
_shared_pool_lock = threading.Lock()
# The shared pool's workers spin between kernels and between calls (onnxruntime offers no way to stop that for
# its global pool: "session.force_spinning_stop" only acts on per-session pools), so while a model decodes they
# hold a core even when there is no work. Run at this niceness, they yield that core to any other thread that
# wants it (the app's GUI thread, the engine thread's own Python, other processes) and still take every core
# nobody else wants. The calling thread runs any part of a kernel a worker has not picked up, so a worker
# waiting for a core never holds a call back for long.
POOL_WORKER_NICE = 10


def _native_thread_ids() -> set[int]:
    """This process's threads (Linux: /proc/self/task; elsewhere nothing is known)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _start_environment() -> None:
    """Create onnxruntime's environment, and with it the shared pool's threads, now (a one-node session)."""
    opts = ort.SessionOptions()
    opts.use_per_session_threads = False
    ort.InferenceSession(START_MODEL, opts, providers=PROVIDERS)


MADV_DONTNEED = 4
MADV_PAGEOUT = 21
# How often the pages onnxruntime has read of a weights file are handed back while it loads them.
PAGE_RELEASE_INTERVAL_S = 0.01


def release_read_pages(path: Path) -> int:
    """Drop from this process's memory the pages of `path` it has mapped and only read, and return the bytes of
    the mappings released (0 off Linux). onnxruntime maps an optimised copy's external weights (privately, one
    mapping per initializer) and reads them once, to prepack them into its own buffers; the pages it read would
    otherwise stay resident beside those copies (SmolLM2's decoder: 17 MB) for nothing. The mappings stay: a page
    read again is read back from the file. Only a mapping none of whose pages was written is released (no
    anonymous page: a page written in a private mapping becomes a copy of its own, which releasing would lose;
    every other page is the file's own, in the page cache)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        target = str(Path(path).resolve())
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)     # this process's symbols, libc's among them (no ldconfig run)
    except OSError:
        return 0
    mappings: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in lines:
        fields = line.split(None, 5)
        if fields and "-" in fields[0] and not fields[0].endswith(":"):     # a mapping's first line
            current = None
            if len(fields) == 6 and fields[5] == target:
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                current = (start, end)
        elif current is not None and fields[:1] == ["Anonymous:"] and fields[1] == "0":
            mappings.append(current)
    released = 0
    for start, end in mappings:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            released += end - start
    return released


class ReadPagesReleased:
    """While onnxruntime creates a session on an optimised copy, hand back every few milliseconds the pages it
    has read of the copy's weights file. It maps each initializer and reads it to prepack it into a buffer of
    its own, but unmaps the file only once the whole session is made: the pages read pile up meanwhile (SmolLM2's
    decoder: 21 MB above what the process holds once loaded, Gemma 3's: 33 MB; the load's peak).

    MADV_PAGEOUT, not MADV_DONTNEED: it never loses data, so it is safe whatever the address holds by the time it
    is called (onnxruntime may have unmapped the initializer and reused the range for memory of its own, which
    DONTNEED would zero); a page read again is read back. The file's pages stay in the page cache."""

    def __init__(self, path: Path, interval: float = PAGE_RELEASE_INTERVAL_S):
        self._target = str(Path(path).resolve())
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ReadPagesReleased":
        if sys.platform.startswith("linux"):
            self._thread = threading.Thread(target=self._run, name="weights-pages-released", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except OSError:
            return
        while not self._stop.wait(self._interval):
            try:
                with open("/proc/self/maps") as maps:
                    ranges = [line.split(None, 1)[0] for line in maps if line.rstrip("\n").endswith(self._target)]
            except OSError:
                return
            for bounds in ranges:
                start, end = (int(bound, 16) for bound in bounds.split("-"))
                madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)


def shared_pool_workers() -> tuple[int, ...]:
    """Native thread ids of the shared pool's worker threads (empty without the pool, or off Linux)."""
    return _shared_pool_workers


def share_thread_pool(threads: int, worker_nice: int = POOL_WORKER_NICE) -> bool:
    """Run every session this module makes on one onnxruntime pool of `threads` threads. For an entry point
    (main) to call before any session exists and before it starts threads of its own: onnxruntime then
    refuses sessions with pools of their own in this process, so a program that makes its own sessions
    should not call it. The pool's worker threads run at `worker_nice` (see POOL_WORKER_NICE; 0 leaves them
    as they are). Returns whether the pool is in place (False if onnxruntime sessions existed already, or a
    pool of another size did)."""
    global _shared_pool_size, _shared_pool_workers
    threads = max(1, int(threads))
    with _shared_pool_lock:
        if _shared_pool_size:
            return _shared_pool_size == threads
        before = _native_thread_ids()
        try:
            _C.set_global_thread_pool_sizes(threads, 1)
            _start_environment()
        except Exception as exc:    # no C binding, or the environment exists already
            log.info("onnxruntime's shared thread pool is not available (%s); sessions get their own", exc)
            return False
        _shared_pool_size = threads
        _shared_pool_workers = tuple(sorted(_native_thread_ids() - before))
        if worker_nice:
            for tid in _shared_pool_workers:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, worker_nice)
                except (OSError, AttributeError) as exc:   # pragma: no cover - no setpriority, or refused
                    log.info("could not lower onnxruntime's pool thread %d (%s)", tid, exc)
        return True


def session_options(threads: int, spinning: bool = False) -> ort.SessionOptions:
    """Options for a session computing with `threads` threads: on the shared pool when there is one (its size
    then rules), else on a pool of its own whose threads spin between kernels only if `spinning` (one busy
    session: the decoder; dozens of sessions each with a spinning pool make every call cost milliseconds)."""
    opts = ort.SessionOptions()
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    # No memory pattern: onnxruntime keeps one per distinct set of input shapes, and every prompt length and
    # context length is a new one, so the arena grew with each different request (a 1,000-token prompt run
    # twice: 371 -> 457 MB); without, a run's buffers come from the arena and go back to it.
    opts.enable_mem_pattern = False
    if _shared_pool_size:
        opts.use_per_session_threads = False
    else:
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = max(1, int(threads))
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return opts


def _optimized_names(name: str) -> tuple[str, str]:
    """The optimised copy of the graph file `name` and its weights file, for this onnxruntime version."""
    copy = f"{name.removesuffix('.onnx')}.optimized-ort{ort.__version__}.onnx"
    return copy, copy + ".data"


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _hash_file(path: Path, digest) -> str | None:
    # Into one reused buffer, unbuffered: a new bytes object per chunk cost a third of a load's hashing
    # (Gemma 3 270M's 949 MB of graphs: 0.19-0.22 s read chunk by chunk, 0.13 s this way).
    chunk = bytearray(1 << 22)
    view = memoryview(chunk)
    try:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(chunk):
                digest.update(view[:n])
    except OSError:
        return None
    return digest.hexdigest()


def file_digest(path: Path) -> str | None:
    """xxh3-128 of the file's whole content (None when it cannot be read)."""
    return _hash_file(path, xxhash.xxh3_128())


def _identity(stat: os.stat_result) -> tuple:
    """What changes whenever a file's bytes may have: a write updates ctime, and ctime cannot be set back."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class GraphStore:
    """The verified files of one graph family; `session(name, build)` loads one, exporting it if needed.

    `rebuilt` lists the files exported by this store (missing, corrupt or unloadable ones); call `save()`
    once all files are loaded so the manifest records them.
    """

    def __init__(self, directory: Path, manifest_name: str, export_format: int | str,
                 progress: Progress | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.directory / manifest_name
        self.export_format = export_format
        self.progress = progress
        self.rebuilt: list[str] = []
        self.hashed_bytes = 0            # bytes hashed by this store (what verification cost)
        self.hash_seconds = 0.0
        self._manifest = self._read_manifest()
        self._dirty = False
        self._lock = threading.Lock()
        self._verified: dict[str, tuple] = {}   # name -> _identity of the file when its digest last matched

    def _read_manifest(self) -> dict[str, dict]:
        try:
            doc = json.loads(self.manifest_path.read_text())
            if doc.get("format") == self.export_format and isinstance(doc.get("files"), dict):
                # Manifests of earlier versions hold sha256 digests: checked once, then recorded as xxh3.
                return {name: entry for name, entry in doc["files"].items()
                        if isinstance(entry, dict) and isinstance(entry.get("xxh3", entry.get("sha256")), str)}
        except (OSError, ValueError, AttributeError):
            pass
        return {}

    def _digest_of(self, path: Path, kind: str) -> str | None:
        started = time.perf_counter()
        digest = file_digest(path) if kind == "xxh3" else _hash_file(path, hashlib.sha256())
        with self._lock:
            self.hash_seconds += time.perf_counter() - started
            self.hashed_bytes += path.stat().st_size if digest is not None else 0
        return digest

    def is_valid(self, name: str) -> bool:
        """Whether the file's whole content matches its manifest digest (hashed unless this process verified
        the very same file, unchanged since)."""
        entry = self._manifest.get(name)
        if entry is None:
            return False
        path = self.directory / name
        try:
            stat = path.stat()
        except OSError:
            return False
        if self._verified.get(name) == _identity(stat):
            return True
        if stat.st_size != entry.get("size"):
            return False
        kind = "xxh3" if "xxh3" in entry else "sha256"
        if self._digest_of(path, kind) != entry[kind]:
            return False
        with self._lock:
            if kind != "xxh3":     # the old fields stay: an older version of the app still trusts the file
                self._manifest[name] = dict(entry, xxh3=file_digest(path))
                self._dirty = True
            self._verified[name] = _identity(stat)
        return True

    def digest(self, names) -> str:
        """One digest of the recorded content of these files: changes when any of them does."""
        h = xxhash.xxh3_64()
        with self._lock:
            for name in sorted(names):
                entry = self._manifest.get(name, {})
                h.update(f"{name}\0{entry.get('xxh3', entry.get('sha256', ''))}\0".encode())
        return h.hexdigest()

    def export(self, name: str, build: Callable[[], onnx.ModelProto], message: str | None = None,
               fraction: float = 0.0) -> Path:
        if self.progress and message:
            self.progress(message, fraction)
        data = build().SerializeToString()
        path = self.directory / name
        write_atomic(path, data)
        self._record(name, xxhash.xxh3_128_hexdigest(data))
        with self._lock:
            self.rebuilt.append(name)
        return path

    def _record(self, name: str, digest: str) -> None:
        """The manifest entry of a file just written: its digest and size."""
        stat = (self.directory / name).stat()
        with self._lock:
            self._manifest[name] = {"xxh3": digest, "size": stat.st_size}
            self._verified[name] = _identity(stat)
            self._dirty = True

    def ensure(self, name: str, build: Callable[[], onnx.ModelProto], message: str | None = None,
               fraction: float = 0.0, optimized: bool = False) -> Path:
        """The file's path after checking it, exported again if it does not match. `optimized`: a valid
        optimised copy (see `session`) stands in for the file, which it replaced."""
        if optimized:
            copy, data = _optimized_names(name)
            if self.is_valid(copy) and self.is_valid(data):
                return self.directory / copy
        if not self.is_valid(name):
            return self.export(name, build, message, fraction)
        return self.directory / name

    def session(self, name: str, build: Callable[[], onnx.ModelProto], make_opts: Callable[[], ort.SessionOptions],
                message: str | None = None, fraction: float = 0.0, verified: bool = False,
                optimized: bool = False) -> ort.InferenceSession:
        """A session on the file `name`, checked first. `verified`: an earlier `ensure` checked it, so it is
        hashed again only if it changed since (a session made later, on first use, never trusts a file that
        was rewritten after the load's check).

        `optimized`: on onnxruntime's own optimised copy of the file, made by the first load from the exported
        file, which it then replaces (its weights as external data; named per onnxruntime version, as the copy
        may use kernels of this build and machine). onnxruntime then neither parses the big protobuf nor
        re-runs its graph optimisations (the Gemma decoder loads in 0.53 s instead of 1.35 s), and the disk
        holds one copy of the weights. A copy that is missing, changed or refused is made again, from a fresh
        export if need be."""
        if optimized:
            return self._optimized_session(name, build, make_opts, message, fraction)
        path = self.ensure(name, build, message, fraction)
        self.save()     # a file first checked here (a lazily loaded one) may just have been exported
        try:
            return ort.InferenceSession(str(path), make_opts(), providers=PROVIDERS)
        except Exception:       # unreadable despite a matching hash: rebuild it
            path = self.export(name, build, message, fraction)
            self.save()
            return ort.InferenceSession(str(path), make_opts(), providers=PROVIDERS)

    def _optimized_session(self, name: str, build, make_opts, message, fraction) -> ort.InferenceSession:
        copy, data = _optimized_names(name)
        if self.is_valid(copy) and self.is_valid(data):
            opts = make_opts()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                with ReadPagesReleased(self.directory / data):
                    session = ort.InferenceSession(str(self.directory / copy), opts, providers=PROVIDERS)
            except Exception:
                log.info("the optimised copy %s does not load; making it again", copy)
            else:
                self._drop(name)      # an export left from an interrupted replacement
                release_read_pages(self.directory / data)
                return session
        source = self.ensure(name, build, message, fraction)
        try:
            session = self._write_optimized(source, copy, data, make_opts)
        except Exception:       # unreadable despite a matching hash: export it again
            source = self.export(name, build, message, fraction)
            self.save()
            try:
                session = self._write_optimized(source, copy, data, make_opts)
            except Exception as exc:    # e.g. no room for the copy: run on the export itself
                log.warning("could not write the optimised copy of %s (%s); loading the graph as exported",
                            name, exc)
                return ort.InferenceSession(str(source), make_opts(), providers=PROVIDERS)
        self._drop(name)      # the copy replaces it
        return session

    def _drop(self, name: str) -> None:
        """Delete the file `name` and its manifest entry, if there are any."""
        path = self.directory / name
        if not path.exists() and name not in self._manifest:
            return
        path.unlink(missing_ok=True)
        with self._lock:
            self._manifest.pop(name, None)
            self._dirty = True
        self.save()

    def _write_optimized(self, source: Path, copy: str, data: str, make_opts) -> ort.InferenceSession:
        """A session on `source` that writes its optimised graph as `copy` + `data` (moved into place together
        once written) and records both in the manifest."""
        staging = self.directory / f".{copy}.{os.getpid()}.{threading.get_ident()}"
        staging.mkdir(exist_ok=True)
        try:
            opts = make_opts()
            opts.optimized_model_filepath = str(staging / copy)
            # The weights go to a file of their own, named relative to the model: it moves with it.
            opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", data)
            opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                          "1024")
            session = ort.InferenceSession(str(source), opts, providers=PROVIDERS)
            if not (staging / data).exists():   # no initializer big enough to go outside: keep the pair anyway
                (staging / data).write_bytes(b"")
            stem = source.name.removesuffix(".onnx")
            for old in self.directory.glob(f"{stem}.optimized-ort*"):   # other onnxruntime versions
                old.unlink(missing_ok=True)
            os.replace(staging / data, self.directory / data)
            os.replace(staging / copy, self.directory / copy)
            for file in (data, copy):
                self._record(file, file_digest(self.directory / file))
            return session
        finally:
            for leftover in staging.glob("*"):
                leftover.unlink(missing_ok=True)
            staging.rmdir()

    def save(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            write_atomic(self.manifest_path, json.dumps(
                {"format": self.export_format, "files": self._manifest}, indent=1).encode())
            self._dirty = False


class ZeroRows:
    """(T, d) float32 zeros, one array per T, made once: layer 0's "previous FFN output", bound by the
    graphs at every step (never written)."""

    def __init__(self, d: int):
        self._d = d
        self._by_rows: dict[int, np.ndarray] = {}

    def __call__(self, T: int) -> np.ndarray:
        z = self._by_rows.get(T)
        if z is None:
            z = self._by_rows[T] = np.zeros((T, self._d), np.float32)
        return z


class LazySessions:
    """Sessions on files of one store, made on first use (thread-safe): a process that only runs the whole-model
    decoder never pays for (or holds the weights of) the per-layer sessions. A file `GraphStore.ensure` checked at
    load is not hashed again; one it did not is checked (or exported) on first use; a file onnxruntime refuses is
    exported again."""

    def __init__(self, store: GraphStore, files: list[tuple[str, Callable[[], onnx.ModelProto]]],
                 make_opts: Callable[[], ort.SessionOptions], optimized: bool = False):
        self._store, self._files, self._make_opts, self._optimized = store, files, make_opts, optimized
        self._sessions: list[ort.InferenceSession | None] = [None] * len(files)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, i: int) -> ort.InferenceSession:
        session = self._sessions[i]
        if session is None:
            with self._lock:
                session = self._sessions[i]
                if session is None:
                    name, build = self._files[i]
                    session = self._sessions[i] = self._store.session(name, build, self._make_opts, verified=True,
                                                                      optimized=self._optimized)
        return session

    def load_all(self, progress: Progress | None = None, message: str = "Loading ONNX graphs") -> None:
        for i in range(len(self)):
            if progress and self._sessions[i] is None:
                progress(f"{message} ({i + 1}/{len(self)})", i / len(self))
            self[i]


try:   # onnxruntime's C-level binding: the Python wrapper adds ~8 us of bookkeeping per bound name
    from onnxruntime.capi import _pybind_state as _C
    _CPU = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)
except (ImportError, AttributeError, TypeError):   # pragma: no cover - other onnxruntime builds
    _C = None


class Binding:
    """An IO binding of one session for one thread, bound to numpy buffers (no copies in or out).

    Each name remembers the array object it is bound to (and keeps it alive), so buffers that stay put (the
    KV cache, rope tables, scalars updated in place) are bound once; fresh arrays are bound each call.
    """

    def __init__(self, session: ort.InferenceSession):
        self._bound: dict[str, np.ndarray] = {}
        if _C is not None and hasattr(session, "_sess"):
            self._b = _C.SessionIOBinding(session._sess)
            self._run = partial(session._sess.run_with_iobinding, self._b, None)
            self._fast = True
        else:   # pragma: no cover
            self._b = session.io_binding()
            self._run = partial(session.run_with_iobinding, self._b)
            self._fast = False

    def bind_input(self, name: str, array: np.ndarray) -> None:
        """Bind a C-contiguous array (kept referenced until rebound: the same object is not bound twice)."""
        if self._bound.get(name) is array:
            return
        if self._fast:
            self._b.bind_input(name, _CPU, array.dtype, array.shape, array.ctypes.data)
        else:   # pragma: no cover
            self._b.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        self._bound[name] = array

    def bind_output(self, name: str, array: np.ndarray) -> None:
        key = "\0" + name
        if self._bound.get(key) is array:
            return
        if self._fast:
            self._b.bind_output(name, _CPU, array.dtype, array.shape, array.ctypes.data)
        else:   # pragma: no cover
            self._b.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        self._bound[key] = array

    def run(self) -> None:
        self._run()
