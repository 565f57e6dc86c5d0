"""Hashing a GGUF (a first load's checksum) reads the file without mapping it into the process: the pages it reads
are the page cache's, not this process's resident memory, so they do not count in its peak RSS."""
from __future__ import annotations

import hashlib
import shutil
import sys

import pytest

from larql_desktop.engine.catalog import resolve_model
from larql_desktop.engine.formats.gguf import GgufFile


def _resident_file_kb() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssFile from /proc/self/status")
def test_hashing_a_gguf_keeps_its_pages_out_of_the_process(app_paths, tmp_path):
    packaged, _ = resolve_model("smollm2", app_paths)
    copy = tmp_path / "copy.gguf"      # a file no map of this process has touched yet
    shutil.copyfile(packaged, copy)
    gguf = GgufFile(copy)
    before = _resident_file_kb()
    digest = gguf.sha256()
    grown = _resident_file_kb() - before
    assert digest == hashlib.sha256(copy.read_bytes()).hexdigest()
    size_kb = copy.stat().st_size // 1024
    assert grown < size_kb // 4, f"hashing mapped {grown} KB of a {size_kb} KB file into the process"
