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
    "engine/formats": ("larql_desktop.engine.model", "larql_desktop.engine.graphs", "larql_desktop.engine.cache",
                       "larql_desktop.engine.patches", "larql_desktop.engine.core", "larql_desktop.engine.services",
                       "larql_desktop.engine.loading"),
    "tools": GUI + ("larql_desktop.qt", "larql_desktop.cli"),
    "qt": WEB + ("larql_desktop.api", "larql_desktop.cli"),
    "api": GUI + ("larql_desktop.qt", "larql_desktop.cli", "larql_desktop.tools"),
}


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
