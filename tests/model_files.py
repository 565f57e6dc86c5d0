"""Paths of the packaged models' GGUF files, resolved the way the app resolves them."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from larql_desktop.engine.catalog import resolve_model
from larql_desktop.engine.paths import AppPaths

# Reference-file names -> packaged model keys.
MODEL_KEYS = {"smollm2-135m-instruct": "smollm2", "gemma3-270m": "gemma3-270m"}


@lru_cache(maxsize=None)
def gguf_path(name: str) -> Path:
    return resolve_model(MODEL_KEYS.get(name, name), AppPaths.from_environment().ensure())[0]
