"""Dequantisation against gguf-py, and the MatMulNBits mapping run through onnxruntime."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from larql_desktop.engine.formats.gguf import QUANT_TYPES, GgufFile, GgufTensor
from larql_desktop.engine.formats import quants as Q
from larql_desktop.engine.graphs.store import session_options
from model_files import gguf_path

gquants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

MODEL_KEYS = ("smollm2", "gemma3")

QT = {q.name: q for q in QUANT_TYPES.values()}


def _open(key: str) -> GgufFile:
    return GgufFile(gguf_path("gemma3-270m" if key == "gemma3" else key))


@pytest.fixture(scope="module")
def models() -> dict[str, GgufFile]:
    return {key: _open(key) for key in MODEL_KEYS}


def _reference(t: GgufTensor) -> np.ndarray:
    rows = t.n_elements // t.shape[-1]
    out = gquants.dequantize(t.raw.reshape(rows, -1), GGMLQuantizationType[t.qtype.name])
    return np.asarray(out, dtype=np.float32).reshape(t.shape)


def _pick(gf: GgufFile, qname: str, n: int = 3, skip_embedding: bool = True) -> list[GgufTensor]:
    out = [t for t in gf.tensors.values() if t.qtype.name == qname]
    if skip_embedding and len(out) > 1:  # the big embedding only when it is the type's sole tensor
        out = [t for t in out if t.name != "token_embd.weight"]
    return out[:n]


def _synthetic(qname: str, shape: tuple[int, int], seed: int = 0) -> GgufTensor:
    """A tensor quantised by gguf-py itself (for types the real models do not contain)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if qname == "F16":
        raw = data.astype(np.float16).view(np.uint8)
    else:
        raw = gquants.quantize(data, GGMLQuantizationType[qname])
    return GgufTensor(f"synthetic.{qname}", shape, QT[qname], np.ascontiguousarray(raw).reshape(-1))


