"""The engine one process runs: a loaded model, its shared L2 cache and statistics, and the chat sessions."""
from __future__ import annotations

import threading

from .ffn_cache import CacheStats, CacheTier, StatsSnapshot, TierSettings, WalkFfn, WalkSettings
from .patches import PatchOverlay
from .runtime import LoadedModel
from .session import ChatSession


class LarqlEngine:
    """Owns the process-wide L2 tier; each session gets its own L1 tier and stats, and all share L2.

    Settings are immutable values; changing them rebinds every session's walk FFN (caches are kept,
    their keys carry K, key width and patch epoch so entries made under other settings are never served).
    """

    def __init__(self, model: LoadedModel, walk: WalkSettings = WalkSettings(),
                 l1: TierSettings = TierSettings(), l2: TierSettings = TierSettings(), patches=None):
        self.model = model
        n = model.config.n_layers
        walk.resolved(model.config.intermediate)      # refuse impossible settings up front
        self.walk_settings = walk
        self.l1_settings = l1
        self.l2 = CacheTier("L2", n, l2)
        self.stats = CacheStats(n)                    # process-wide: every session records here too
        self.patches = patches if patches is not None else PatchOverlay()
        self.sessions: list[ChatSession] = []
        self._lock = threading.Lock()

    def _walk_for(self, l1: CacheTier, stats: CacheStats) -> WalkFfn:
        return WalkFfn(self.model.ffn, self.model.config.intermediate, self.model.checksum, self.walk_settings,
                       l1, self.l2, (stats, self.stats), self.patches)

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
                  l2: TierSettings | None = None) -> None:
        if walk is not None:
            walk.resolved(self.model.config.intermediate)
        with self._lock:
            if walk is not None:
                self.walk_settings = walk
            if l1 is not None:
                self.l1_settings = l1
                for s in self.sessions:
                    s.l1.configure(l1)
            if l2 is not None:
                self.l2.configure(l2)
            self._rebind()

    def set_patches(self, patches) -> None:
        with self._lock:
            self.patches = patches
            self._rebind()

    def _rebind(self) -> None:
        for s in self.sessions:
            s.ffn = self._walk_for(s.l1, s.stats)

    def clear_caches(self) -> None:
        self.l2.clear()
        for s in list(self.sessions):
            s.l1.clear()

    def reset_stats(self) -> None:
        self.stats.reset()
        for s in list(self.sessions):
            s.stats.reset()

    def snapshot(self) -> StatsSnapshot:
        """Process-wide statistics: L1 summed over sessions, the shared L2, all bypasses and latencies."""
        with self._lock:
            l1_tiers = [s.l1 for s in self.sessions]
        return self.stats.snapshot({"L1": l1_tiers, "L2": [self.l2]}, self._enabled())

    def session_snapshot(self, session: ChatSession) -> StatsSnapshot:
        return session.stats.snapshot({"L1": [session.l1], "L2": [self.l2]}, self._enabled())

    def _enabled(self) -> dict[str, bool]:
        return {"L1": self.l1_settings.enabled, "L2": self.l2.settings.enabled}
