"""Applied patches as front-ends list them: one frozen summary per patch, named by its content hash."""
from __future__ import annotations

from dataclasses import dataclass

from larql_desktop.engine.model.overlay import Patch, PatchOverlay


@dataclass(frozen=True)
class PatchSummary:
    """One applied patch as front-ends show it; `id` is stable (a content hash) and names it in requests."""
    id: str
    name: str                 # the file stem it was loaded from ("" for an INSERT made here)
    description: str
    base_model: str
    created_at: str
    operations: int
    layers: tuple[int, ...]
    features: tuple[tuple[int, int], ...]   # (layer, feature)

    @classmethod
    def of(cls, patch: Patch) -> "PatchSummary":
        return cls(patch.id, patch.name, patch.description, patch.base_model, patch.created_at,
                   len(patch.operations), tuple(patch.layers), tuple(patch.features))


def patch_summaries(overlay: PatchOverlay) -> tuple[PatchSummary, ...]:
    return tuple(PatchSummary.of(p) for p in overlay.patches)
