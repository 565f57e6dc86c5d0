"""Freed heap space goes back to the system: what an INSERT's many mid-sized arrays leave behind."""
from __future__ import annotations

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
