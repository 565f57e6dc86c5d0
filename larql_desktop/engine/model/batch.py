"""Batched decode: the decode steps of concurrent replies in one forward pass (like llama.cpp's server slots).

A reply prefills in its own session as always (chunked, through the prefix cache), then joins the batch: its KV
moves into a row of a pool shaped (rows, kv_heads, capacity, head_dim) per layer, and its session's `kv` becomes a
`SlotKv`, that row's views. From then on each `DecodeBatch.step` advances every row by one token: each row's own
code runs in a thread of its own (the session's decode generator: the model's forward pass, sampling, stop
strings, logprobs, the walk's cache lookups), exactly as on the single path, up to the call of a whole-model
decoder graph: the model's decoder is a `RowRouter`, which hands that call from a row's thread to the batch. When
every row has handed in its call or finished its step, the rows' calls are grouped by kind (dense; walked with its
K; served or replayed from the walk's cache, each row with its own plan's FFN outputs; walked rows and served or
replayed ones together in the mixed decoder, served and replayed ones together in the served decoder), one call
of the batched graphs (graphs/batched.py) computes each group, and each row goes on with its own result: the
dense decoder's logits, or the walked, served or replay decoder's pass, which the row's walk settles (keys,
lookups, stores, statistics, and from a layer it does not keep on, its layers redone) as a single step. For those
the batch also runs the head once for the group (a row that keeps every layer takes its logits from there, as the
single path takes the head graph'shead graph's).

So only the graph calls are shared: what a row's FFN decides, and its cache counts, are the single path's. A
prefill runs on its own, and so does a call that is alone of its kind in a step beside a larger group (a batched
call over the pool costs more than one row's own call). A row leaves (its pool row is freed, the last row moved
into its place) when its reply ends or its client goes away, between steps.
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

import numpy as np

from larql_desktop.engine.model.transformer import FfnCall, KvCache, TransformerModel, stepper_of, zeroed_layer_pairs

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
    solo_steps: int         # decoder calls rows handed in but ran on their own (alone of their kind in a step)
    by_kind: dict           # per kind of call ("dense", "walked", "served", "replay"): {"steps", "row_steps"}
    mixed_steps: int        # batched calls that held walked rows and served or replayed ones

    def to_dict(self) -> dict:
        return {**self.__dict__, "by_kind": {kind: dict(counts) for kind, counts in self.by_kind.items()}}


class BatchRow:
    """One reply's place in the batch: its session and its row of the pool."""

    def __init__(self, batch: "DecodeBatch", session, kv: SlotKv):
        self.batch = batch
        self.session = session
        self.kv = kv
        self.index = -1
        # What it handed in this step: ("dense",), ("walked", k), ("served",) or ("replay",), with the served
        # and replay decoders' FFN outputs (n_layers, d) and the served decoder's selections (n_layers, F).
        self.handed_kind: tuple | None = None
        self.handed_h: np.ndarray | None = None
        self.handed_served: np.ndarray | None = None
        self.handed_selections: np.ndarray | None = None
        self.result = None
        self.error: BaseException | None = None
        self.solo = False                  # this step its call runs on its own (alone of its kind)
        self.ready = threading.Event()

    def hand_in(self, kind: tuple, h: np.ndarray, run_alone: Callable[[], object], served: np.ndarray | None = None,
                selections: np.ndarray | None = None):
        """In the row's step thread: wait for the batch to run this decoder call (`run_alone` runs it on its own,
        when the batch says so) and return its result."""
        if self.handed_kind is not None:           # a second decoder call in one step: the batch's call has run
            return run_alone()
        self.ready.clear()
        self.handed_h, self.handed_served, self.handed_selections = h, served, selections
        compute = self.batch.compute_lock
        compute.release()                    # the other rows run up to their calls meanwhile
        try:
            self.batch.receive(self, kind)
            self.ready.wait()
        finally:
            compute.acquire()
        if self.error is not None:
            raise self.error
        if self.solo:
            return run_alone()
        result, self.result = self.result, None
        return result


