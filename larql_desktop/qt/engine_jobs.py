"""The patch editor's and cache monitor's work on a LarqlEngine, as plain functions returning snapshots.

The worker calls these in the engine thread and emits what they return; keeping them free of Qt lets them
be read and tested on their own.
"""
from __future__ import annotations

import time
from dataclasses import replace

from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.patches.insert import Fact, Progress
from larql_desktop.engine.cache.l3 import L3Settings
from larql_desktop.engine.patches.overlay import PatchOverlay
from larql_desktop.engine.model.chat import ChatSession
from larql_desktop.qt.protocol import (CacheSettings, CacheStatsEvent, InsertFact, InsertFinished, LoadPatchFile, PatchesChanged,
                       PatchInfo, PatchSaved, ProbePrompt, ProbeResult, RemovePatch, SavePatch)

PROBE_TOKENS = 8


def engine_settings(engine: LarqlEngine) -> CacheSettings:
    l3 = engine.l3.settings if engine.l3 is not None else replace(L3Settings(), enabled=False)
    return CacheSettings(engine.walk_settings, engine.l1_settings, engine.l2.settings, l3)


def stats_event(engine: LarqlEngine, engine_id: int, session_id: int | None,
                session: ChatSession | None) -> CacheStatsEvent:
    return CacheStatsEvent(engine_id, time.monotonic(), session_id, engine.snapshot(),
                           engine.session_snapshot(session) if session is not None else None,
                           tuple(engine.patches.overridden_layers), engine_settings(engine),
                           engine.model.config.n_layers, engine.l3.status() if engine.l3 is not None else None)


def patches_changed(engine: LarqlEngine, request_id: int) -> PatchesChanged:
    infos = tuple(PatchInfo(p.description, p.name, tuple(p.layers), tuple(p.features))
                  for p in engine.applied_patches)
    return PatchesChanged(request_id, infos, tuple(engine.patches.overridden_layers))


def probe(engine: LarqlEngine, request: ProbePrompt) -> ProbeResult:
    """Greedy continuation and target probability without patches and with the applied ones."""
    if not request.prompt.strip():
        raise ValueError("the probe prompt is empty")
    inserter = engine.inserter()
    token = inserter.target_token(request.target) if request.target.strip() else None
    results = []
    for overlay in (PatchOverlay(), engine.patches):
        text, _ = inserter.continuation(request.prompt, overlay, PROBE_TOKENS)
        p = inserter.probability(request.prompt, token, overlay) if token is not None else None
        results.append((text, p))
    (base_text, base_p), (patched_text, patched_p) = results
    return ProbeResult(request.request_id, request.prompt, request.target, base_text, patched_text, base_p, patched_p)


def insert_fact(engine: LarqlEngine, request: InsertFact, progress: Progress) -> InsertFinished:
    fact = Fact(request.entity, request.relation, request.target)   # refuses empty fields
    result = engine.insert(fact, layer=request.layer, alpha=request.alpha, progress=progress)
    return InsertFinished(request.request_id, result.layer, result.feature, result.probability,
                          result.patch.description)


def load_patch_file(engine: LarqlEngine, request: LoadPatchFile) -> PatchesChanged:
    engine.apply_patch(engine.read_patch(request.path))   # PatchError names the problem; nothing is applied
    return patches_changed(engine, request.request_id)


def remove_patch(engine: LarqlEngine, request: RemovePatch) -> PatchesChanged:
    engine.remove_patch(request.index)
    return patches_changed(engine, request.request_id)


def save_patch(engine: LarqlEngine, request: SavePatch) -> PatchSaved:
    patches = engine.applied_patches
    if not 0 <= request.index < len(patches):
        raise ValueError(f"no applied patch number {request.index}")
    patches[request.index].save(request.path)
    return PatchSaved(request.request_id, request.path)
