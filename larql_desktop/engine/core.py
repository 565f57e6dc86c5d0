"""The engine one process runs: a loaded model, its shared L2 cache and statistics, and the chat sessions."""
from __future__ import annotations

import threading
from typing import Sequence
from dataclasses import replace

from larql_desktop.engine.cache.walk import CacheStats, CacheTier, PersistentTierView, StatsSnapshot, TierSettings, WalkFfn, WalkSettings
from larql_desktop.engine.patches.insert import Fact, Inserter, InsertResult, Progress
from larql_desktop.engine.cache.l3 import L3Settings, L3Store
from larql_desktop.engine.patches.overlay import BaseFeatureWeights, Patch, PatchOverlay, load_patch_file, parse_patch
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.model.chat import ChatSession


class LarqlEngine:
    """Owns the process-wide L2 tier; each session gets its own L1 tier and stats, and all share L2.

    An optional persistent L3 store (engine/l3.py) is consulted after L2 by every session and by the HTTP API;
    the engine only uses it when given one (the app and `serve` open the default SQLite store in the user cache
    dir), so library users and tests never write outside the directories they choose.

    Settings are immutable values; changing them rebinds every session's walk FFN (caches are kept,
    their keys carry K, key width and patch epoch so entries made under other settings are never served).
    """

    def __init__(self, model: LoadedModel, walk: WalkSettings = WalkSettings(),
                 l1: TierSettings = TierSettings(), l2: TierSettings = TierSettings(), patches=None,
                 l3: L3Store | None = None):
        self.model = model
        n = model.config.n_layers
        walk.resolved(model.config.intermediate)      # refuse impossible settings up front
        self.walk_settings = walk
        self.l1_settings = l1
        self.l2 = CacheTier("L2", n, l2)
        self.stats = CacheStats(n)                    # process-wide: every session records here too
        self.patches = patches if patches is not None else PatchOverlay()
        self.l3 = l3
        self.base_weights = BaseFeatureWeights(model.gguf)
        self.sessions: list[ChatSession] = []
        self._lock = threading.Lock()

    def _walk_for(self, l1: CacheTier, stats: CacheStats) -> WalkFfn:
        return WalkFfn(self.model.ffn, self.model.config.intermediate, self.model.checksum, self.walk_settings,
                       l1, self.l2, (stats, self.stats), self.patches, l3=self.l3)

    def request_walk(self, top_k: int | None = None) -> WalkFfn:
        """A walk FFN for one API request: no L1, the shared L2 (and L3), this engine's patches and stats,
        and the request's K (None: the engine's). Thread-safe to use alongside the sessions."""
        walk = replace(self.walk_settings, dense=False)
        if top_k is not None:
            width = walk.key_width if walk.key_width is not None and walk.key_width <= top_k else None
            walk = replace(walk, top_k=top_k, key_width=width)
        return WalkFfn(self.model.ffn, self.model.config.intermediate, self.model.checksum, walk,
                       None, self.l2, (self.stats,), self.patches, l3=self.l3)

    def new_session(self) -> ChatSession:
        n = self.model.config.n_layers
        l1, stats = CacheTier("L1", n, self.l1_settings), CacheStats(n)
        session = ChatSession(self.model, self._walk_for(l1, stats), l1=l1, stats=stats)
        with self._lock:
            self.sessions.append(session)
        return session

    def close_session(self, session: ChatSession) -> None:
        with self._lock:
            if session in self.sessions:
                self.sessions.remove(session)

    def configure(self, walk: WalkSettings | None = None, l1: TierSettings | None = None,
                  l2: TierSettings | None = None, l3: L3Settings | None = None) -> None:
        if walk is not None:
            walk.resolved(self.model.config.intermediate)
        if l3 is not None and l3.enabled and self.l3 is None:
            raise ValueError("no L3 store is attached to the engine (attach_l3 first)")
        with self._lock:
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

    def attach_l3(self, store: L3Store | None) -> None:
        """Use `store` as the persistent tier (None: no L3). The previous store is not closed."""
        with self._lock:
            self.l3 = store
            self._rebind()

    def set_patches(self, patches: PatchOverlay) -> None:
        with self._lock:
            self.patches = patches
            self._rebind()

    # -- INSERT patches ------------------------------------------------------------------------------------
    @property
    def applied_patches(self) -> tuple[Patch, ...]:
        return self.patches.patches

    def _model_shape(self) -> dict:
        cfg = self.model.config
        return dict(n_layers=cfg.n_layers, intermediate=cfg.intermediate, hidden=cfg.hidden,
                    checksum=self.model.checksum, vocab=cfg.vocab_size)

    def read_patch(self, path) -> Patch:
        """Load and validate a patch file for this model (PatchError names the problem)."""
        return load_patch_file(path, **self._model_shape())

    def validate_patch(self, doc: dict, source: str = "patch") -> Patch:
        return parse_patch(doc, source=source, **self._model_shape())

    def apply_patch(self, patch: Patch) -> PatchOverlay:
        if patch.base_checksum != self.model.checksum:
            raise ValueError("the patch was made for another model")
        overlay = PatchOverlay.build(self.applied_patches + (patch,), self.base_weights)
        self.set_patches(overlay)
        return overlay

    def remove_patch(self, index: int) -> PatchOverlay:
        patches = list(self.applied_patches)
        if not 0 <= index < len(patches):
            raise ValueError(f"no applied patch number {index}")
        del patches[index]
        overlay = PatchOverlay.build(patches, self.base_weights)
        self.set_patches(overlay)
        return overlay

    def inserter(self) -> Inserter:
        """INSERT runs with the engine's FFN mode (walk or dense), without caches. One Inserter per mode is
        kept: it remembers the contexts it has captured, which later inserts share."""
        w = self.walk_settings
        settings = WalkSettings(top_k=w.top_k, dense=w.dense)
        cached = getattr(self, "_inserter", None)
        if cached is None or cached.walk != settings:
            cached = self._inserter = Inserter(self.model, self.base_weights, settings)
        return cached

    def insert(self, fact: Fact, layer: int | None = None, alpha: float = 0.1,
               progress: Progress | None = None, paraphrases: Sequence[str] = (), cancel=None) -> InsertResult:
        """INSERT `fact` on top of the applied patches and apply it. `paraphrases`: phrasings of the question
        to key on besides the generated ones; `cancel`: a threading.Event checked between steps
        (InsertCancelled is raised and nothing is applied)."""
        result = self.inserter().insert(fact, self.patches, layer=layer, alpha=alpha, progress=progress,
                                        paraphrases=paraphrases, cancel=cancel)
        self.apply_patch(result.patch)
        return result

    def _rebind(self) -> None:
        for s in self.sessions:
            s.ffn = self._walk_for(s.l1, s.stats)

    def clear_caches(self, persistent: bool = False) -> None:
        """Empty L2 and every L1; with `persistent`, the L3 store too."""
        self.l2.clear()
        for s in list(self.sessions):
            s.l1.clear()
        if persistent and self.l3 is not None:
            self.l3.clear()

    def reset_stats(self) -> None:
        self.stats.reset()
        for s in list(self.sessions):
            s.stats.reset()

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
