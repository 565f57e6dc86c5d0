"""Resident memory of one file's mappings in this process, for tests of what stays mapped."""
from __future__ import annotations

from pathlib import Path


def resident_kb(path: Path) -> int:
    """Resident kilobytes of this process's mappings of `path` (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split(None, 5)
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) == 6 and fields[5] == str(Path(path).resolve())
        elif inside and fields[:1] == ["Rss:"]:
            total += int(fields[1])
    return total
