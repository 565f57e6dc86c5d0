"""GGUF reading and the errors a bad file gets, on the real models and on tiny files written here."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.formats.gguf import DEFERRED_ARRAY_MIN, GgufError, GgufFile
from model_files import gguf_path

gguf_pkg = pytest.importorskip("gguf")


def write_tiny_gguf(path, arch="llama", tensor_type=None, n_layers=1, hidden=32, ffn=64, vocab=48):
    """A tiny but complete llama-style GGUF written with llama.cpp's own writer."""
    writer = gguf_pkg.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    rng = np.random.default_rng(0)

    def add(name, shape):
        data = rng.standard_normal(shape).astype(np.float32) * 0.1
        if tensor_type is not None and len(shape) == 2:
            raw = gguf_pkg.quants.quantize(data, tensor_type)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=tensor_type)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,))
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (hidden,))
        add(p + "ffn_norm.weight", (hidden,))
        add(p + "attn_q.weight", (hidden, hidden))
        add(p + "attn_k.weight", (hidden // 2, hidden))
        add(p + "attn_v.weight", (hidden // 2, hidden))
        add(p + "attn_output.weight", (hidden, hidden))
        add(p + "ffn_gate.weight", (ffn, hidden))
        add(p + "ffn_up.weight", (ffn, hidden))
        add(p + "ffn_down.weight", (hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_real_headers_parse(reference):
    for name in ("smollm2", "gemma3-270m"):
        g = GgufFile(gguf_path(name))
        cfg = ModelConfig.from_gguf(g)
        assert cfg.arch in ("llama", "gemma3")
        assert len(g.metadata["tokenizer.ggml.tokens"]) == cfg.vocab_size
        emb = g.tensors["token_embd.weight"]
        assert emb.shape == (cfg.vocab_size, cfg.hidden)
    gemma = ModelConfig.from_gguf(GgufFile(gguf_path("gemma3-270m")))
    assert [layer for layer in range(gemma.n_layers) if not gemma.is_local_layer(layer)] == [5, 11, 17]
    assert gemma.rope_base_for(0) == 10_000.0 and gemma.rope_base_for(5) == 1_000_000.0


def test_a_vocabularys_arrays_are_read_when_asked_and_not_kept():
    """The tokenizer reads the vocabulary's arrays once and keeps its own form of them; the metadata keeps only
    where they lie, so they are no second copy (Gemma 3: 262k strings), and each read is a fresh, equal one."""
    g = GgufFile(gguf_path("gemma3-270m"))
    tokens = g.metadata["tokenizer.ggml.tokens"]
    again = g.get("tokenizer.ggml.tokens")
    assert len(tokens) == ModelConfig.from_gguf(g).vocab_size and tokens == again and tokens is not again
    assert np.array_equal(g.metadata["tokenizer.ggml.scores"], dict(g.metadata.items())["tokenizer.ggml.scores"])
    held = [value for value in dict.values(g.metadata) if isinstance(value, (list, np.ndarray))]
    assert all(len(value) < DEFERRED_ARRAY_MIN for value in held)


def test_tiny_gguf_round_trip(tmp_path):
    g = GgufFile(write_tiny_gguf(tmp_path / "tiny.gguf"))
    cfg = ModelConfig.from_gguf(g)
    assert (cfg.n_layers, cfg.hidden, cfg.intermediate, cfg.vocab_size) == (1, 32, 64, 48)
    assert g.tensors["blk.0.ffn_gate.weight"].shape == (64, 32)


def test_missing_file(tmp_path):
    with pytest.raises(GgufError, match="no such GGUF file"):
        GgufFile(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "text.gguf"
    p.write_text("this is not a model file at all, just text")
    with pytest.raises(GgufError, match="not a GGUF file"):
        GgufFile(p)


@pytest.mark.parametrize("keep_fraction", [0.001, 0.5, 0.999])
def test_truncated_real_model(tmp_path, keep_fraction):
    src = gguf_path("smollm2")
    p = tmp_path / "truncated.gguf"
    size = src.stat().st_size
    with open(src, "rb") as fin, open(p, "wb") as fout:
        fout.write(fin.read(int(size * keep_fraction)))
    with pytest.raises(GgufError, match="truncated"):
        GgufFile(p)


def test_unsupported_architecture(tmp_path):
    g = GgufFile(write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))
    with pytest.raises(GgufError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_gguf(g)


def test_unsupported_tensor_type(tmp_path):
    p = write_tiny_gguf(tmp_path / "q5k.gguf", tensor_type=gguf_pkg.GGMLQuantizationType.Q8_0)
    data = bytearray(p.read_bytes())
    # Re-label one tensor's type id as Q5_K (13), a type this engine does not dequantise.
    g = GgufFile(p)
    name = b"blk.0.ffn_up.weight"
    at = bytes(data).index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 8
    data[type_at:type_at + 4] = (13).to_bytes(4, "little")
    bad = tmp_path / "relabelled.gguf"
    bad.write_bytes(bytes(data))
    del g
    with pytest.raises(GgufError, match="unsupported quantisation Q5_K"):
        GgufFile(bad)


def test_copy_of_real_model_has_same_checksum(tmp_path):
    src = gguf_path("smollm2")
    dst = tmp_path / "copy.gguf"
    shutil.copyfile(src, dst)
    assert GgufFile(dst).sha256() == GgufFile(src).sha256()
