"""Hashing a GGUF (a first load's checksum) and reading token embeddings read the file without mapping its pages
into the process: the pages they read are the page cache's, not this process's resident memory, so they do not
count in its peak RSS."""
from __future__ import annotations

import dataclasses
import hashlib
import shutil
import sys

import numpy as np
import pytest

from larql_desktop.engine.catalog import resolve_model
from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.formats.quants import dequantize_rows
from resident import resident_kb, resident_kb_at


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts resident pages through /proc")
def test_hashing_a_gguf_keeps_its_pages_out_of_the_process(app_paths, tmp_path):
    packaged, _ = resolve_model("smollm2", app_paths)
    copy = tmp_path / "copy.gguf"      # a file no map of this process has touched yet
    shutil.copyfile(packaged, copy)
    gguf = GgufFile(copy)
    before = resident_kb(copy)
    digest = gguf.sha256()
    grown = resident_kb(copy) - before
    assert digest == hashlib.sha256(copy.read_bytes()).hexdigest()
    size_kb = copy.stat().st_size // 1024
    assert grown < size_kb // 4, f"hashing mapped {grown} KB of a {size_kb} KB file into the process"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts resident pages through /proc")
def test_embedding_rows_are_read_without_mapping_the_models_pages(app_paths):
    """A token's embedding is read from the file, not through the memory map: a page touched through the map stays
    resident with its neighbours (large page-cache folios are mapped whole; 120 random rows left 28 MB), so a
    chat's lookups grew the process by tens of MB. The rows read equal the map's, bit for bit."""
    packaged, _ = resolve_model("smollm2", app_paths)
    gguf = GgufFile(packaged)
    table = gguf.tensors["token_embd.weight"]
    rows = np.random.default_rng(7).integers(0, table.shape[0], 400)
    resident = resident_kb(gguf.path)
    read = dequantize_rows(table, rows)
    assert resident_kb(gguf.path) == resident
    assert np.array_equal(read, dequantize_rows(dataclasses.replace(table, source=None), rows))  # through the map
    assert resident_kb(gguf.path) > resident + 1024     # what the map costs: the check above can fail


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts resident pages through /proc")
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_the_headers_pages_are_handed_back_once_the_tokenizer_is_built(app_paths, model):
    from larql_desktop.engine.formats.tokenizer import Tokenizer

    packaged, _ = resolve_model(model, app_paths)
    gguf = GgufFile(packaged)
    tokenizer = Tokenizer.from_gguf(gguf)
    # This file object's own map (other tests' maps of the same file hold pages of their own).
    mapped_at = np.frombuffer(gguf._mmap, np.uint8).ctypes.data
    header_kb = gguf.data_offset // 1024
    read_kb, _ = resident_kb_at(mapped_at)
    assert read_kb > header_kb // 2        # building it read the vocabulary through the map
    gguf.release_header_pages()
    # What stays is at most the large page-cache folio the header's last page shares with the tensors' data.
    assert resident_kb_at(mapped_at)[0] < min(2048, read_kb // 4), (read_kb, header_kb)
    # Read again afterwards, the metadata is the same.
    assert Tokenizer.from_gguf(gguf).encode("The capital of France is") == tokenizer.encode("The capital of France is")
