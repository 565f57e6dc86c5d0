"""Patch changes from several front-ends at once: the HTTP API and direct engine calls (what the Qt worker makes),
in many threads. Nothing may be lost or duplicated, and every change is announced once to subscribers."""
from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from larql_desktop.api.server import start_server
from larql_desktop.engine.core import LarqlEngine, PatchesChanged
from larql_desktop.engine.model.overlay import Patch, PatchOperation, PatchOverlay

THREADS_PER_FRONT_END = 3
PATCHES_PER_THREAD = 4


def _patch(model, worker: int, n: int) -> Patch:
    """A small update patch on a feature no other patch touches, so every patch has its own id and effect."""
    cfg = model.config
    layer = (worker * 7 + n) % cfg.n_layers
    feature = 100 + worker * PATCHES_PER_THREAD + n
    down = np.random.default_rng(worker * 100 + n).standard_normal(cfg.hidden).astype(np.float32) * 0.01
    op = PatchOperation("update", layer, feature, down=down)
    return Patch((op,), model.name, model.checksum, description=f"worker {worker} patch {n}")


@pytest.fixture
def served_engine(smollm2):
    engine = LarqlEngine(smollm2)
    handle = start_server(engine, "127.0.0.1", 0)
    try:
        yield engine, handle
    finally:
        handle.stop()


def test_concurrent_applies_and_removes_from_the_api_and_the_engine_equal_a_serial_replay(served_engine, smollm2):
    engine, handle = served_engine
    events: list[PatchesChanged] = []
    engine.subscribe(lambda e: events.append(e) if isinstance(e, PatchesChanged) else None)
    kept: dict[int, list[str]] = {}          # worker -> ids it applied and did not remove
    errors: list[BaseException] = []
    start = threading.Barrier(2 * THREADS_PER_FRONT_END)

    def by_api(worker: int) -> None:
        mine = []
        with httpx.Client(base_url=handle.url, timeout=120) as http:
            start.wait()
            for n in range(PATCHES_PER_THREAD):
                patch = _patch(smollm2, worker, n)
                r = http.post("/v1/patches", json=patch.to_json())
                assert r.status_code == 201, r.text
                assert patch.id in {p["id"] for p in r.json()["patches"]}   # the id is the content's, here and there
                mine.append(patch.id)
            # Remove every other one of its own, by id, while the others keep changing the list.
            for patch_id in mine[::2]:
                assert http.delete(f"/v1/patches/{patch_id}").status_code == 200
        kept[worker] = mine[1::2]

    def by_engine(worker: int) -> None:
        mine = []
        start.wait()
        for n in range(PATCHES_PER_THREAD):
            patch = _patch(smollm2, worker, n)
            engine.apply_patch(patch, origin=("window", worker))
            mine.append(patch.id)
        for patch_id in mine[::2]:
            engine.remove_patch(patch_id, origin=("window", worker))
        kept[worker] = mine[1::2]

    def guarded(fn, worker):
        try:
            fn(worker)
        except BaseException as exc:   # noqa: BLE001 - reported below with the others
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(by_api, w)) for w in range(THREADS_PER_FRONT_END)]
    threads += [threading.Thread(target=guarded, args=(by_engine, THREADS_PER_FRONT_END + w))
                for w in range(THREADS_PER_FRONT_END)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    expected = {patch_id for ids in kept.values() for patch_id in ids}
    final = engine.applied_patches
    assert [p.id for p in final] and len({p.id for p in final}) == len(final)     # nothing duplicated
    assert {p.id for p in final} == expected                                     # nothing lost or resurrected
    # The installed overlay is exactly the serial replay of the surviving patches.
    replay = PatchOverlay.build(final, engine.base_weights)
    assert engine.patches.epoch == replay.epoch
    assert engine.patches.overridden_layers == replay.overridden_layers
    # Every successful change was announced once, with a version of its own; the newest event shows the final list.
    operations = 2 * THREADS_PER_FRONT_END * (PATCHES_PER_THREAD + PATCHES_PER_THREAD // 2)
    assert len(events) == operations and len({e.version for e in events}) == operations
    newest = max(events, key=lambda e: e.version)
    assert {s.id for s in newest.patches} == expected
    with httpx.Client(base_url=handle.url) as http:
        assert {p["id"] for p in http.get("/v1/patches").json()["patches"]} == expected


def test_a_client_cannot_remove_another_clients_patch_by_position(served_engine, smollm2):
    engine, handle = served_engine
    mine, theirs = _patch(smollm2, 0, 0), _patch(smollm2, 1, 0)
    engine.apply_patch(theirs)
    with httpx.Client(base_url=handle.url) as http:
        assert http.post("/v1/patches", json=mine.to_json()).status_code == 201
        assert http.delete("/v1/patches/0").status_code == 404        # positions name nothing
        assert http.delete(f"/v1/patches/{mine.id}").status_code == 200
        assert http.delete(f"/v1/patches/{mine.id}").status_code == 404   # gone already: nothing else removed
    assert [p.id for p in engine.applied_patches] == [theirs.id]
