"""The onnxruntime layer/head graphs (block_graphs) and the fused dense FFN graph against the numpy reference."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from larql_desktop.engine.block_graphs import OnnxBlocks, build_head_graph, build_layer_graph
from larql_desktop.engine.graph_store import session_options
from larql_desktop.engine.model import KvCache, NumpyDenseFfn, TransformerModel


def _cos(a, b):
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _clear_argmax_agree(ours, ref, gap=0.5):
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= gap
    return clear, (ours.argmax(-1) == ref.argmax(-1))[clear]


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_graph_forward_matches_numpy_forward(request, fixture):
    model = request.getfixturevalue(fixture)
    fast = model.transformer
    assert fast.graphs is not None, "load_model should attach the onnxruntime graphs"
    ref = TransformerModel(model.gguf, model.config)          # numpy path, same GGUF
    exact_ffn = NumpyDenseFfn(ref)
    ids = model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. The capital")
    kv_fast, kv_ref = KvCache(model.config, capacity=8), KvCache(model.config, capacity=8)
    # Prefill, a chunk after a context, then single-token decode steps (the cache grows on the way).
    chunks = [ids[:9], ids[9:13]] + [[t] for t in ids[13:]]
    ours, exact = [], []
    for chunk in chunks:
        ours.append(fast.forward(chunk, kv_fast, model.ffn, all_logits=True))
        exact.append(ref.forward(chunk, kv_ref, exact_ffn, all_logits=True))
    ours, exact = np.concatenate(ours), np.concatenate(exact)
    assert kv_fast.length == kv_ref.length == len(ids)
    # int8 activations inside every MatMulNBits (as llama.cpp: attention projections and the head too) cost
    # a little precision, never direction; near-flat positions move most (SmolLM2: min ~0.98, mean ~0.997).
    cos = _cos(ours, exact)
    assert cos.min() > 0.97 and cos.mean() > 0.995
    clear, agree = _clear_argmax_agree(ours, exact)
    assert clear.sum() >= 5 and agree.mean() >= 0.9
    clear, agree = _clear_argmax_agree(ours, exact, gap=1.5)
    assert clear.sum() >= 3 and agree.all()
    keys_cos = _cos(kv_fast.keys[3][:, :len(ids)].ravel(), kv_ref.keys[3][:, :len(ids)].ravel())
    assert keys_cos > 0.99


def test_sliding_window_matches_numpy(gemma3):
    # A window of 6 so a short sequence crosses it; layer 0 is local (layer 5 is global).
    cfg = dataclasses.replace(gemma3.config, sliding_window=6, n_layers=6)
    assert cfg.window_for(0) == 6 and cfg.window_for(5) == 0
    opts = session_options(1)
    layers = [ort.InferenceSession(build_layer_graph(gemma3.gguf, cfg, i).SerializeToString(), opts)
              for i in range(cfg.n_layers)]
    head = ort.InferenceSession(build_head_graph(gemma3.gguf, cfg).SerializeToString(), opts)
    fast = TransformerModel(gemma3.gguf, cfg)
    fast.use_graphs(OnnxBlocks.from_sessions(cfg, layers, head))
    ref = TransformerModel(gemma3.gguf, cfg)
    exact_ffn = NumpyDenseFfn(ref)
    ids = gemma3.tokenizer.encode("One two three four five six seven eight nine ten eleven twelve thirteen")
    kv_fast, kv_ref = KvCache(cfg), KvCache(cfg)
    chunks = [ids[:4], ids[4:11]] + [[t] for t in ids[11:]]
    ours = np.concatenate([fast.forward(c, kv_fast, gemma3.ffn, all_logits=True) for c in chunks])
    exact = np.concatenate([ref.forward(c, kv_ref, exact_ffn, all_logits=True) for c in chunks])
    assert len(ids) > 12
    cos = _cos(ours, exact)
    assert cos.min() > 0.97 and cos.mean() > 0.995


def test_dense_graph_equals_gate_then_walk(smollm2):
    ffn = smollm2.ffn
    x = np.random.default_rng(3).standard_normal((3, smollm2.config.hidden)).astype(np.float32)
    for layer in (0, smollm2.config.n_layers - 1):
        fused = ffn.dense(layer, x)
        split = ffn.walk(layer, x, ffn.gate_scores(layer, x), np.ones((1, smollm2.config.intermediate), np.float32))
        np.testing.assert_allclose(fused, split, rtol=1e-4, atol=1e-4 * np.abs(split).max())


def test_corrupt_block_file_is_rebuilt(smollm2, app_paths):
    blocks = smollm2.transformer.graphs
    victim = blocks.directory / "layer02.attn.onnx"
    good = victim.read_bytes()
    victim.write_bytes(good[:1000])
    again = OnnxBlocks(smollm2.gguf, smollm2.config, smollm2.checksum, app_paths.onnx_dir, threads=1)
    assert again.rebuilt == ["layer02.attn.onnx"]
    assert victim.read_bytes() == good
    assert OnnxBlocks(smollm2.gguf, smollm2.config, smollm2.checksum, app_paths.onnx_dir, threads=1).rebuilt == []
