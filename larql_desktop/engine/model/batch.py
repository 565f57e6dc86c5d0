"""Batched decode: the decode steps of concurrent replies in one forward pass (like llama.cpp's server slots).

A reply prefills in its own session as always (chunked, through the prefix cache), then joins the batch: its KV
moves into a row of a pool shaped (rows, kv_heads, capacity, head_dim) per layer, and its session's `kv` becomes a
`SlotKv`, that row's views. From then on each `DecodeBatch.step` advances every row by one token: each row's own
code (the session's decode generator: sampling, stop strings, logprobs) runs in a thread of its own up to its
forward pass, which it hands to the batch (`BatchRow.forward`, the session's `step_forward`); when every row has
handed in its token or finished its step, one call of the batched decoder graph computes all their logits and
the rows go on. Nothing of a row's reply is computed differently from the single path but the batched kernels
(tests/test_batched_decode.py measures the agreement).

Only passes the single path would run in the dense decoder graph are batched (`ffn.runs_plain_dense()`): a row
whose FFN is the walk (or whose settings change mid-reply) runs its forward pass on its own, through
`TransformerModel.forward` over its row, exactly as the single path. A row leaves (its pool row is freed, the last
row moved into its place) when its reply ends or its client goes away, between steps.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np

from larql_desktop.engine.model.transformer import FfnCall, KvCache, PassAwareFfn, TransformerModel

T = TypeVar("T")
INITIAL_CAPACITY = 256      # positions per row at first (KvCache's own default), doubled as rows grow


class SlotKv(KvCache):
    """A KvCache whose per-layer buffers are one row of a DecodeBatch's pool (views into it: the batched graph
    writes the row's keys and values in place). It cannot grow by itself: the batch makes room before each step."""

    def __init__(self, config, length: int):
        self.config = config
        self.length = length
        self._cap = 0
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def point_at(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], row: int) -> None:
        self.keys = [k[row] for k in keys]
        self.values = [v[row] for v in values]
        self._cap = keys[0].shape[2]

    def reserve(self, needed: int) -> None:
        if needed > self._cap:
            raise RuntimeError(f"a batched row holds {self._cap} positions, not {needed}: the batch makes room "
                               "before each step")


