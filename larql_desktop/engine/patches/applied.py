"""The applied patches of each model, kept on disk so they come back when the app starts again.

One JSON file per model (named by the GGUF checksum) holds the applied patches in order, written atomically
(temporary file, then rename) after every change, by whoever made it. Reading back validates every patch against
the loaded model like any patch file: a patch that no longer validates is skipped and named, a file that is not
JSON is set aside (renamed `.corrupt`) and reported, and nothing else is lost.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.model.overlay import Patch, PatchError

log = logging.getLogger(__name__)
FORMAT = 1


class AppliedPatchStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._lock = threading.Lock()

    def path_for(self, checksum: str) -> Path:
        return self.folder / f"{checksum[:32]}.applied.json"

    def save(self, checksum: str, patches: tuple[Patch, ...]) -> None:
        """Write the list (the engine's current one: callers pass it read at the time of writing)."""
        doc = {"format": FORMAT, "patches": [{"name": p.name, "patch": p.to_json()} for p in patches]}
        path = self.path_for(checksum)
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)

    def load(self, engine) -> tuple[list[Patch], list[str]]:
        """The saved patches of the engine's model, validated for it, and a message for each one refused."""
        path = self.path_for(engine.model.checksum)
        if not path.is_file():
            return [], []
        try:
            doc = read_json(path, "saved patch list", PatchError)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("patches"), list):
                raise PatchError(f"{path}: not a saved patch list of format {FORMAT}")
        except PatchError as exc:
            aside = path.with_suffix(".corrupt")
            os.replace(path, aside)
            log.warning("saved patch list unreadable (%s); moved to %s", exc, aside)
            return [], [f"the saved patch list could not be read and was moved to {aside.name}: {exc}"]
        patches, problems = [], []
        for i, entry in enumerate(doc["patches"]):
            try:
                if not isinstance(entry, dict):
                    raise PatchError("expected an object")
                patch = engine.validate_patch(entry.get("patch"), source=f"saved patch {i + 1}")
                name = entry.get("name", "")
                patches.append(patch.named(name if isinstance(name, str) else ""))
            except PatchError as exc:
                problems.append(f"saved patch {i + 1} was not restored: {exc}")
        return patches, problems
