"""The onnxruntime layer/head graphs (block_graphs) and the fused dense FFN graph against the numpy reference."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from larql_desktop.engine.graphs.blocks import OnnxBlocks, build_head_graph, build_layer_graph
from larql_desktop.engine.graphs.store import session_options
from larql_desktop.engine.model.transformer import KvCache, NumpyDenseFfn, TransformerModel


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


def test_corrupt_block_file_is_rebuilt(smollm2, smollm2_graphs_copy):
    victim = smollm2_graphs_copy / smollm2.checksum / "layer02.attn.onnx"
    good = victim.read_bytes()
    victim.write_bytes(good[:1000])
    again = OnnxBlocks(smollm2.gguf, smollm2.config, smollm2.checksum, smollm2_graphs_copy, threads=1)
    assert again.rebuilt == ["layer02.attn.onnx"]
    assert victim.read_bytes() == good
    assert OnnxBlocks(smollm2.gguf, smollm2.config, smollm2.checksum, smollm2_graphs_copy, threads=1).rebuilt == []


def _per_layer(model):
    """The model's dense FFN as a plain callable (it brings no stepper): forward then runs layer by layer."""
    return lambda layer, x: model.ffn.dense(layer, x)


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_decoder_graph_equals_per_layer_graphs(request, fixture):
    """The whole-model decoder graph is the per-layer graphs wired together: same logits, same KV cache, for
    a prefill, a chunk after it and decode steps (the cache growing on the way)."""
    model = request.getfixturevalue(fixture)
    tr = model.transformer
    ids = model.tokenizer.encode("One two three four five six seven eight nine ten eleven twelve")
    kv_whole, kv_layers = KvCache(model.config, capacity=4), KvCache(model.config, capacity=4)
    chunks = [ids[:5], ids[5:8]] + [[t] for t in ids[8:]]
    for chunk in chunks:
        whole = tr.forward(chunk, kv_whole, model.ffn)
        layers = tr.forward(chunk, kv_layers, _per_layer(model))
        np.testing.assert_allclose(whole, layers, rtol=1e-4, atol=1e-4 * np.abs(layers).max())
    n = len(ids)
    assert kv_whole.length == kv_layers.length == n
    for i in (0, model.config.n_layers - 1):
        np.testing.assert_allclose(kv_whole.keys[i][:, :n], kv_layers.keys[i][:, :n], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(kv_whole.values[i][:, :n], kv_layers.values[i][:, :n], rtol=1e-4, atol=1e-4)


class _AskedStepper:
    """A stepper that runs nothing whole and notes what the model asked it."""

    def __init__(self):
        self.asked = []

    def run_whole(self, model, ids, h, start, kv):
        self.asked.append(("run_whole", ids.size, start, h.shape))
        return None

    def scored_ffn(self, rows):
        self.asked.append(("scored_ffn", rows))
        return None


def test_forward_leaves_whole_passes_to_the_stepper_it_is_given(smollm2):
    """The model decides nothing for the cache: it offers a pass to the stepper (not when the caller wants every
    layer recorded), runs it layer by layer when the stepper declines, and runs it in the dense decoder graph
    when handed the plain dense FFN's stepper: bit for bit what the dense FFN, which brings that stepper, gets."""
    from larql_desktop.engine.graphs.ffn import PLAIN_DENSE

    tr, cfg = smollm2.transformer, smollm2.config
    ids = smollm2.tokenizer.encode("One two three four")
    plain = _per_layer(smollm2)
    asked = _AskedStepper()
    scored = [("scored_ffn", len(ids))] if tr.graphs.has_gate_scores else []   # asked where the graphs can give them
    declined = tr.forward(ids, KvCache(cfg), plain, stepper=asked)
    assert asked.asked == [("run_whole", len(ids), 0, (len(ids), cfg.hidden))] + scored
    assert np.array_equal(declined, tr.forward(ids, KvCache(cfg), plain))
    asked.asked.clear()
    tr.forward(ids, KvCache(cfg), plain, record=lambda i, h, x: None, stepper=asked)
    assert asked.asked == scored
    kv = KvCache(cfg)
    whole = tr.forward(ids, kv, plain, stepper=PLAIN_DENSE)
    assert kv.length == len(ids)
    assert np.array_equal(whole, tr.forward(ids, KvCache(cfg), smollm2.ffn))


def test_only_plain_dense_passes_run_in_the_decoder_graph(smollm2):
    """Dense settings claim the pass and count a dense outcome per layer (untimed); the walk, and dense settings
    under an INSERT override, run layer by layer."""
    from larql_desktop.engine.cache.stats import CacheStats
    from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
    from larql_desktop.engine.model.overlay import BaseFeatureWeights, PatchOverlay, PatchOperation, Patch

    cfg = smollm2.config
    stats = CacheStats(cfg.n_layers)
    dense = WalkFfn(smollm2.ffn, WalkSettings(dense=True), model_checksum=smollm2.checksum, observers=(stats,))
    assert dense.stepper.runs_plain_dense() and dense.stepper.runs_plain_dense()
    assert stats.snapshot({}, {}).calls == 0       # asking records nothing
    dense.stepper.record_dense_pass()
    snap = stats.snapshot({}, {})
    assert snap.latency["dense"].count == cfg.n_layers and snap.latency["dense"].mean_us == 0.0
    walk = WalkFfn(smollm2.ffn, WalkSettings(), model_checksum=smollm2.checksum, observers=(stats,))
    assert not walk.stepper.runs_plain_dense()
    base = BaseFeatureWeights(smollm2.gguf)
    gate, up, down = base.vectors(3, 7)
    patch = Patch((PatchOperation("update", 3, 7, gate=gate * 2, up=up, down=down),), smollm2.name, smollm2.checksum)
    patched = WalkFfn(smollm2.ffn, WalkSettings(dense=True), model_checksum=smollm2.checksum, observers=(stats,),
                      patches=PatchOverlay.build([patch], base))
    assert not patched.stepper.runs_plain_dense()
    # And the model honours the answer: a patched dense pass differs from the plain one at the patched layer.
    ids = smollm2.tokenizer.encode("Seven")
    plain = smollm2.transformer.forward(ids, KvCache(cfg), dense)
    assert not np.array_equal(plain, smollm2.transformer.forward(ids, KvCache(cfg), patched))


def test_every_load_hashes_each_graph_file_once_and_rebuilds_rewritten_ones(smollm2, smollm2_graphs_copy):
    """No size-and-mtime shortcut: every load hashes every file's whole content (a same-size rewrite with the
    old time put back is found), and a session made after the load's check does not hash it again."""
    import json
    import os

    from larql_desktop.engine.graphs import store as graph_store
    from larql_desktop.engine.graphs.blocks import MANIFEST

    directory = smollm2_graphs_copy / smollm2.checksum
    hashed = []
    real = graph_store.file_digest

    def counting(path):
        hashed.append(path.name)
        return real(path)

    def load():
        return OnnxBlocks(smollm2.gguf, smollm2.config, smollm2.checksum, smollm2_graphs_copy, threads=1)

    graph_store.file_digest = counting
    try:
        blocks = load()
        # All but the row-batched layer graphs, which only INSERT runs: checked when their session is made.
        files = sorted(f for f in json.loads((directory / MANIFEST).read_text())["files"] if ".attn_rows." not in f)
        assert blocks.rebuilt == [] and sorted(hashed) == files and len(files) == 2 * smollm2.config.n_layers + 1
        hashed.clear()
        blocks.load_sessions(gated=True)                    # checked already, unchanged since: not hashed again
        assert hashed == []
        victim = directory / "head.onnx"
        good, stat = victim.read_bytes(), victim.stat()
        victim.write_bytes(good[:-16] + bytes(16))           # same size, new contents, old time put back
        os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert load().rebuilt == ["head.onnx"] and victim.read_bytes() == good
        victim.touch()                                         # same contents, new time: kept
        assert load().rebuilt == []
    finally:
        graph_store.file_digest = real


def test_a_row_batched_layer_graph_is_checked_and_exported_on_first_use_not_at_load(smollm2, smollm2_graphs_copy):
    """Only INSERT runs the row-batched layer graphs: a load neither hashes nor exports them; the first call
    exports a missing one, records it in the manifest and gives the single layer graph's output."""
    import json

    from larql_desktop.engine.graphs.blocks import MANIFEST

    cfg = smollm2.config
    directory = smollm2_graphs_copy / smollm2.checksum
    victim = directory / "layer03.attn_rows.onnx"
    victim.unlink(missing_ok=True)
    blocks = OnnxBlocks(smollm2.gguf, cfg, smollm2.checksum, smollm2_graphs_copy, threads=1)
    assert blocks.rebuilt == [] and not victim.exists()
    rng = np.random.default_rng(3)
    h = rng.standard_normal((2, cfg.hidden)).astype(np.float32)
    f = np.zeros_like(h)
    keys = np.zeros((2, cfg.n_kv_heads, 8, cfg.head_dim), np.float32)
    values = np.zeros_like(keys)
    cos, sin = smollm2.transformer.rope.table(cfg.rope_base_for(3), 8)
    out, _ = blocks.run_layer_rows(3, h, f, keys, values, np.array([0, 0]), cos, sin)
    assert blocks.rebuilt == ["layer03.attn_rows.onnx"] and victim.exists()
    assert "layer03.attn_rows.onnx" in json.loads((directory / MANIFEST).read_text())["files"]
    alone, _ = blocks.run_layer(3, h[1:], f[1:], np.zeros_like(keys[1]), np.zeros_like(values[1]), 0, cos, sin)
    np.testing.assert_array_equal(out[1:], alone)


def test_optimised_copy_of_the_decoder_computes_the_same_and_is_remade_when_damaged(smollm2, smollm2_graphs_copy):
    """The decoder loads from onnxruntime's optimised copy (made by the first load): same logits as the
    source; a damaged copy is noticed (size/time changed, hash differs) and made again."""
    from larql_desktop.engine.graphs.decoder import OnnxDecoder

    cfg = smollm2.config
    ids = np.array(smollm2.tokenizer.encode("Seven eight nine"))
    h = smollm2.transformer.embed(ids)
    expected = smollm2.transformer.forward(ids, KvCache(cfg), _per_layer(smollm2))
    directory = smollm2_graphs_copy / smollm2.checksum
    for damage in (False, True):
        copies = sorted(directory.glob("decoder.optimized-ort*"))
        assert [p.suffix for p in copies] == [".onnx", ".data"]
        assert not (directory / "decoder.onnx").exists()      # the copy replaced the export
        data = copies[1]
        if damage:
            data.write_bytes(data.read_bytes()[:-64])
        decoder = OnnxDecoder(smollm2.gguf, cfg, smollm2.checksum, smollm2_graphs_copy, threads=2)
        logits = decoder.run(h, 0, KvCache(cfg), smollm2.transformer.rope)
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        assert decoder.rebuilt == (["decoder.onnx"] if damage else [])    # exported again to remake the copy
    assert data.stat().st_size > 1_000_000 and data.stat().st_size % 4 == 0     # made again in full
    assert not (directory / "decoder.onnx").exists()


def test_gated_layer_graph_hands_the_walk_its_gate_scores(smollm2):
    """The walk's layer graphs also give the FFN's gate scores: the same h, x and scores as the plain layer
    graph followed by the gate graph, and a walk generation through them (one call fewer per layer) produces
    the same logits and the same cache keys as one that computes the scores itself."""
    from larql_desktop.engine.cache.stats import CacheStats
    from larql_desktop.engine.cache.tiers import CacheTier
    from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings

    cfg, tr = smollm2.config, smollm2.transformer
    graphs = tr.graphs
    assert graphs.has_gate_scores
    kv = KvCache(cfg)
    h = tr.embed(np.array(smollm2.tokenizer.encode("A small test")))
    f = graphs.zeros(h.shape[0])
    cos, sin = tr.rope.table(cfg.rope_base_for(2), h.shape[0])
    keys, values = kv.keys[2].copy(), kv.values[2].copy()
    h1, x1 = graphs.run_layer(2, h, f, keys, values, 0, cos, sin)
    h2, x2, scores = graphs.run_layer(2, h, f, kv.keys[2], kv.values[2], 0, cos, sin, gate_scores=True)
    np.testing.assert_array_equal(h1, h2)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_allclose(scores, smollm2.ffn.gate_scores(2, x2), rtol=1e-5, atol=1e-5)

    def walk(log):
        n = cfg.n_layers
        return WalkFfn(smollm2.ffn, WalkSettings(), model_checksum=smollm2.checksum, l1=CacheTier("L1", n),
                       observers=(CacheStats(n),), key_log=log)

    ids = smollm2.tokenizer.encode("The sky is")
    fused_log, plain_log = [], []
    fused, plain = walk(fused_log), walk(plain_log)
    assert fused.stepper.takes_gate_scores
    plain_call = lambda layer, x: plain(layer, x)       # noqa: E731  (no stepper: scores computed)
    kv_a, kv_b = KvCache(cfg), KvCache(cfg)
    a, b = tr.forward(ids, kv_a, fused), tr.forward(ids, kv_b, plain_call)
    for _ in range(4):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
        token = int(np.argmax(b))
        a, b = tr.forward([token], kv_a, fused), tr.forward([token], kv_b, plain_call)
    assert fused_log == plain_log and len(fused_log) == 4 * cfg.n_layers


def _tiny_graph():
    from onnx import TensorProto, helper

    from larql_desktop.engine.graphs.store import make_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 4])
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    from onnx import numpy_helper
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(w, "w")], [x], [y],
                      "tiny")


def test_optimised_copy_replaces_the_export_or_falls_back_to_it(tmp_path, monkeypatch):
    """With room on disk the copy replaces the export; when the copy cannot be written the session runs on
    the export as it is (logged), and nothing is lost."""
    from functools import partial

    from larql_desktop.engine.graphs.store import GraphStore

    x = np.ones((1, 4), np.float32)
    expected = x @ np.arange(16, dtype=np.float32).reshape(4, 4)
    store = GraphStore(tmp_path / "ok", "m.json", 1)
    session = store.session("tiny.onnx", _tiny_graph, partial(session_options, 1), optimized=True)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected)
    assert not (tmp_path / "ok" / "tiny.onnx").exists() and len(list((tmp_path / "ok").glob("tiny.optimized-*"))) == 2

    def no_room(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(GraphStore, "_write_optimized", no_room)
    store = GraphStore(tmp_path / "full", "m.json", 1)
    session = store.session("tiny.onnx", _tiny_graph, partial(session_options, 1), optimized=True)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected)
    assert (tmp_path / "full" / "tiny.onnx").is_file() and not list((tmp_path / "full").glob("tiny.optimized-*"))