@dataclass(frozen=True)
class BatchStats:
    """What the batch did since it was made (a snapshot: the API's /v1/cache-stats shows it)."""
    max_rows: int
    rows_in_use: int
    capacity: int           # positions per row in the pool
    joined: int
    left: int
    steps: int              # batched decoder calls
    row_steps: int          # tokens they computed (rows summed over steps)
    solo_steps: int         # forward passes rows ran on their own (an FFN the batched graph does not compute)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class BatchRow:
    """One reply's place in the batch: its session and its row of the pool."""

    def __init__(self, batch: "DecodeBatch", session, kv: SlotKv):
        self.batch = batch
        self.session = session
        self.kv = kv
        self.index = -1
        self._token: int | None = None      # handed in for this step
        self._logits: np.ndarray | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()

    def forward(self, ids, kv: KvCache, ffn: FfnCall) -> np.ndarray:
        """The session's decode forward pass (its `step_forward`), in the row's step thread: a dense step waits
        for the batch's call; anything else runs on its own as the single path runs it."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size != 1 or kv is not self.kv or not self.batch.batches(ffn):
            self.batch._count_solo()
            return self.batch.model.forward(ids, kv, ffn)
        if not 0 <= int(ids[0]) < self.batch.model.config.vocab_size:
            raise ValueError(f"token id out of range for a vocabulary of {self.batch.model.config.vocab_size}")
        assert isinstance(ffn, PassAwareFfn)
        ffn.record_dense_pass()
        self._ready.clear()
        self.batch._hand_in(self, int(ids[0]))
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self._logits is not None
        logits, self._logits = self._logits, None
        return logits


class DecodeBatch(Generic[T]):
    """The pool of decode rows over one model and its batched decoder graph (graphs/batched.py's
    OnnxBatchedDecoder). `join`, `leave` and `step` may be called from any thread, one at a time (a lock)."""

    def __init__(self, model: TransformerModel, decoder, max_rows: int = 8):
        if max_rows < 1:
            raise ValueError(f"a batch needs at least one row, not {max_rows}")
        self.model = model
        self.decoder = decoder
        self.max_rows = max_rows
        self._rows: list[BatchRow] = []
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._capacity = 0
        self._lock = threading.RLock()
        self._handed = threading.Condition()
        self._threads = ThreadPoolExecutor(max_rows, thread_name_prefix="larql-batch-row")
        self._joined = self._left = self._steps = self._row_steps = self._solo = 0

    # -- membership ----------------------------------------------------------------------------------------
    def batches(self, ffn: FfnCall) -> bool:
        """Whether a decode step through `ffn` is one the batched graph computes: the single path's dense decoder
        graph pass."""
        return (self.model.decoder is not None and isinstance(ffn, PassAwareFfn) and ffn.runs_plain_dense())

    def can_join(self, ffn: FfnCall) -> bool:
        with self._lock:
            return len(self._rows) < self.max_rows and self.batches(ffn)

    def join(self, session) -> BatchRow:
        """Move `session`'s KV into a free row; its decode forward passes go through the batch from now on."""
        with self._lock:
            if len(self._rows) >= self.max_rows:
                raise RuntimeError(f"all {self.max_rows} batch rows are in use")
            old: KvCache = session.kv
            self._make_room(len(self._rows) + 1, old.length + 1)
            row = BatchRow(self, session, SlotKv(self.model.config, old.length))
            row.index = len(self._rows)
            self._rows.append(row)
            row.kv.point_at(self._keys, self._values, row.index)
            for i in range(self.model.config.n_layers):
                row.kv.keys[i][:, :old.length] = old.keys[i][:, :old.length]
                row.kv.values[i][:, :old.length] = old.values[i][:, :old.length]
            session.kv = row.kv
            session.step_forward = row.forward
            self._joined += 1
            return row

    def leave(self, row: BatchRow) -> None:
        """Free the row (idempotent). Its session no longer decodes through the batch and its KV is gone: the
        reply has ended."""
        with self._lock:
            if row.index < 0:
                return
            last = self._rows[-1]
            if last is not row:          # the last row moves into the freed one: rows stay 0..n-1
                n = last.kv.length
                for store in (self._keys, self._values):
                    for array in store:
                        array[row.index, :, :n] = array[last.index, :, :n]
                last.index = row.index
                self._rows[row.index] = last
                last.kv.point_at(self._keys, self._values, last.index)
            self._rows.pop()
            row.index = -1
            session = row.session
            session.step_forward = None
            session.kv = KvCache(self.model.config)   # the pool's row is another reply's now: the session starts over
            session.history.clear()
            session.exact_length = 0
            self._left += 1
            if not self._rows:           # an idle server holds no pool
                self._keys, self._values, self._capacity = [], [], 0

    def _make_room(self, rows: int, positions: int) -> None:
        """Grow the pool to at least `rows` rows (doubling, up to max_rows) of at least `positions` positions."""
        have_rows = self._keys[0].shape[0] if self._keys else 0
        if rows <= have_rows and positions <= self._capacity:
            return
        new_rows = max(rows, min(self.max_rows, max(1, 2 * have_rows)))
        capacity = max(self._capacity, INITIAL_CAPACITY)
        while capacity < positions:
            capacity *= 2
        cfg = self.model.config
        shape = (new_rows, cfg.n_kv_heads, capacity, cfg.head_dim)
        keys, values = [], []
        for old_keys, old_values in zip(self._keys or [None] * cfg.n_layers, self._values or [None] * cfg.n_layers):
            k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
            if old_keys is not None:
                k[:have_rows, :, :self._capacity] = old_keys
                v[:have_rows, :, :self._capacity] = old_values
            keys.append(k)
            values.append(v)
        self._keys, self._values, self._capacity = keys, values, capacity
        for row in self._rows:
            row.kv.point_at(keys, values, row.index)

    # -- stepping ------------------------------------------------------------------------------------------
    def _hand_in(self, row: BatchRow, token: int) -> None:
        with self._handed:
            row._token = token
            self._handed.notify_all()

    def _notify(self, _future: Future) -> None:
        with self._handed:
            self._handed.notify_all()

    def _count_solo(self) -> None:
        with self._handed:
            self._solo += 1

    def step(self, steps: dict[BatchRow, Callable[[], T]]) -> dict[BatchRow, T | BaseException]:
        """Run each row's step (its reply's next token: a decode generator's `next`) in a thread of its own, their
        dense forward passes together in one call of the batched decoder; returns each row's result, or the
        exception its step raised. Rows of the batch not in `steps` sit this step out."""
        with self._lock:
            rows = list(self._rows)
            if any(r.index < 0 for r in steps):
                raise ValueError("a row that left the batch cannot step")
            if rows:
                self._make_room(len(rows), max(r.kv.length for r in rows) + 1)
            for r in rows:
                r._token, r._error = None, None
            futures: dict[BatchRow, Future] = {r: self._threads.submit(fn) for r, fn in steps.items()}
            for f in futures.values():
                f.add_done_callback(self._notify)
            with self._handed:
                # Every stepping row either hands in its token or ends its step without a forward pass.
                self._handed.wait_for(lambda: all(r._token is not None or f.done() for r, f in futures.items()))
            waiting = [r for r in rows if r._token is not None]
            if waiting:
                try:
                    self._run(rows)
                except BaseException as exc:     # the rows' steps end with it
                    for r in waiting:
                        r._error = exc
                for r in waiting:
                    r._ready.set()
            results: dict[BatchRow, T | BaseException] = {}
            for r, f in futures.items():
                exc = f.exception()
                results[r] = exc if exc is not None else f.result()
            return results

    def _run(self, rows: list[BatchRow]) -> None:
        """One batched decoder call over the pool's first len(rows) rows; a row that handed in no token computes
        one at its position anyway (the rows must be contiguous), which it never reads: its length stays."""
        n = len(rows)
        tokens = np.array([r._token if r._token is not None else 0 for r in rows], np.int64)
        positions = np.array([r.kv.length for r in rows], np.int64)
        h = self.model.embed(tokens)
        logits = self.decoder.run(h, positions, [k[:n] for k in self._keys], [v[:n] for v in self._values],
                                  self.model.rope)
        stepped = 0
        for i, r in enumerate(rows):
            if r._token is not None:
                r.kv.length += 1
                r._logits = logits[i:i + 1]
                stepped += 1
        self._steps += 1
        self._row_steps += stepped

    def stats(self) -> BatchStats:
        with self._handed:
            return BatchStats(self.max_rows, len(self._rows), self._capacity, self._joined, self._left,
                              self._steps, self._row_steps, self._solo)

    def close(self) -> None:
        self._threads.shutdown(wait=False)
