"""The type checker keeps the engine's typed boundaries honest: mypy (configured in pyproject.toml) passes on
larql_desktop/engine, and it does check the engine's calls, e.g. what a service is given as its engine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *args],
                          cwd=ROOT, capture_output=True, text=True)


def test_mypy_passes_on_the_engine():
    result = _mypy("larql_desktop/engine")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found")


def test_mypy_refuses_a_service_called_with_something_else_than_an_engine():
    code = ("import numpy as np\n"
            "from larql_desktop.engine.services import walk_ffn\n"
            "walk_ffn('an engine', 0, np.zeros((1, 4), np.float32), None)\n")
    result = _mypy("-c", code)
    assert result.returncode == 1
    assert 'Argument 1 to "walk_ffn" has incompatible type "str"; expected "LarqlEngine"' in result.stdout