def _run_ort(nodes, inits, x: np.ndarray, N: int) -> np.ndarray:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    lead = [f"d{i}" for i in range(x.ndim - 1)]
    graph = helper.make_graph(
        nodes, "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, x.shape[-1]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, N])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


# --- (a) dequantize vs gguf-py ------------------------------------------------------------------------

REAL_TYPES = [("smollm2", "F32"), ("smollm2", "Q4_1"), ("smollm2", "Q8_0"),
              ("gemma3", "F32"), ("gemma3", "Q8_0"), ("gemma3", "Q5_0"), ("gemma3", "Q4_K"), ("gemma3", "Q6_K")]


@pytest.mark.parametrize("model,qname", REAL_TYPES)
def test_dequantize_matches_gguf_py(models, model, qname):
    tensors = _pick(models[model], qname)
    assert tensors, f"{model} has no {qname} tensor"
    for t in tensors:
        ours = Q.dequantize(t)
        assert ours.dtype == np.float32 and ours.shape == t.shape
        np.testing.assert_array_equal(ours, _reference(t), err_msg=t.name)


def test_real_models_cover_expected_types(models):
    present = {(m, t.qtype.name) for m, gf in models.items() for t in gf.tensors.values()}
    assert present == set(REAL_TYPES)


def test_dequantize_embedding_q8_0(models):
    t = models["smollm2"].tensors["token_embd.weight"]
    np.testing.assert_array_equal(Q.dequantize(t), _reference(t))


@pytest.mark.parametrize("qname", ["F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_dequantize_synthetic_matches_gguf_py(qname):
    t = _synthetic(qname, (48, 256), seed=1)
    np.testing.assert_array_equal(Q.dequantize(t), _reference(t))


# --- (b) dequantize_rows --------------------------------------------------------------------------------

def test_dequantize_rows_equals_full(models):
    rng = np.random.default_rng(0)
    cases = [models["smollm2"].tensors["token_embd.weight"],
             *_pick(models["gemma3"], "Q4_K", 1), *_pick(models["gemma3"], "Q6_K", 1),
             *_pick(models["gemma3"], "Q5_0", 1), *_pick(models["smollm2"], "Q4_1", 1)]
    for t in cases:
        full = Q.dequantize(t)
        rows = np.concatenate([[0, t.shape[0] - 1, 3, 3], rng.integers(0, t.shape[0], 20)])
        got = Q.dequantize_rows(t, rows)
        assert got.shape == (len(rows), t.shape[1]) and got.dtype == np.float32
        np.testing.assert_array_equal(got, full[rows], err_msg=t.name)
    assert Q.dequantize_rows(cases[0], np.array([], dtype=np.int64)).shape == (0, cases[0].shape[1])


def test_dequantize_rows_gemma_embedding(models):
    t = models["gemma3"].tensors["token_embd.weight"]
    rows = np.array([0, 2, 262143, 106, 2, 100000])
    raw = t.raw.reshape(t.shape[0], -1)[rows]
    ref = gquants.dequantize(raw, GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(Q.dequantize_rows(t, rows), ref)
    with pytest.raises(IndexError, match=f"row index out of range for {t.shape[0]} rows"):
        Q.dequantize_rows(t, [t.shape[0]])


# --- (c) MatMulNBits through onnxruntime ------------------------------------------------------------------

NBITS_CASES = [("smollm2", "Q4_1", 4, 32), ("gemma3", "Q4_K", 4, 32), ("gemma3", "Q8_0", 8, 32),
               ("gemma3", "Q5_0", 8, 32), ("gemma3", "Q6_K", 8, 16)]


@pytest.mark.parametrize("model,qname,bits,block", NBITS_CASES)
def test_matmul_nbits_real(models, model, qname, bits, block):
    t = _pick(models[model], qname, 1)[0]
    w = Q.to_matmul_nbits(t)
    N, K = t.shape
    assert (w.bits, w.block_size, w.N, w.K) == (bits, block, N, K)
    assert w.packed.dtype == np.uint8 and w.packed.shape == (N, K // block, block * bits // 8)
    assert w.scales.shape == w.zero_points.shape == (N * K // block,)
    dense = Q.dequantize(t)
    ref_w = Q.nbits_dequantize(w)
    if qname in ("Q4_1", "Q4_K"):
        assert _rel(ref_w, dense) < 1e-6
    else:  # symmetric types are carried over bit-exactly
        np.testing.assert_array_equal(ref_w, dense)

    x = np.random.default_rng(0).standard_normal((3, K)).astype(np.float32)
    ref = x.astype(np.float64) @ dense.T.astype(np.float64)
    node, inits = Q.make_matmul_nbits_node(w, "x", "y", prefix="w")
    y = _run_ort([node], inits, x, N)
    assert y.shape == (3, N)
    assert _rel(y, ref) < 1e-5

    # the split form (fast kernel for float zero points) computes the same product, at any input rank
    nodes, inits = Q.make_matmul_nbits_nodes(w, "x", "y", prefix="w", input_rank=3)
    assert len(nodes) == (4 if qname in ("Q4_1", "Q4_K") else 1)   # MatMulNBits with block-sum rows, Split, MatMul, Add
    y3 = _run_ort(nodes, inits, x.reshape(1, 3, K), N)
    assert _rel(y3.reshape(3, N), ref) < 1e-5


def test_matmul_nbits_q4_0_synthetic():
    t = _synthetic("Q4_0", (64, 256), seed=2)
    w = Q.to_matmul_nbits(t)
    assert (w.bits, w.block_size) == (4, 32)
    np.testing.assert_array_equal(Q.nbits_dequantize(w), Q.dequantize(t))
    node, inits = Q.make_matmul_nbits_node(w, "x", "y")
    assert len(node.input) == 3  # zero point 8 is MatMulNBits' default: no zero-point input
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    assert _rel(_run_ort([node], inits, x, 64), x.astype(np.float64) @ Q.dequantize(t).T) < 1e-5


def test_q4_1_zero_scale_block_is_exact():
    t = _synthetic("Q4_1", (4, 64), seed=3)
    blocks = t.raw.reshape(-1, 20).copy()
    rng = np.random.default_rng(3)
    flat = [0, 3, 6]
    blocks[flat, 0:2] = np.zeros((1, 1), np.float16).view(np.uint8)           # d = 0
    blocks[flat, 2:4] = np.array([[-0.75], [0.0], [3.5]], np.float16).view(np.uint8)  # m
    blocks[flat, 4:] = rng.integers(0, 256, (len(flat), 16), dtype=np.uint8)  # arbitrary codes
    t = GgufTensor("synthetic.q4_1.d0", t.shape, t.qtype, blocks.reshape(-1))
    dense = Q.dequantize(t)
    np.testing.assert_array_equal(dense, _reference(t))
    assert np.all(dense.reshape(-1, 32)[0] == -0.75) and np.all(dense.reshape(-1, 32)[6] == 3.5)
    w = Q.to_matmul_nbits(t)
    assert np.all(np.isfinite(w.scales)) and np.all(np.isfinite(w.zero_points))
    ref_w = Q.nbits_dequantize(w)
    np.testing.assert_array_equal(ref_w.reshape(-1, 32)[flat], dense.reshape(-1, 32)[flat])
    assert _rel(ref_w, dense) < 1e-6
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ref = x.astype(np.float64) @ dense.T.astype(np.float64)
    node, inits = Q.make_matmul_nbits_node(w, "x", "y")
    assert _rel(_run_ort([node], inits, x, 4), ref) < 1e-5
    nodes, inits = Q.make_matmul_nbits_nodes(w, "x", "y")
    assert _rel(_run_ort(nodes, inits, x, 4), ref) < 1e-5


def test_q4_k_zero_subscale_is_exact(models):
    t = _pick(models["gemma3"], "Q4_K", 1)[0]
    blocks = t.raw.reshape(-1, 144)[:8].copy()   # one row's worth of super-blocks is enough
    blocks[:, 4] &= 0xC0                          # sub-block 0: 6-bit scale = 0 (keep the high bits)
    t = GgufTensor("synthetic.q4_k.sc0", (2, 1024), t.qtype, blocks.reshape(-1))
    dense = Q.dequantize(t)
    np.testing.assert_array_equal(dense, _reference(t))
    w = Q.to_matmul_nbits(t)
    ref_w = Q.nbits_dequantize(w)
    sub0 = (slice(None), slice(0, 32))
    np.testing.assert_array_equal(ref_w.reshape(-1, 256)[sub0], dense.reshape(-1, 256)[sub0])
    assert _rel(ref_w, dense) < 1e-6


# --- (d) unmappable / undecodable types --------------------------------------------------------------------

def test_unmappable_type_raises(models):
    norm = models["smollm2"].tensors["output_norm.weight"]
    with pytest.raises(Q.QuantError, match="no exact MatMulNBits mapping"):
        Q.to_matmul_nbits(norm)
    with pytest.raises(Q.QuantError, match="F16"):
        Q.to_matmul_nbits(_synthetic("F16", (8, 32)))
    fake = Q.QuantType("Q5_1", 7, 32, 24)
    t = GgufTensor("fake", (1, 32), fake, np.zeros(24, np.uint8))
    with pytest.raises(Q.QuantError, match="type Q5_1 has no exact MatMulNBits mapping"):
        Q.to_matmul_nbits(t)
    with pytest.raises(Q.QuantError, match="cannot dequantise ggml type Q5_1"):
        Q.dequantize(t)


@pytest.mark.parametrize("model", MODEL_KEYS)
def test_head_in_row_slices_equals_one_node(models, model):
    """The head's weight cut into row slices (to bound onnxruntime's prepacking peak) gives the same logits bit
    for bit as one node: every output row is its own dot product, over the same blocks."""
    from larql_desktop.engine.graphs.ffn import linear, row_slices
    gf = models[model]
    t = gf.tensors.get("output.weight", gf.tensors["token_embd.weight"])
    N, K = t.shape
    w = Q.to_matmul_nbits(t)
    rows = (N // 3 + 64) // 64 * 64                     # three slices, the last one shorter
    slice_bytes = w.packed[0].nbytes * rows + 1
    slices = row_slices(w, slice_bytes)
    assert [s.N for s in slices] == [rows, rows, N - 2 * rows]
    np.testing.assert_array_equal(np.concatenate([Q.nbits_dequantize(s) for s in slices]), Q.nbits_dequantize(w))

    x = np.random.default_rng(3).standard_normal((2, K)).astype(np.float32)
    whole_nodes, whole_inits = linear([t], "x", "y")
    sliced_nodes, sliced_inits = linear([t], "x", "y", max_node_bytes=slice_bytes)
    assert sum(n.op_type == "MatMulNBits" for n in sliced_nodes) == 3
    assert sum(n.op_type == "MatMulNBits" for n in whole_nodes) == 1
    np.testing.assert_array_equal(_run_ort(sliced_nodes, sliced_inits, x, N), _run_ort(whole_nodes, whole_inits, x, N))
