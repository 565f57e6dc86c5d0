"""Test set-up: offscreen Qt, a throw-away home for all app files, and the real packaged models."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Before anything imports Qt or resolves paths: tests never touch the real user directories.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
_HOME = tempfile.mkdtemp(prefix="larql-desktop-tests-")
# It fills with ~1.5 GB of models and exported graphs: gone when the test run ends.
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["LARQL_DESKTOP_HOME"] = _HOME
for _var in ("DATA", "CACHE", "LOG", "CONFIG"):
    os.environ.pop(f"LARQL_DESKTOP_{_var}_DIR", None)

import gc  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from larql_desktop.engine.graphs.store import share_thread_pool  # noqa: E402
from larql_desktop.engine.heap import return_freed_memory  # noqa: E402
from larql_desktop.engine.paths import AppPaths  # noqa: E402
from larql_desktop.engine.patches.insert.capture_store import CaptureStore  # noqa: E402

# As main() does: every onnxruntime session of the process on one shared pool (tests make theirs with
# graph_store.session_options too).
share_thread_pool(2)

# Copies of the project's shared reference data, so a bare clone runs its own tests.
DATA_DIR = Path(__file__).resolve().parent / "data"
REFERENCE_FILE = DATA_DIR / "llamacpp_reference.json"
SCENARIOS_DIR = DATA_DIR


@pytest.fixture(autouse=True)
def freed_memory_returned():
    """After each test, the heap space its engines, sessions and servers freed goes back to the system (and after
    each module, what only the cycle collector frees): glibc keeps it otherwise, and ~500 tests that each load
    graphs and decode on several threads grew one process past 14 GB of free-but-held heap."""
    yield
    return_freed_memory()


@pytest.fixture(autouse=True, scope="module")
def collected_after_each_module():
    yield
    gc.collect()
    return_freed_memory()


@pytest.fixture(scope="session")
def app_paths() -> AppPaths:
    return AppPaths.from_environment().ensure()


@pytest.fixture(scope="session")
def capture_store(app_paths) -> CaptureStore:
    """One store of INSERT's passes for the whole run: the app's own, in the run's home, which the window's,
    the server's and the CLI's inserts (subprocesses too) keep theirs in as well. A relation's passes an earlier
    test computed are read back, not computed again (the same patch either way:
    tests/test_insert_capture_store.py). The store's own tests make stores of their own."""
    store = CaptureStore(app_paths.insert_captures)
    yield store
    store.close()


@pytest.fixture(scope="session")
def reference() -> dict:
    if not REFERENCE_FILE.is_file():
        pytest.fail(f"the llama.cpp reference file is missing: {REFERENCE_FILE}")
    return json.loads(REFERENCE_FILE.read_text())


@pytest.fixture(scope="session")
def smollm2(app_paths):
    from larql_desktop.engine.loading import load_model

    return load_model("smollm2", app_paths, threads=2)


@pytest.fixture
def smollm2_graphs_copy(smollm2, app_paths, tmp_path) -> Path:
    """An onnx directory of the test's own holding a copy of SmolLM2's exported graphs: a test that damages
    graph files damages these, never the session's, which later tests load (a failure half-way would leave
    them broken)."""
    onnx_dir = tmp_path / "onnx"
    shutil.copytree(app_paths.onnx_dir / smollm2.checksum, onnx_dir / smollm2.checksum)   # times kept too
    return onnx_dir


@pytest.fixture(scope="session")
def gemma3(app_paths):
    from larql_desktop.engine.loading import load_model

    return load_model("gemma3-270m", app_paths, threads=2)


# Under CI=true a skipped test fails the run: a missing redis-server, Qt library or test package must be loud,
# not a green run that tested less. Collection skips (a module's importorskip) count as well as test skips.
_SKIPS: list[str] = []


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    _record_skip(report)


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if _ci() and _SKIPS and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _ci() and _SKIPS:
        terminalreporter.section("skips fail the run under CI=true", red=True, bold=True)
        for line in _SKIPS:
            terminalreporter.write_line(f"SKIPPED (counts as a failure): {line}", red=True)
