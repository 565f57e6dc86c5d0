"""The window's requests answered on a LarqlEngine, as plain functions returning the protocol's snapshots.

The worker calls these in the engine thread and emits what they return. The questions themselves are answered by
the engine and its services (shared with the HTTP API and the command line); these functions only translate.
"""
from __future__ import annotations

import time

from larql_desktop.engine import services
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.core import PatchesChanged
from larql_desktop.engine.session import ChatSession
from larql_desktop.engine.patches.insert import Fact, Progress
from larql_desktop.qt.protocol import (CacheStatsEvent, FactProbed, InsertFact, InsertFinished, PatchesShown,
                                       PatchSaved, ProbeAnswered, ProbeFact, ProbePrompt, SavePatch,
                                       SavePatchSet)


def stats_event(engine: LarqlEngine, engine_id: int, session_id: int | None,
                session: ChatSession | None) -> CacheStatsEvent:
    return CacheStatsEvent(engine_id, time.monotonic(), session_id, engine.snapshot(),
                           engine.session_snapshot(session) if session is not None else None,
                           tuple(engine.patches.overridden_layers), engine.settings,
                           engine.model.config.n_layers, engine.l3.status() if engine.l3 is not None else None,
                           engine.prefix_cache.stats())


def patches_changed(event: PatchesChanged) -> PatchesShown:
    """The engine's change event as the window's answer: to the request that made it, or 0 for other clients."""
    request_id = event.origin[1] if isinstance(event.origin, tuple) and event.origin[:1] == ("window",) else 0
    return PatchesShown(request_id, event)


def current_patches(engine: LarqlEngine, request_id: int) -> PatchesShown:
    """The applied patches as they are (version 0: any change announced later replaces it)."""
    overlay = engine.patches
    return PatchesShown(request_id, PatchesChanged(0, services.patch_summaries(overlay),
                                                         tuple(overlay.overridden_layers), overlay.epoch,
                                                         ("window", request_id)))


def probe(engine: LarqlEngine, request: ProbePrompt) -> ProbeAnswered:
    return ProbeAnswered(request.request_id, services.probe(engine, request.prompt, request.target))


def fact_probes(engine: LarqlEngine, request: ProbeFact) -> FactProbed:
    fact = Fact(request.entity, request.relation, request.target)   # refuses empty fields
    return FactProbed(request.request_id, fact.entity, fact.relation, fact.target,
                      services.fact_probes(engine, fact, request.paraphrases))


def insert_fact(engine: LarqlEngine, request: InsertFact, progress: Progress) -> InsertFinished:
    fact = Fact(request.entity, request.relation, request.target)   # refuses empty fields
    result = engine.insert(fact, layer=request.layer, alpha=request.alpha, progress=progress,
                           paraphrases=request.paraphrases, cancel=request.cancel,
                           origin=("window", request.request_id))
    return InsertFinished(request.request_id, result.layer, result.feature, result.probability,
                          result.patch.description)


def save_patch(engine: LarqlEngine, request: SavePatch) -> PatchSaved:
    engine.find_patch(request.patch_id).save(request.path)
    return PatchSaved(request.request_id, request.path)


def save_patch_set(engine: LarqlEngine, request: SavePatchSet) -> PatchSaved:
    return PatchSaved(request.request_id, request.path, engine.save_patches(request.path))
