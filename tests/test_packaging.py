"""The desktop package: built with PyInstaller from this checkout, then its self-test run offscreen."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built_app(tmp_path_factory):
    out = tmp_path_factory.mktemp("package")
    env = dict(os.environ, PY=sys.executable)
    result = subprocess.run(["bash", str(ROOT / "packaging" / "build.sh"), str(out / "dist"), str(out / "work")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    app = out / "dist" / "larql-desktop" / "larql-desktop"
    assert app.is_file()
    return app


def test_built_app_passes_its_self_test_without_python(built_app, tmp_path):
    # A clean environment: no virtualenv, no PYTHONPATH; only what the build carries.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "QT_QPA_PLATFORM": "offscreen",
           "LARQL_DESKTOP_HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    result = subprocess.run([str(built_app), "--self-test"], env=env, capture_output=True, text=True, timeout=600,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-test passed" in result.stdout
    assert "L2 hits" in result.stdout
    assert (built_app.parent / "larql-desktop.desktop").is_file()
    assert (built_app.parent / "larql-desktop.png").is_file()