class RowRouter:
    """Stands in for a model's decoder (graphs/decoder.py's OnnxDecoder): a decode step's dense, walked, served or
    replay decoder call made from a batch row's step thread, on that row's KV, goes to the row's batch; every other
    call (other threads: the app's chats, prefills) goes to the decoder itself. Installed once per model
    (`install`), whatever the number of batches."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.local = threading.local()       # .row: the BatchRow whose step this thread runs

    @classmethod
    def install(cls, model: TransformerModel) -> "RowRouter":
        decoder: Any = model.decoder
        if isinstance(decoder, RowRouter):
            return decoder
        router = cls(decoder)
        model.use_graphs(model.graphs, router, model.softmax)
        return router

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)

    def _row_for(self, h: np.ndarray, kv) -> BatchRow | None:
        row = getattr(self.local, "row", None)
        return row if row is not None and h.shape[0] == 1 and kv is row.kv else None

    def run(self, h: np.ndarray, start: int, kv, rope) -> np.ndarray:
        row = self._row_for(h, kv)
        alone = lambda: self.decoder.run(h, start, kv, rope)   # noqa: E731
        return alone() if row is None else row.hand_in(("dense",), h, alone)

    def run_walked(self, h: np.ndarray, start: int, kv, rope, k: int):
        row = self._row_for(h, kv)
        alone = lambda: self.decoder.run_walked(h, start, kv, rope, k)   # noqa: E731
        return alone() if row is None else row.hand_in(("walked", k), h, alone)

    def run_served(self, h: np.ndarray, start: int, kv, rope, served: np.ndarray, selections: np.ndarray):
        row = self._row_for(h, kv)
        alone = lambda: self.decoder.run_served(h, start, kv, rope, served, selections)   # noqa: E731
        return alone() if row is None else row.hand_in(("served",), h, alone, served, selections)

    def run_replay(self, h: np.ndarray, start: int, kv, rope, served: np.ndarray):
        row = self._row_for(h, kv)
        alone = lambda: self.decoder.run_replay(h, start, kv, rope, served)   # noqa: E731
        return alone() if row is None else row.hand_in(("replay",), h, alone, served)


class DecodeBatch(Generic[T]):
    """The pool of decode rows over one model and its batched decoder graph (graphs/batched.py's
    OnnxBatchedDecoder). `join`, `leave` and `step` may be called from any thread, one at a time (a lock)."""

    def __init__(self, model: TransformerModel, decoder, max_rows: int = 8):
        if max_rows < 1:
            raise ValueError(f"a batch needs at least one row, not {max_rows}")
        if getattr(model, "decoder", None) is None:     # (TransformerModel declares it None until graphs attach)
            raise ValueError("a batch needs a model with decoder graphs")
        self.model = model
        self.decoder = decoder
        self.router = RowRouter.install(model)
        self.max_rows = max_rows
        self._rows: list[BatchRow] = []
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._capacity = 0
        self._lock = threading.RLock()
        self._handed = threading.Condition()
        # Rows' step threads run one at a time (but while waiting for the batch's call), as replies in turns do:
        # their Python work holds the GIL anyway, and onnxruntime calls made on their own (a served step, a walk
        # layer redone) would only contend for the same cores.
        self.compute_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_rows, thread_name_prefix="larql-batch-row")
        self._joined = self._left = self._steps = self._row_steps = self._solo = self._mixed = 0
        self._by_kind: dict[str, dict[str, int]] = {}

    # -- membership ----------------------------------------------------------------------------------------
    def batches(self, ffn: FfnCall) -> bool:
        """Whether the decode steps of a reply through `ffn` are ones the batched graphs compute: the dense
        decoder's or the walk's (a walk whose steps run in one decoder call: walked, or served or replayed from
        its cache)."""
        stepper = stepper_of(ffn)
        return stepper is not None and stepper.runs_decoder_steps()

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
            row.kv.copy_prefix(old, old.length)
            session.kv = row.kv
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
        keys, values = zeroed_layer_pairs(cfg.n_layers, shape)
        # Each row's own positions only: copying the whole old capacity wrote every page of the new pool (8 rows of
        # 256 SmolLM2 positions: 94 MB), where the rows hold a few hundred kB each.
        for row in self._rows:
            n = row.kv.length
            for new, old in zip(keys + values, self._keys + self._values):
                new[row.index, :, :n] = old[row.index, :, :n]
        self._keys, self._values, self._capacity = keys, values, capacity
        for row in self._rows:
            row.kv.point_at(keys, values, row.index)

    # -- stepping ------------------------------------------------------------------------------------------
    def receive(self, row: BatchRow, kind: tuple) -> None:
        with self._handed:
            row.handed_kind = kind
            self._handed.notify_all()

    def _notify(self, _future: Future) -> None:
        with self._handed:
            self._handed.notify_all()

    def _in_row(self, row: BatchRow, fn: Callable[[], T]) -> Callable[[], T]:
        def step() -> T:
            with self.compute_lock:
                self.router.local.row = row
                try:
                    return fn()
                finally:
                    self.router.local.row = None
        return step

    def step(self, steps: dict[BatchRow, Callable[[], T]]) -> dict[BatchRow, T | BaseException]:
        """Run each row's step (its reply's next token: a decode generator's `next`) in a thread of its own, their
        decoder calls together in one call of a batched graph; returns each row's result, or the exception its
        step raised. Rows of the batch not in `steps` sit this step out."""
        with self._lock:
            rows = list(self._rows)
            if any(r.index < 0 for r in steps):
                raise ValueError("a row that left the batch cannot step")
            if rows:
                # Room for every row's next position, and two more: a batched call computes a discarded row for
                # each row not in it one past its length, and a row that stepped on its own before the call has
                # a new length already.
                self._make_room(len(rows), max(r.kv.length for r in rows) + 3)
            for r in rows:
                r.handed_kind, r.error, r.solo, r.result = None, None, False, None
            futures: dict[BatchRow, Future] = {r: self._threads.submit(self._in_row(r, fn)) for r, fn in steps.items()}
            for f in futures.values():
                f.add_done_callback(self._notify)
            with self._handed:
                # Every stepping row either hands in its decoder call or ends its step without one.
                self._handed.wait_for(lambda: all(r.handed_kind is not None or f.done() for r, f in futures.items()))
            waiting = [r for r in rows if r.handed_kind is not None]
            groups: dict[tuple, list[BatchRow]] = {}
            for r in waiting:
                assert r.handed_kind is not None
                groups.setdefault(r.handed_kind, []).append(r)
            # One batched call per kind of call (walked rows and served or replayed ones share one); a call alone
            # of its kind beside a larger group runs on its own (after the batched calls: those write only a
            # discarded row past its length).
            ordered = sorted(self._calls(groups), key=lambda group: -len(group[1]))
            batched = [(kind, members) for i, (kind, members) in enumerate(ordered) if i == 0 or len(members) > 1]
            for kind, members in batched:
                try:
                    self._run(rows, kind, members)
                except BaseException as exc:     # the rows' steps end with it
                    for r in members:
                        r.error = exc
            in_batch = {r for _, members in batched for r in members}
            with self._handed:
                self._solo += len(waiting) - len(in_batch)
            for r in waiting:
                r.solo = r not in in_batch
                r.ready.set()
            results: dict[BatchRow, T | BaseException] = {}
            for r, f in futures.items():
                raised = f.exception()
                results[r] = raised if raised is not None else f.result()
            return results

    @staticmethod
    def _calls(groups: dict[tuple, list[BatchRow]]) -> list[tuple[tuple, list[BatchRow]]]:
        """The batched calls for the rows' calls grouped by kind: one per kind, except that the served and
        replayed rows join the largest group of walked rows in one call of the mixed decoder ("mixed", K), or
        without walked rows share one call of the served decoder."""
        given = groups.get(("served",), []) + groups.get(("replay",), [])
        walked = [kind for kind in groups if kind[0] == "walked"]
        if not walked:
            if ("served",) not in groups or ("replay",) not in groups:
                return list(groups.items())
            return [(kind, members) for kind, members in groups.items() if kind[0] not in ("served", "replay")] + \
                [(("served",), given)]
        if not given:        # the walked decoder: the mixed one costs 20-35% more for the same walked rows
            return list(groups.items())
        host = max(walked, key=lambda kind: len(groups[kind]))     # the first of the largest
        calls = [(kind, members) for kind, members in groups.items()
                 if kind not in (host, ("served",), ("replay",))]
        return calls + [(("mixed", host[1]), groups[host] + given)]

    def _run(self, rows: list[BatchRow], kind: tuple, members: list[BatchRow]) -> None:
        """One batched decoder call of `kind` for `members` over the pool's rows up to the last of them (the rows
        must be contiguous). A row not in it computes a row of zeros one past its length (it never reads it: the
        next position it writes is its length), so its own call this step, before or after, stands."""
        cfg = self.model.config
        n = max(r.index for r in members) + 1
        in_call = set(members)
        h = np.zeros((n, cfg.hidden), np.float32)
        for r in members:
            assert r.handed_h is not None
            h[r.index] = r.handed_h[0]
        positions = np.array([r.kv.length + (0 if r in in_call else 1) for r in rows[:n]], np.int64)
        keys, values = [k[:n] for k in self._keys], [v[:n] for v in self._values]
        rope = self.model.rope
        if kind[0] == "dense":
            logits = self.decoder.run(h, positions, keys, values, rope)
            for r in members:
                r.result = logits[r.index:r.index + 1]
        else:
            if kind[0] == "walked":
                passes = self.decoder.run_walked(h, positions, keys, values, rope, kind[1])
                last = [passes[r.index].outputs[-1] for r in members]
            elif kind[0] == "mixed":
                kinds = ["walked"] * n        # what each row's pass is handed back as (the rows not in it: unread)
                for r in members:
                    assert r.handed_kind is not None
                    kinds[r.index] = r.handed_kind[0]
                served = self._layer_major(n, members, "handed_served", cfg.hidden, np.float32)
                selections = self._layer_major(n, members, "handed_selections", cfg.intermediate, bool)
                passes = self.decoder.run_mixed(h, positions, keys, values, rope, kind[1], kinds, served, selections)
                last = [r.handed_served[-1] if r.handed_served is not None else passes[r.index].outputs[-1]
                        for r in members]
            else:
                served = self._layer_major(n, members, "handed_served", cfg.hidden, np.float32)
                if kind[0] == "served":        # replayed rows among them take the served decoder's inputs
                    selections = self._layer_major(n, members, "handed_selections", cfg.intermediate, bool)
                    replayed = [False] * n
                    for r in members:
                        replayed[r.index] = r.handed_kind == ("replay",)
                    passes = self.decoder.run_served(h, positions, keys, values, rope, served, selections, replayed)
                else:
                    passes = self.decoder.run_replay(h, positions, keys, values, rope, served)
                last = [served[(cfg.n_layers - 1) * n + r.index] for r in members]
            # The head once for the group, on what the single path's head reads: each row's last residual and
            # last FFN output (computed, or served).
            head = self.model.graphs.run_head(np.stack([passes[r.index].residuals[-1] for r in members]),
                                              np.stack(last))
            for j, r in enumerate(members):
                r.result = dataclasses.replace(passes[r.index], logits=head[j:j + 1])
        with self._handed:
            self._steps += 1
            self._row_steps += len(members)
            member_kinds = [r.handed_kind[0] for r in members if r.handed_kind is not None]
            for name in set(member_kinds):
                counts = self._by_kind.setdefault(name, {"steps": 0, "row_steps": 0})
                counts["steps"] += 1
                counts["row_steps"] += member_kinds.count(name)
            self._mixed += int(len(set(member_kinds)) > 1)

    def _layer_major(self, n: int, members: list[BatchRow], name: str, width: int, dtype) -> np.ndarray:
        """The members' handed-in per-layer rows (n_layers, width) as one (n_layers * n, width) array, row b of
        layer i at i * n + b (zeros for the rows not in the call)."""
        out = np.zeros((self.model.config.n_layers, n, width), dtype)
        for r in members:
            array = getattr(r, name)
            if array is not None:
                out[:, r.index] = array
        return out.reshape(-1, width)

    def load_session(self, walk: bool) -> None:
        """Make the batched graphs' sessions now (the walk's with `walk`), not at the first batched step."""
        self.decoder.load_session(walk)

    def stats(self) -> BatchStats:
        with self._handed:
            return BatchStats(self.max_rows, len(self._rows), self._capacity, self._joined, self._left,
                              self._steps, self._row_steps, self._solo,
                              {kind: dict(counts) for kind, counts in self._by_kind.items()}, self._mixed)

    def close(self) -> None:
        self._threads.shutdown(wait=False)
