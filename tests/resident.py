"""Resident memory of this process's mappings, for tests of what stays mapped or is written."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator


def _mappings() -> Iterator[tuple[int, int, str, int]]:
    """(start, end, path or "", resident kB) of each mapping in Linux's /proc/self/smaps."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split(None, 5)
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            current = (low, high, fields[5] if len(fields) == 6 else "")
        elif current is not None and fields[:1] == ["Rss:"]:
            yield (*current, int(fields[1]))
            current = None


def resident_kb(path: Path) -> int:
    """Resident kilobytes of this process's mappings of `path`."""
    name = str(Path(path).resolve())
    return sum(kb for _, _, mapped, kb in _mappings() if mapped == name)


def resident_kb_at(address: int) -> tuple[int, int]:
    """(resident kB, size kB) of this process's mapping that holds `address`."""
    for low, high, _, kb in _mappings():
        if low <= address < high:
            return kb, (high - low) // 1024
    raise LookupError(f"no mapping holds {address:#x}")
