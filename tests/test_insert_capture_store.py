"""INSERT's capture store: the negatives' captures and the base model's continuations kept on disk (real SQLite),
so an insert after a restart does not run them again, and gives the very patch it gave when it ran them."""
from __future__ import annotations

import sqlite3

import numpy as np

from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.overlay import PatchOverlay
from larql_desktop.engine.patches.insert import Fact
from larql_desktop.engine.patches.insert.capture import Cancel
from larql_desktop.engine.patches.insert.capture_store import CaptureStore, StoredCapture


def a_capture(tokens: int, layers: int = 6, from_layer: int = 3, seed: int = 0) -> StoredCapture:
    rng = np.random.default_rng(seed)
    inputs = [None if i < from_layer else rng.standard_normal((tokens, 8)).astype(np.float16) for i in range(layers)]
    return StoredCapture(from_layer, inputs, (4, rng.standard_normal((tokens, 8)).astype(np.float32)))


def same_capture(a: StoredCapture, b: StoredCapture) -> bool:
    return (a.from_layer == b.from_layer and len(a.inputs) == len(b.inputs)
            and all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                                   and np.array_equal(x, y)) for x, y in zip(a.inputs, b.inputs))
            and a.residual is not None and b.residual is not None and a.residual[0] == b.residual[0]
            and np.array_equal(a.residual[1], b.residual[1]))


def test_captures_and_continuations_come_back_as_stored_and_only_for_their_namespace_and_ids(tmp_path):
    path = tmp_path / "captures.sqlite3"
    store = CaptureStore(path)
    stored = a_capture(5)
    store.put("model-a", (1, 2, 3, 4, 5), stored)
    store.put_tokens("model-a", "continued\x0010\x00'x'", (1, 2, 3), [7, 8, 9])
    store.close()
    again = CaptureStore(path)         # a later launch
    found = again.get("model-a", (1, 2, 3, 4, 5))
    assert found is not None and same_capture(found, stored)
    assert found.inputs[0] is None and found.inputs[3].dtype == np.float16 and found.residual[1].dtype == np.float32
    assert again.get_tokens("model-a", "continued\x0010\x00'x'", (1, 2, 3)) == [7, 8, 9]
    # Another namespace (other weights, graphs or settings), other ids, another kind of continuation: nothing.
    assert again.get("model-b", (1, 2, 3, 4, 5)) is None
    assert again.get("model-a", (1, 2, 3, 4, 6)) is None
    assert again.get_tokens("model-a", "own_answers\x0010\x00'x'", (1, 2, 3)) is None
    assert (again.hits, again.misses) == (2, 3)


def test_the_byte_bound_drops_the_least_recently_used_first(tmp_path):
    def ids(i: int) -> tuple[int, ...]:
        return tuple(range(i, i + 40))
    probe = CaptureStore(tmp_path / "probe.sqlite3")
    probe.put("m", ids(0), a_capture(40))
    one = probe.stored_bytes()
    store = CaptureStore(tmp_path / "captures.sqlite3", max_bytes=int(3.5 * one))
    for i in range(3):
        store.put("m", ids(i), a_capture(40, seed=i))
    assert store.get("m", ids(0)) is not None        # read: now the most recently used
    store.put("m", ids(3), a_capture(40, seed=3))    # one too many: ids(1) was used least recently
    assert store.stored_bytes() <= store.max_bytes
    assert store.get("m", ids(1)) is None
    assert all(store.get("m", ids(i)) is not None for i in (0, 2, 3))
    assert store.dropped == 1


def test_a_damaged_value_is_dropped_and_a_store_that_cannot_open_never_fails_an_insert(tmp_path):
    path = tmp_path / "captures.sqlite3"
    store = CaptureStore(path)
    store.put("m", (1, 2), a_capture(2))
    with sqlite3.connect(path) as db:
        db.execute("UPDATE captures SET value = substr(value, 1, 100)")
    assert store.get("m", (1, 2)) is None            # unreadable: a miss, and gone
    assert store.stored_bytes() == 0
    # A directory where the file should be: the store is off, reads find nothing and writes do nothing.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    off = CaptureStore(blocked)
    assert not off.enabled
    off.put("m", (1,), a_capture(1))
    assert off.get("m", (1,)) is None and off.stats()["bytes"] == 0
    assert not CaptureStore(tmp_path / "zero.sqlite3", max_bytes=0).enabled


def test_the_namespace_names_the_graphs_and_the_ffn_settings(smollm2, tmp_path):
    store = CaptureStore(tmp_path / "captures.sqlite3")
    dense = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=store).inserter()
    walk = LarqlEngine(smollm2, walk=WalkSettings(), capture_store=store).inserter()
    names = dense.capture_namespace(), walk.capture_namespace()
    assert names[0] is not None and names[1] is not None and names[0] != names[1]
    assert smollm2.checksum in names[0]
    assert smollm2.ffn.numerics in names[0] and smollm2.transformer.graphs.numerics in names[0]
    # Without a store nothing is kept on disk.
    assert LarqlEngine(smollm2, walk=WalkSettings(dense=True)).inserter().capture_namespace() is None


def test_negatives_captured_by_one_engine_are_read_bit_for_bit_by_the_next_without_a_pass(smollm2, tmp_path,
                                                                                       monkeypatch):
    path = tmp_path / "captures.sqlite3"
    fact = Fact("Brenmoor", "capital-of", "Kaskel")
    first = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=CaptureStore(path)).inserter()
    first.prefetch_greedy(lambda: first.negative_contexts(fact, PatchOverlay()), Cancel(None))
    negatives = first.negative_contexts(fact, PatchOverlay())
    low = smollm2.config.n_layers // 2
    captured = {ids: first.base_inputs(ids, low) for ids in negatives}

    later = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=CaptureStore(path)).inserter()

    def no_pass(*args, **kwargs):
        raise AssertionError("a stored capture was run again")
    monkeypatch.setattr(later, "capture", no_pass)
    monkeypatch.setattr(later, "greedy_many", no_pass)
    assert later.negative_contexts(fact, PatchOverlay()) == negatives     # from the stored continuations
    for ids, inputs in captured.items():
        again = later.base_inputs(ids, low)
        assert all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                                 and np.array_equal(x, y)) for x, y in zip(inputs, again))
    assert later.capture_store is not None and later.capture_store.misses == 0


def test_an_insert_after_a_restart_reads_its_passes_from_the_store_and_gives_the_same_patch(smollm2, tmp_path):
    path = tmp_path / "captures.sqlite3"
    fact = Fact("Torheim", "capital-of", "Ulvard")
    cold_store = CaptureStore(path)
    cold = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=cold_store).insert(fact)
    assert cold_store.hits == 0 and cold_store.writes > 40
    cold_store.close()
    warm_store = CaptureStore(path)        # a new engine, as after a restart: nothing remembered in memory
    warm = LarqlEngine(smollm2, walk=WalkSettings(dense=True), capture_store=warm_store).insert(fact)
    assert warm_store.misses == 0 and warm_store.hits > 40
    assert warm.patch.id == cold.patch.id         # the patch's content hash: every weight bit for bit
    assert warm.answers and cold.answers
