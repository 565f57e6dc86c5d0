"""Freed heap space goes back to the system: what an INSERT's many mid-sized arrays leave behind."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from larql_desktop.engine.heap import return_freed_memory


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap (Linux)")
def test_heap_space_freed_between_live_arrays_is_returned():
    # 64 KB arrays come from the heap (below glibc's mmap threshold); every fourth one kept alive pins the heap's
    # top, so only trimming (not the allocator's own shrinking from the top) can return the rest.
    arrays = [np.ones(16 * 1024, np.float32) for _ in range(8000)]      # 500 MB
    kept = arrays[3::4]
    del arrays
    before = resident_mb()
    assert return_freed_memory()
    after = resident_mb()
    assert before - after > 250, (before, after)
    assert float(sum(a.sum() for a in kept)) == 2000 * 16 * 1024      # the live arrays are intact


_LONG_PROMPT_TWICE = """
import subprocess
import sys
from larql_desktop.engine.loading import load_model
from larql_desktop.engine.paths import AppPaths
from larql_desktop.tools import bench

def resident_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))

model = load_model("smollm2", AppPaths.from_environment().ensure(), threads=2, preload="decoder")
engine = bench.engine_for(model, "dense")
for _ in range(2):
    session = engine.new_session()
    bench.greedy_run(model, session.kv, session.ffn, " ".join(["word"] * 1000), 2)
    engine.close_session(session)
    print(resident_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status (Linux)")
def test_a_long_prompt_run_again_does_not_grow_the_process(smollm2):
    # onnxruntime's memory pattern, kept per distinct set of input shapes, grew the process by 86 MB each time a
    # 1,000-token prompt ran again; its own process, so that no earlier test has grown the arena already.
    result = subprocess.run([sys.executable, "-c", _LONG_PROMPT_TWICE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    first, second = (float(line) for line in result.stdout.split())
    assert second - first < 20, (first, second)


_LOAD_PEAK = """
import sys
from larql_desktop.engine.loading import load_model
from larql_desktop.engine.paths import AppPaths

model = load_model(sys.argv[1], AppPaths.from_environment().ensure(), threads=2, preload="decoder")
with open("/proc/self/status") as status:
    fields = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in status if line.startswith("Vm")}
print(fields["VmHWM"], fields["VmRSS"])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status (Linux)")
@pytest.mark.parametrize("model, bound_mb", [("smollm2", 15), ("gemma3-270m", 20)])
def test_loading_does_not_pile_up_the_weights_files_pages(model, bound_mb, request):
    # onnxruntime keeps the pages it read of a weights file mapped until the whole session is made: the load's
    # peak stood 21 MB (SmolLM2) and 33 MB (Gemma 3) above what the loaded process holds. Its own process, so
    # that the peak is the load's.
    request.getfixturevalue("smollm2" if model == "smollm2" else "gemma3")     # the graphs are exported
    result = subprocess.run([sys.executable, "-c", _LOAD_PEAK, model], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak, resident = (float(value) for value in result.stdout.split())
    assert peak - resident < bound_mb, (peak, resident)
