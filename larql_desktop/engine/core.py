"""The engine one process runs: a loaded model, its shared L2 cache and statistics, the chat sessions, and the one
place where patches and settings change.

Every change (apply, remove, insert, configure, clear, reset) runs under the engine's own lock, whichever
front-end calls it, and publishes a change event to subscribers afterwards. Front-ends never read-modify-write
engine state themselves, so two of them changing patches at once cannot lose an update.
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from larql_desktop.engine.cache.l3 import L3Settings, L3Store
from larql_desktop.engine.cache.stats import CacheStats, StatsSnapshot
from larql_desktop.engine.cache.tiers import CacheTier, PersistentTierView, TierSettings
from larql_desktop.engine.cache.trace import KeyTrace
from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.heap import return_freed_memory
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.session import PREFILL_CHUNK, ChatSession
from larql_desktop.engine.patches.summary import PatchSummary, patch_summaries
from larql_desktop.engine.model.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefillSchedule, PrefixCache
from larql_desktop.engine.patches.insert import Fact, Inserter, InsertResult, Progress
from larql_desktop.engine.patches.insert.capture_store import CaptureStore
from larql_desktop.engine.model.overlay import (BaseFeatureWeights, Patch, PatchError, PatchOverlay, load_patches,
                                                parse_patch, parse_patches, save_patch_set)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSettings:
    """Everything a cache monitor controls: the walk FFN, the in-memory tiers (each validated by the engine)
    and the persistent L3 (applied only when the engine has an L3 store: without one it stays off)."""
    walk: WalkSettings = WalkSettings()
    l1: TierSettings = TierSettings()
    l2: TierSettings = TierSettings()
    l3: L3Settings = L3Settings()


# --- change events (published after the change, in the thread that made it) ------------------------------
@dataclass(frozen=True)
class PatchesChanged:
    version: int                         # increases with every change of this engine: drop older ones
    patches: tuple[PatchSummary, ...]
    overridden_layers: tuple[int, ...]
    epoch: str
    origin: object = None                # what the caller passed as `origin` (e.g. a request id), for its answer


@dataclass(frozen=True)
class SettingsChanged:
    version: int
    settings: CacheSettings
    origin: object = None


@dataclass(frozen=True)
class StatsAdvanced:
    """Statistics moved (caches cleared, statistics reset, or a client's request ran): take a snapshot if you show them."""
    version: int
    origin: object = None


EngineEvent = PatchesChanged | SettingsChanged | StatsAdvanced


class UnknownPatch(PatchError):
    """No applied patch has the given id (it may have been removed by another client): nothing changed."""


class PatchAlreadyApplied(PatchError):
    """A patch with the same content (the same id) is applied already: nothing changed."""


class LarqlEngine:
    """Owns the process-wide L2 tier; each session gets its own L1 tier and stats, and all share L2.

    An optional persistent L3 store (engine/cache/l3/) is consulted after L2 by every session and by the HTTP
    API; the engine only uses it when given one (the app and `serve` open the default SQLite store in the user
    cache dir), so library users and tests never write outside the directories they choose.

    Settings and the patch overlay are immutable values swapped under the lock; a swap rebinds every session's
    walk FFN (caches are kept: keys carry K and key width, and only feature sets no patch touches are ever looked
    up, so entries made under other settings or patches are never served).
    """

    def __init__(self, model: LoadedModel, walk: WalkSettings = WalkSettings(),
                 l1: TierSettings = TierSettings(), l2: TierSettings = TierSettings(), patches=None,
                 l3: L3Store | None = None, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 prefill_chunk: int = PREFILL_CHUNK, capture_store: CaptureStore | None = None):
        self.model = model
        n = model.config.n_layers
        walk.resolved(model.config.intermediate)      # refuse impossible settings up front
        self.walk_settings = walk
        self.l1_settings = l1
        self.l2 = CacheTier("L2", n, l2)
        self.trace = KeyTrace()                       # which key followed which: whole steps of hits in one call
        self.stats = CacheStats(n)                    # process-wide: every session records here too
        self.patches = patches if patches is not None else PatchOverlay()
        self.l3 = l3
        self.base_weights = BaseFeatureWeights(model.gguf)
        self.sessions: list[ChatSession] = []
        # Prompts' KV shared by every session (API requests and chats); see engine/model/prefix_cache.py.
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # Where prompts are cut into passes (a server interleaves other requests' steps between them).
        self.prefill_schedule = PrefillSchedule.for_template(prefill_chunk, model.template_head, model.template_cue)
        self._lock = threading.RLock()
        self._versions = itertools.count(1)
        self._subscribers: list[Callable[[EngineEvent], None]] = []
        self._inserter: Inserter | None = None
        self.capture_store = capture_store            # INSERT's negatives' captures on disk, between launches
        self._insert_lock = threading.Lock()

    # -- change events -------------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[EngineEvent], None]) -> Callable[[], None]:
        """Call `callback(event)` after every change, from the thread that made it; returns an unsubscribe.
        Callbacks must be quick and thread-safe (e.g. emit a Qt signal); an exception in one is logged."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)
        return unsubscribe

    def _publish(self, event: EngineEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:   # noqa: BLE001 - one broken subscriber must not undo a change or starve the rest
                log.exception("an engine event subscriber failed")

    def _patches_event(self, origin) -> PatchesChanged:
        overlay = self.patches
        return PatchesChanged(next(self._versions), patch_summaries(overlay), tuple(overlay.overridden_layers),
                              overlay.epoch, origin)

    def note_activity(self, origin=None) -> None:
        """A client's request moved the statistics (the HTTP API calls this after each request it runs)."""
        self._publish(StatsAdvanced(next(self._versions), origin))

    # -- walks and sessions --------------------------------------------------------------------------------
    def _walk_for(self, l1: CacheTier, stats: CacheStats) -> WalkFfn:
        return WalkFfn(self.model.ffn, self.walk_settings, model_checksum=self.model.checksum, l1=l1, l2=self.l2,
                       l3=self.l3, observers=(stats, self.stats), patches=self.patches, trace=self.trace)

    def request_walk(self, top_k: int | None = None) -> WalkFfn:
        """A walk FFN for one API request: no L1, the shared L2 (and L3), this engine's patches and stats,
        and the request's K (None: the engine's). Thread-safe to use alongside the sessions."""
        # Never the seed's feature-set hits for a request: an untrusted client would choose what others are served.
        walk = replace(self.walk_settings, dense=False, feature_set_hits=False)
        if top_k is not None:
            width = walk.key_width if walk.key_width is not None and walk.key_width <= top_k else None
            walk = replace(walk, top_k=top_k, key_width=width)
        return WalkFfn(self.model.ffn, walk, model_checksum=self.model.checksum, l2=self.l2, l3=self.l3,
                       observers=(self.stats,), patches=self.patches, trace=self.trace)

    @property
    def prefill_chunk(self) -> int:
        """Positions per prefill pass (the schedule's chunk size)."""
        return self.prefill_schedule.size

    def kv_namespace(self, ffn) -> tuple | None:
        """What the KV of a prompt run through `ffn` depends on besides its tokens (the prefix cache's namespace):
        the model, the FFN graphs' numerics, the walk settings, the INSERT patches' epoch, which cache tiers are on
        (with every tier off a walk layer runs in another graph) and the prefill schedule (the passes' shapes). None
        for an FFN this engine did not make."""
        if not isinstance(ffn, WalkFfn):
            return None
        return (self.model.checksum, ffn.graphs.numerics, ffn.settings, ffn.patches.epoch,
                tuple(sorted(self._enabled().items())), self.prefill_schedule)

    def new_session(self) -> ChatSession:
        n = self.model.config.n_layers
        l1, stats = CacheTier("L1", n, self.l1_settings), CacheStats(n)
        with self._lock:
            session = ChatSession(self.model, self._walk_for(l1, stats), l1=l1, stats=stats,
                                  prefix_cache=self.prefix_cache, kv_namespace=self.kv_namespace,
                                  prefill=self.prefill_schedule)
            self.sessions.append(session)
        return session

    def close_session(self, session: ChatSession) -> None:
        with self._lock:
            if session in self.sessions:
                self.sessions.remove(session)

    # -- settings ------------------------------------------------------------------------------------------
    @property
    def settings(self) -> CacheSettings:
        l3 = self.l3.settings if self.l3 is not None else replace(L3Settings(), enabled=False)
        return CacheSettings(self.walk_settings, self.l1_settings, self.l2.settings, l3)

    def configure(self, walk: WalkSettings | None = None, l1: TierSettings | None = None,
                  l2: TierSettings | None = None, l3: L3Settings | None = None, origin=None) -> SettingsChanged:
        """Change settings atomically: every value is checked before any is applied (ValueError: nothing changed)."""
        if walk is not None:
            walk.resolved(self.model.config.intermediate)
        with self._lock:
            if l3 is not None and l3.enabled and self.l3 is None:
                raise ValueError("no L3 store is attached to the engine (attach_l3 first)")
            if l3 is not None and self.l3 is not None:
                self.l3.configure(l3)
            if walk is not None:
                self.walk_settings = walk
            if l1 is not None:
                self.l1_settings = l1
                for s in self.sessions:
                    s.l1.configure(l1)
            if l2 is not None:
                self.l2.configure(l2)
            self._rebind()
            event = SettingsChanged(next(self._versions), self.settings, origin)
        self._publish(event)
        return event

    def attach_l3(self, store: L3Store | None) -> None:
        """Use `store` as the persistent tier (None: no L3). The previous store is not closed."""
        with self._lock:
            self.l3 = store
            self._rebind()
            event = SettingsChanged(next(self._versions), self.settings)
        self._publish(event)

    # -- INSERT patches ------------------------------------------------------------------------------------
    @property
    def applied_patches(self) -> tuple[Patch, ...]:
        return self.patches.patches

    def patch_summaries(self) -> tuple[PatchSummary, ...]:
        return patch_summaries(self.patches)

    def find_patch(self, patch_id: str) -> Patch:
        for patch in self.applied_patches:
            if patch.id == patch_id:
                return patch
        raise UnknownPatch(f"no applied patch has the id {patch_id!r}")

    def _model_shape(self) -> dict:
        cfg = self.model.config
        return dict(n_layers=cfg.n_layers, intermediate=cfg.intermediate, hidden=cfg.hidden,
                    checksum=self.model.checksum, vocab=cfg.vocab_size)

    def read_patch(self, path) -> Patch:
        """Load and validate a file of one patch for this model (PatchError names the problem; a set of several
        is read_patches')."""
        patches = self.read_patches(path)
        if len(patches) != 1:
            raise PatchError(f"{path}: a patch set of {len(patches)} patches, not one patch")
        return patches[0]

    def read_patches(self, path) -> tuple[Patch, ...]:
        """The patches of a patch file or a patch set file, every one validated for this model (PatchError names
        the first problem; then none is returned)."""
        return load_patches(path, **self._model_shape())

    def validate_patch(self, doc: dict, source: str = "patch") -> Patch:
        return parse_patch(doc, source=source, **self._model_shape())

    def validate_patches(self, doc: dict, source: str = "patch") -> tuple[Patch, ...]:
        """validate_patch of a patch document or of each patch of a patch set document."""
        return parse_patches(doc, source=source, **self._model_shape())

    def save_patches(self, path, patch_ids: Sequence[str] | None = None) -> int:
        """Write the applied patches with these ids (all of them by default), in their order, to one patch set
        file; returns how many. UnknownPatch if an id is not applied (nothing is written)."""
        applied = self.applied_patches
        chosen = applied if patch_ids is None else tuple(self.find_patch(i) for i in patch_ids)
        if not chosen:
            raise PatchError("no patch to save")      # a set holds at least one (parse_patches refuses none)
        save_patch_set(chosen, path)
        return len(chosen)

    def _swap_patches(self, change: Callable[[tuple[Patch, ...]], tuple[Patch, ...]], origin) -> PatchesChanged:
        """Read the applied patches, build the new overlay and install it in one critical section: a change made
        meanwhile by another front-end is never overwritten."""
        with self._lock:
            patches = change(self.applied_patches)
            self.patches = PatchOverlay.build(patches, self.base_weights)
            self._rebind()
            event = self._patches_event(origin)
        self._publish(event)
        return event

    def apply_patch(self, patch: Patch, origin=None) -> PatchesChanged:
        return self.apply_patches((patch,), origin)

    def apply_patches(self, new: Sequence[Patch], origin=None) -> PatchesChanged:
        """Apply these patches after the applied ones, in one change: if any is for another model or already
        applied, none is (PatchError / PatchAlreadyApplied)."""
        new = tuple(new)
        if not new:
            raise PatchError("no patch to apply")
        for patch in new:
            if patch.base_checksum != self.model.checksum:
                raise PatchError(f"the patch {patch.name or patch.id} was made for another model")

        def add(patches):
            ids = {p.id for p in patches}
            for patch in new:
                if patch.id in ids:
                    raise PatchAlreadyApplied(f"this patch ({patch.name + ', ' if patch.name else ''}id {patch.id}) "
                                              "is already applied")
                ids.add(patch.id)
            return patches + new
        return self._swap_patches(add, origin)

    def remove_patch(self, patch_id: str, origin=None) -> PatchesChanged:
        """Remove the applied patch with this id (UnknownPatch if none has it: nothing changes)."""
        def drop(patches):
            kept = tuple(p for p in patches if p.id != patch_id)
            if len(kept) == len(patches):
                raise UnknownPatch(f"no applied patch has the id {patch_id!r}")
            return kept
        return self._swap_patches(drop, origin)

    def inserter(self) -> Inserter:
        """INSERT runs with the engine's FFN mode (walk or dense), without caches. One Inserter per mode is
        kept: it remembers the contexts it has captured, which later inserts share."""
        w = self.walk_settings
        settings = WalkSettings(top_k=w.top_k, dense=w.dense)
        with self._lock:
            if self._inserter is None or self._inserter.walk != settings:
                self._inserter = Inserter(self.model, self.base_weights, settings, self.capture_store)
            return self._inserter

    def insert(self, fact: Fact, layer: int | None = None, alpha: float = 0.1,
               progress: Progress | None = None, paraphrases: Sequence[str] = (), cancel=None,
               origin=None) -> InsertResult:
        """INSERT `fact` and apply it. `paraphrases`: phrasings of the question to key on besides the generated
        ones; `cancel`: a threading.Event checked between steps (InsertCancelled is raised, nothing is applied).

        The patch is computed against the current overlay outside the engine lock (it takes seconds; inserts
        run one at a time, since the inserter's captured contexts are shared), then applied atomically on top of
        whatever is applied by then."""
        with self._insert_lock:
            try:
                result = self.inserter().insert(fact, self.patches, layer=layer, alpha=alpha, progress=progress,
                                                paraphrases=paraphrases, cancel=cancel)
            finally:        # the passes' arrays are gone; their heap space would stay with the process
                return_freed_memory()
        self.apply_patch(result.patch, origin=origin)
        return result

    def _rebind(self) -> None:
        for s in self.sessions:
            s.ffn = self._walk_for(s.l1, s.stats)

    # -- caches and statistics -----------------------------------------------------------------------------
    def clear_caches(self, persistent: bool = False, origin=None) -> None:
        """Empty L2, every L1 and the KV prefix cache; with `persistent`, the L3 store too."""
        with self._lock:
            self.l2.clear()
            self.prefix_cache.clear()
            self.trace.clear()
            for s in self.sessions:
                s.l1.clear()
            if persistent and self.l3 is not None:
                self.l3.clear()
        self.note_activity(origin)

    def reset_stats(self, origin=None) -> None:
        with self._lock:
            self.stats.reset()
            for s in self.sessions:
                s.stats.reset()
        self.note_activity(origin)

    def snapshot(self) -> StatsSnapshot:
        """Process-wide statistics: L1 summed over sessions, the shared L2, all bypasses and latencies."""
        with self._lock:
            l1_tiers = [s.l1 for s in self.sessions]
        return self.stats.snapshot({"L1": l1_tiers, "L2": [self.l2], "L3": self._l3_tiers()}, self._enabled())

    def session_snapshot(self, session: ChatSession) -> StatsSnapshot:
        return session.stats.snapshot({"L1": [session.l1], "L2": [self.l2], "L3": self._l3_tiers()},
                                      self._enabled())

    def _l3_tiers(self) -> list:
        store = self.l3
        return [PersistentTierView(store, self.model.config.n_layers)] if store is not None else []

    def _enabled(self) -> dict[str, bool]:
        return {"L1": self.l1_settings.enabled, "L2": self.l2.settings.enabled,
                "L3": self.l3 is not None and self.l3.settings.enabled}
