"""The import contract that keeps the layout honest: read every module's imports (function-level ones included)
and check each layer imports only downwards. A failure names the module and the import that breaks the rule."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "larql_desktop"
GUI = ("PySide6", "pyqtgraph")
WEB = ("fastapi", "uvicorn", "starlette", "pydantic", "sse_starlette")

# layer (a folder or module of the package) -> what it must never import
FORBIDDEN = {
    "engine": GUI + WEB + ("larql_desktop.qt", "larql_desktop.api", "larql_desktop.tools", "larql_desktop.cli"),
    "tools": GUI + ("larql_desktop.qt", "larql_desktop.cli"),
    "qt": WEB + ("larql_desktop.api", "larql_desktop.cli"),
    "api": GUI + ("larql_desktop.qt", "larql_desktop.cli", "larql_desktop.tools"),
}


# The engine's own layers, bottom first: a part (a subpackage or top-level module of engine/) imports only parts of
# lower rows, never its own row's neighbours nor anything above, so no two parts can form an import cycle.
ENGINE_LAYERS = (
    ("formats", "paths", "heap"),   # GGUF, quantisations, tokenizer, chat templates, JSON files; where the app's
                                    # files live; freed memory handed back to the system
    ("catalog",),              # the known models and their downloads
    ("model",),                # config, forward pass, KV cache, sampling, stop strings, FFN outcomes, the patch overlay
    ("graphs",),               # ONNX export of layers, blocks and decoders, and the file store they live in
    ("loading",),              # a GGUF turned into a LoadedModel (tokenizer, transformer, graphs), its chat prompts
    ("cache",),                # the walk FFN, its keys, tiers (L1/L2/L3), statistics, near misses, key traces
    ("patches",),              # INSERT, the applied-patch store, relation frames, patch summaries
    ("session",),              # a chat session: messages, KV cache and its FFN
    ("core",),                 # the engine: sessions, cache settings, patches, events
    ("analysis",),             # the paraphrase-collapse lab and the feature view, run on an engine
    ("completions", "chats", "services"),   # what front-ends ask of an engine
)
ENGINE = "larql_desktop.engine"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _violations(layer: str) -> list[str]:
    root = PACKAGE / layer
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]
    bad = []
    for path in files:
        for line, name in _imports(path):
            for banned in FORBIDDEN[layer]:
                if name == banned or name.startswith(banned + "."):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def _engine_part(path: Path) -> str:
    rel = path.relative_to(PACKAGE / "engine").parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _engine_violations() -> list[str]:
    """Every import of one engine part by another that does not go strictly down ENGINE_LAYERS, and every part
    the layer list does not name (a new part must be placed)."""
    row = {part: level for level, parts in enumerate(ENGINE_LAYERS) for part in parts}
    bad = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        here = _engine_part(path)
        if here == "__init__":
            continue
        where = path.relative_to(PACKAGE.parent)
        if here not in row:
            bad.append(f"{where} is in engine part {here!r}, which ENGINE_LAYERS does not place")
            continue
        reported = set()
        for line, name in _imports(path):
            if not name.startswith(ENGINE + "."):
                continue
            there = name.split(".")[2]
            if there in (here, "__init__") or (line, there) in reported:
                continue   # one report per import statement and part (not one per imported name)
            reported.add((line, there))
            if there not in row:
                if (PACKAGE / "engine" / there).exists() or (PACKAGE / "engine" / f"{there}.py").exists():
                    bad.append(f"{where}:{line} imports {name}, in engine part {there!r} that ENGINE_LAYERS does "
                               "not place")
                continue   # `from larql_desktop.engine import x` also lists the name `x` itself
            if row[there] >= row[here]:
                bad.append(f"{where}:{line} imports {name}: {here} may not import {there} "
                           f"({'the same row' if row[there] == row[here] else 'a higher layer'})")
    return bad


def test_engine_parts_import_only_lower_layers():
    assert _engine_violations() == []


def test_the_engine_layers_catch_an_upward_import(tmp_path, monkeypatch):
    """A function-level import of the cache by the model, one between neighbours of a row, and an unplaced part."""
    fake = tmp_path / "larql_desktop"
    for folder in ("engine/model", "engine/cache", "engine/extra"):
        (fake / folder).mkdir(parents=True)
    (fake / "engine" / "model" / "forward.py").write_text(
        "from larql_desktop.engine.formats import gguf\n\ndef f():\n    from larql_desktop.engine.cache.walk import WalkFfn\n")
    (fake / "engine" / "cache" / "walk.py").write_text("from larql_desktop.engine.model.forward import f\n")
    (fake / "engine" / "chats.py").write_text("from larql_desktop.engine import services\n")
    (fake / "engine" / "services.py").write_text("")
    (fake / "engine" / "extra" / "thing.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _engine_violations() == [
        "larql_desktop/engine/chats.py:1 imports larql_desktop.engine.services: chats may not import services "
        "(the same row)",
        "larql_desktop/engine/extra/thing.py is in engine part 'extra', which ENGINE_LAYERS does not place",
        "larql_desktop/engine/model/forward.py:4 imports larql_desktop.engine.cache.walk: model may not import "
        "cache (a higher layer)"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_imports_only_downwards(layer):
    assert _violations(layer) == []


def test_the_contract_catches_a_violation(tmp_path, monkeypatch):
    """The checker itself: a Qt import hidden inside a function of an engine module is found."""
    fake = tmp_path / "larql_desktop"
    (fake / "engine").mkdir(parents=True)
    (fake / "engine" / "leaky.py").write_text("def f():\n    from PySide6 import QtCore\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _violations("engine") == ["larql_desktop/engine/leaky.py:2 imports PySide6",
                                     "larql_desktop/engine/leaky.py:2 imports PySide6.QtCore"]


def _own_private_names(files: list[Path]) -> set[str]:
    """The private names the package defines: functions, classes and attributes (assigned on anything) whose name
    has one leading underscore. A private name of a third-party object (onnxruntime's `_sess`) is not the
    package's to make public, so it is not among them."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _private_uses() -> list[str]:
    """Every use of one of the package's private names from outside its owner: `obj._name` on anything but
    self or cls, and `from larql_desktop... import _name`."""
    files = sorted(PACKAGE.rglob("*.py"))
    private = _own_private_names(files)
    bad = []
    for path in files:
        where = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{where}:{node.lineno} uses {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("larql_desktop")):
                bad += [f"{where}:{node.lineno} imports {alias.name} from {node.module}" for alias in node.names
                        if alias.name in private]
    return bad


def test_no_private_member_is_used_from_outside():
    assert _private_uses() == []


def test_the_private_member_check_catches_a_use(tmp_path, monkeypatch):
    """Another object's private attribute, a private function imported from another module; not self's own,
    a dunder, or a third-party object's private name."""
    fake = tmp_path / "larql_desktop"
    (fake / "engine").mkdir(parents=True)
    (fake / "engine" / "owner.py").write_text(
        "class Owner:\n    def __init__(self):\n        self._state = 1\n\n\ndef _helper():\n    return 2\n")
    (fake / "engine" / "user.py").write_text(
        "import onnxruntime\nfrom larql_desktop.engine.owner import Owner, _helper\n\n\n"
        "def f(owner: Owner, session: onnxruntime.InferenceSession):\n"
        "    return owner._state, owner.__class__, session._sess, _helper()\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _private_uses() == [
        "larql_desktop/engine/user.py:2 imports _helper from larql_desktop.engine.owner",
        "larql_desktop/engine/user.py:6 uses owner._state"]
