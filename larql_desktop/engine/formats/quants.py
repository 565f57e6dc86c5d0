"""Vectorised dequantisation of ggml block formats, and exact mapping onto ONNX Runtime's MatMulNBits.

Numpy only (``onnx`` is imported lazily by the node builders). Block layouts follow ggml-quants.c and
gguf-py's ``quants.py`` exactly, and the arithmetic is done in float32 in the same order, so
`dequantize` is bit-identical to ``gguf.quants.dequantize``.

`to_matmul_nbits` re-expresses a GGUF weight as the inputs of the ``com.microsoft::MatMulNBits``
contrib op without requantising: the integer codes are carried over unchanged (only re-packed into
MatMulNBits' nibble order, or offset by a constant for 8-bit codes) and the per-block scale and zero
point are derived from the block's own constants, with ``w = (code - zero_point) * scale``:

=======  ====  =====  ===============================  ======================================
GGUF     bits  block  scale                            zero point
=======  ====  =====  ===============================  ======================================
Q4_0     4     32     d                                8
Q4_1     4     32     d                                -m / d
Q4_K     4     32     d * sc   (per 32-value sub-block) dmin * mn / (d * sc)
Q8_0     8     32     d                                128   (code = q + 128)
Q5_0     8     32     d                                128   (code = q + 112, i.e. (q - 16) + 128)
Q6_K     8     16     d * sc   (per 16-value sub-block) 128   (code = q + 96,  i.e. (q - 32) + 128)
=======  ====  =====  ===============================  ======================================

The symmetric types (Q4_0, Q8_0, Q5_0, Q6_K) are reproduced bit-exactly: ``(code - zp)`` is the exact
signed integer ggml multiplies by the same float32 scale. The 8-bit codes are shifted so that the zero
point is MatMulNBits' default (128), which lets the node omit the zero-point input. The affine types
(Q4_1, Q4_K) need a fractional float zero point, so ``(q - zp) * scale`` differs from ggml's
``q * d + m`` only by float32 rounding (relative ~1e-7 of the block offset).

Degenerate blocks: when a Q4_1 block has ``d == 0`` (or a Q4_K sub-block has ``d * sc == 0``) ggml's
value is the constant ``m`` (resp. ``-dmin * mn``) whatever the codes are, which no finite zero point
can express with scale 0. Such blocks are emitted with all codes 0, zero point -1 and scale equal to
that constant, so ``(0 - (-1)) * c == c`` exactly. (Neither real model shipped with the project
contains such a block, but quantisers do produce them for all-equal blocks, e.g. zero padding.)

onnxruntime 1.32 CPU behaviour (measured, 1 thread, 1 x K input): bits=4 and bits=8 both run and
give the results above. The packed MLAS kernel is only used for bits=4 with no or uint8 zero points at
accuracy_level 0/1 -- so Q4_1/Q4_K should be emitted with `make_matmul_nbits_nodes` (split offset),
~85 us for a 1536x576 weight vs ~140 us numpy fp32. A float zero point, or bits=8 at accuracy_level
0, falls back to dequantising the whole weight on every call (~1.5-2 ms for the same size), slower than
a dense fp32 MatMul; bits=8 is fast only with accuracy_level=4, which quantises the activations to
int8 (no longer exact).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from larql_desktop.engine.formats.gguf import GgufTensor, QuantType

__all__ = [
    "QuantError", "NBitsWeight", "dequantize", "dequantize_rows", "dequantize_blocks",
    "to_matmul_nbits", "nbits_dequantize", "matmul_nbits_initializers", "make_matmul_nbits_node",
    "make_matmul_nbits_nodes", "NBITS_TYPES",
]

QK_K = 256


class QuantError(ValueError):
    """A tensor type that cannot be dequantised or mapped onto MatMulNBits."""


# ---------------------------------------------------------------------------------------------------
# Block decoders: (n_blocks, block_bytes) uint8 -> (n_blocks, block_elems) float32
# ---------------------------------------------------------------------------------------------------

def _f16(cols: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 columns -> (n, 1) float32 (the fp16 value they encode)."""
    return np.ascontiguousarray(cols).view(np.float16).astype(np.float32)


def _nibbles_lo_hi(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) codes: low nibbles are values 0..15, high nibbles 16..31."""
    out = np.empty((qs.shape[0], 2, qs.shape[1]), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, 0])
    np.right_shift(qs, 4, out=out[:, 1])
    return out.reshape(qs.shape[0], -1)


def _q5_0_codes(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks -> (n, 32) unsigned codes 0..31 (value = d * (code - 16))."""
    n = blocks.shape[0]
    qh = np.ascontiguousarray(blocks[:, 2:6])
    # bit j of the little-endian uint32 qh is the 5th bit of element j
    hbits = np.unpackbits(qh, axis=1, bitorder="little")  # (n, 32)
    codes = _nibbles_lo_hi(blocks[:, 6:22])
    codes |= hbits << 4
    return codes.reshape(n, 32)


def _q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes -> 8 six-bit sub-block scales and 8 six-bit mins (get_scale_min_k4)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k_parts(blocks: np.ndarray):
    """Q4_K blocks -> (codes (n, 8, 32), d*sc (n, 8), dmin*mn (n, 8)) all float32 but codes."""
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _q4_k_scale_min(blocks[:, 4:16])
    dl = d * sc.astype(np.float32)
    ml = dmin * mn.astype(np.float32)
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    codes = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(qs[:, :, 0], 0x0F, out=codes[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=codes[:, :, 1])
    return codes.reshape(n, 8, 32), dl, ml


def _q6_k_parts(blocks: np.ndarray):
    """Q6_K blocks -> (codes 0..63 (n, 16, 16) uint8, d*sc (n, 16) float32); value = d*sc*(code-32)."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    lo = np.empty((n, 2, 2, 64), dtype=np.uint8)
    np.bitwise_and(ql[:, :, 0], 0x0F, out=lo[:, :, 0])
    np.right_shift(ql[:, :, 0], 4, out=lo[:, :, 1])
    hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)  # (n, 2, 4, 32)
    codes = lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)
    return codes.reshape(n, 16, 16), d * sc


def _dq_f32(blocks):
    return np.ascontiguousarray(blocks).view(np.float32)


def _dq_f16(blocks):
    return np.ascontiguousarray(blocks).view(np.float16).astype(np.float32)


def _dq_q4_0(blocks):
    d = _f16(blocks[:, 0:2])
    q = _nibbles_lo_hi(blocks[:, 2:18]).view(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _dq_q4_1(blocks):
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles_lo_hi(blocks[:, 4:20]).astype(np.float32)
    q *= d
    q += m
    return q


def _dq_q5_0(blocks):
    d = _f16(blocks[:, 0:2])
    q = _q5_0_codes(blocks).view(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _dq_q8_0(blocks):
    d = _f16(blocks[:, 0:2])
    return np.multiply(blocks[:, 2:34].view(np.int8), d, dtype=np.float32)


def _dq_q4_k(blocks):
    n = blocks.shape[0]
    codes, dl, ml = _q4_k_parts(blocks)
    out = codes.astype(np.float32)
    out *= dl[:, :, None]
    out -= ml[:, :, None]
    return out.reshape(n, QK_K)


def _dq_q6_k(blocks):
    n = blocks.shape[0]
    codes, dl = _q6_k_parts(blocks)
    q = (codes.view(np.int8) - np.int8(32)).astype(np.float32)
    q *= dl[:, :, None]
    return q.reshape(n, QK_K)


_DEQUANT = {
    "F32": _dq_f32, "F16": _dq_f16, "Q4_0": _dq_q4_0, "Q4_1": _dq_q4_1, "Q5_0": _dq_q5_0,
    "Q8_0": _dq_q8_0, "Q4_K": _dq_q4_k, "Q6_K": _dq_q6_k,
}

# Blocks decoded per step: bounds temporaries to a few MB so they stay cache-friendly.
_CHUNK_ELEMS = 1 << 18
_PARALLEL_MIN_ELEMS = 1 << 22
_N_THREADS = max(1, min(4, os.cpu_count() or 1))


def dequantize_blocks(qtype: QuantType, blocks: np.ndarray) -> np.ndarray:
    """Decode a (n_blocks, block_bytes) uint8 array of `qtype` blocks to (n_blocks, block_elems) float32."""
    fn = _DEQUANT.get(qtype.name)
    if fn is None:
        raise QuantError(f"cannot dequantise ggml type {qtype.name}; supported: {', '.join(_DEQUANT)}")
    blocks = np.asarray(blocks, dtype=np.uint8).reshape(-1, qtype.block_bytes)
    return fn(blocks).reshape(blocks.shape[0], qtype.block_elems)


def _dequantize_raw(qtype: QuantType, raw: np.ndarray, n_elements: int) -> np.ndarray:
    """Decode a flat byte buffer into a flat float32 array, chunked (and threaded when large)."""
    blocks = raw.reshape(-1, qtype.block_bytes)
    n_blocks = blocks.shape[0]
    out = np.empty((n_blocks, qtype.block_elems), dtype=np.float32)
    step = max(1, _CHUNK_ELEMS // qtype.block_elems)
    fn = _DEQUANT.get(qtype.name)
    if fn is None:
        raise QuantError(f"cannot dequantise ggml type {qtype.name}; supported: {', '.join(_DEQUANT)}")

    def work(start: int) -> None:
        stop = min(start + step, n_blocks)
        out[start:stop] = fn(blocks[start:stop]).reshape(stop - start, qtype.block_elems)

    starts = range(0, n_blocks, step)
    if n_elements >= _PARALLEL_MIN_ELEMS and _N_THREADS > 1 and len(starts) > 1:
        # numpy releases the GIL inside its ufunc loops, so chunks decode in parallel.
        with ThreadPoolExecutor(_N_THREADS) as pool:
            list(pool.map(work, starts))
    else:
        for s in starts:
            work(s)
    return out.reshape(-1)


def dequantize(tensor: GgufTensor) -> np.ndarray:
    """The whole tensor as float32 of `tensor.shape`, identical to gguf-py's dequantisation."""
    if tensor.qtype.name not in _DEQUANT:
        raise QuantError(f"{tensor.name}: cannot dequantise ggml type {tensor.qtype.name}")
    flat = _dequantize_raw(tensor.qtype, tensor.raw, tensor.n_elements)
    return flat.reshape(tensor.shape)


def _row_view(tensor: GgufTensor) -> tuple[np.ndarray, int]:
    """Raw bytes as (rows, row_bytes) where rows flattens every axis but the last; and the row length."""
    cols = int(tensor.shape[-1]) if tensor.shape else 1
    rows = tensor.n_elements // cols if cols else 0
    return tensor.raw.reshape(rows, -1), cols


def dequantize_rows(tensor: GgufTensor, rows) -> np.ndarray:
    """Only the selected rows (indices along the first axis, e.g. token ids) as (len(rows), cols) float32."""
    if tensor.qtype.name not in _DEQUANT:
        raise QuantError(f"{tensor.name}: cannot dequantise ggml type {tensor.qtype.name}")
    raw_rows, cols = _row_view(tensor)
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    n_rows = raw_rows.shape[0]
    if idx.size and (idx.min() < -n_rows or idx.max() >= n_rows):
        raise IndexError(f"{tensor.name}: row index out of range for {n_rows} rows")
    picked = tensor.read_rows(idx % n_rows, raw_rows.shape[1])
    flat = _dequantize_raw(tensor.qtype, picked.reshape(-1), idx.size * cols)
    return flat.reshape(idx.size, cols)


# ---------------------------------------------------------------------------------------------------
# MatMulNBits mapping
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class NBitsWeight:
    """Inputs of com.microsoft::MatMulNBits for one weight: w[n, k] = (code - zero_point) * scale."""
    bits: int
    block_size: int
    N: int                    # output features (rows of the GGUF weight)
    K: int                    # input features (columns)
    packed: np.ndarray        # uint8 [N, K // block_size, block_size * bits // 8]
    scales: np.ndarray        # float32 [N * K // block_size]
    zero_points: np.ndarray   # float32 [N * K // block_size]

    @property
    def k_blocks(self) -> int:
        return self.K // self.block_size

    @property
    def default_zero_point(self) -> int:
        return 1 << (self.bits - 1)


NBITS_TYPES = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q8_0": (8, 32), "Q5_0": (8, 32),
               "Q6_K": (8, 16)}


def _pack4(codes: np.ndarray) -> np.ndarray:
    """(..., 2k) codes 0..15 in value order -> (..., k) bytes: element 2i low nibble, 2i+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _affine_scale_zp(scale: np.ndarray, offset: np.ndarray, codes: np.ndarray):
    """Scales/zero points for w = scale*q + offset. Blocks with scale 0 are the constant `offset`:
    their codes are zeroed and they become (0 - (-1)) * offset."""
    scale = scale.astype(np.float32, copy=True)
    zp = np.empty_like(scale)
    flat = scale == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(-offset, scale, out=zp, where=~flat)
    if flat.any():
        codes[flat] = 0
        zp[flat] = -1.0
        scale[flat] = offset[flat]
    return scale, zp


def to_matmul_nbits(tensor: GgufTensor) -> NBitsWeight:
    """Map a 2-D GGUF weight (N out x K in) onto MatMulNBits inputs without requantising.

    Raises QuantError for types with no exact MatMulNBits form (F32, F16, ...); the caller then uses a
    dense MatMul on `dequantize(tensor)`.
    """
    name = tensor.qtype.name
    if name not in NBITS_TYPES:
        raise QuantError(f"{tensor.name}: ggml type {name} has no exact MatMulNBits mapping "
                         f"(mappable: {', '.join(NBITS_TYPES)}); use a dense MatMul instead")
    if len(tensor.shape) != 2:
        raise QuantError(f"{tensor.name}: MatMulNBits needs a 2-D weight, got shape {tensor.shape}")
    N, K = (int(x) for x in tensor.shape)
    bits, bs = NBITS_TYPES[name]
    if K % tensor.qtype.block_elems:
        raise QuantError(f"{tensor.name}: K={K} is not a multiple of {name}'s block of {tensor.qtype.block_elems}")
    blocks = tensor.raw.reshape(-1, tensor.qtype.block_bytes)
    nb = blocks.shape[0]

    if name == "Q4_0":
        d = _f16(blocks[:, 0:2]).reshape(-1)
        codes = _nibbles_lo_hi(blocks[:, 2:18])
        scales, zps = d, np.full_like(d, 8.0)
    elif name == "Q4_1":
        d = _f16(blocks[:, 0:2]).reshape(-1)
        m = _f16(blocks[:, 2:4]).reshape(-1)
        codes = _nibbles_lo_hi(blocks[:, 4:20])
        scales, zps = _affine_scale_zp(d, m, codes)
    elif name == "Q4_K":
        codes, dl, ml = _q4_k_parts(blocks)                 # (nb, 8, 32), (nb, 8), (nb, 8)
        codes = codes.reshape(nb * 8, 32)
        scales, zps = _affine_scale_zp(dl.reshape(-1), -ml.reshape(-1), codes)
    elif name == "Q8_0":
        d = _f16(blocks[:, 0:2]).reshape(-1)
        codes = blocks[:, 2:34] ^ np.uint8(0x80)            # int8 q -> q + 128
        scales, zps = d, np.full_like(d, 128.0)
    elif name == "Q5_0":
        d = _f16(blocks[:, 0:2]).reshape(-1)
        codes = _q5_0_codes(blocks) + np.uint8(112)          # (q - 16) + 128
        scales, zps = d, np.full_like(d, 128.0)
    else:  # Q6_K
        codes, dl = _q6_k_parts(blocks)                      # (nb, 16, 16), (nb, 16)
        codes = codes.reshape(nb * 16, 16) + np.uint8(96)    # (q - 32) + 128
        scales = dl.reshape(-1)
        zps = np.full_like(scales, 128.0)

    k_blocks = K // bs
    codes = codes.reshape(N, k_blocks, bs)
    packed = _pack4(codes) if bits == 4 else codes
    return NBitsWeight(bits=bits, block_size=bs, N=N, K=K,
                       packed=np.ascontiguousarray(packed, dtype=np.uint8),
                       scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(-1),
                       zero_points=np.ascontiguousarray(zps, dtype=np.float32).reshape(-1))


def nbits_dequantize(w: NBitsWeight) -> np.ndarray:
    """Reference dequantisation of an NBitsWeight exactly as MatMulNBits defines it: (q - zp) * scale."""
    if w.bits == 4:
        p = w.packed
        codes = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
        codes[..., 0::2] = p & 0x0F
        codes[..., 1::2] = p >> 4
    elif w.bits == 8:
        codes = w.packed
    else:
        raise QuantError(f"unsupported bits={w.bits}")
    sc = w.scales.reshape(w.N, w.k_blocks, 1)
    zp = w.zero_points.reshape(w.N, w.k_blocks, 1)
    return ((codes.astype(np.float32) - zp) * sc).reshape(w.N, w.K)


def _zero_point_tensor(w: NBitsWeight):
    """The zero-point input in its cheapest exact form: None (all default), uint8 or float32."""
    zp = w.zero_points
    if np.all(zp == w.default_zero_point):
        return None
    if np.all((zp == np.round(zp)) & (zp >= 0) & (zp < (1 << w.bits))):
        z = zp.astype(np.uint8).reshape(w.N, w.k_blocks)
        if w.bits == 4:
            if w.k_blocks % 2:
                z = np.concatenate([z, np.zeros((w.N, 1), dtype=np.uint8)], axis=1)
            z = _pack4(z)
        return np.ascontiguousarray(z)
    return zp.reshape(w.N, w.k_blocks).astype(np.float32)


def matmul_nbits_initializers(w: NBitsWeight, prefix: str) -> tuple[list[str], list]:
    """Initializers (onnx TensorProtos) for B, scales and, if needed, zero_points; returns their names
    (in MatMulNBits input order, after A) and the tensors."""
    from onnx import numpy_helper

    names = [f"{prefix}_B", f"{prefix}_scales"]
    tensors = [numpy_helper.from_array(w.packed, names[0]),
               numpy_helper.from_array(w.scales.reshape(w.N, w.k_blocks), names[1])]
    zp = _zero_point_tensor(w)
    if zp is not None:
        names.append(f"{prefix}_zero_points")
        tensors.append(numpy_helper.from_array(zp, names[2]))
    return names, tensors


def make_matmul_nbits_node(w: NBitsWeight, input_name: str, output_name: str, *, prefix: str | None = None,
                           node_name: str | None = None, accuracy_level: int = 0):
    """A com.microsoft::MatMulNBits node computing output = input @ W.T, plus its initializers.

    Zero points are omitted when they all equal the default 2^(bits-1), stored as uint8 when integral,
    and as float32 [N, k_blocks] otherwise (Q4_1/Q4_K; exact but slow on the CPU EP -- see
    `make_matmul_nbits_nodes`).

    `input` is float32 [..., K]; the output is float32 [..., N]. accuracy_level 0 keeps fp32 activations
    (1 = fp32 too; 4 lets ORT quantise activations to int8, faster but no longer exact).
    Returns (node, initializers); add the node to the graph, the initializers to graph.initializer,
    and make sure the model imports opset ("com.microsoft", 1).
    """
    from onnx import helper

    prefix = prefix or output_name
    names, inits = matmul_nbits_initializers(w, prefix)
    node = helper.make_node(
        "MatMulNBits", [input_name, *names], [output_name], name=node_name or f"{prefix}_MatMulNBits",
        domain="com.microsoft", K=w.K, N=w.N, bits=w.bits, block_size=w.block_size,
        accuracy_level=accuracy_level)
    return node, inits


def make_matmul_nbits_nodes(w: NBitsWeight, input_name: str, output_name: str, *, prefix: str | None = None,
                            accuracy_level: int = 0, input_rank: int = 2, split_offset: bool = True):
    """Like `make_matmul_nbits_node`, but returns (nodes, initializers) and keeps onnxruntime on its
    fast kernel for the affine types.

    onnxruntime's CPU MatMulNBits only runs its packed (MLAS) kernel with no or uint8 zero points;
    float zero points (needed by Q4_1 / Q4_K) make it dequantise the whole weight on every call
    (~20-60x slower). With `split_offset` such a weight is emitted as the algebraically identical

        [y, s] = MatMulNBits(x, [codes; I], [scale; 1], zp=2^(bits-1)),   y += s @ C.T,
        C[n, b] = (2^(bits-1) - zp[n, b]) * scale[n, b]   (the per-block constant offset)

    where the k_blocks extra rows I (code 2^(bits-1) + 1 on block b of row b, the zero point elsewhere)
    make the same kernel return s, the sum of x over each block, beside the product: one MatMulNBits, a
    Split and a Gemm, where a Reshape + ReduceSum block sum cost two more kernel launches per weight (a
    quarter of a decode step's kernel time on SmolLM2). At accuracy_level 4 the block sums are those of
    the int8-quantised activations, as llama.cpp's Q4_1 x Q8_1 and Q4_K x Q8_K dot products take them.
    `input_rank` is the rank of the input (2 for [M, K], 3 for [batch, seq, K]); the extra nodes need
    standard-domain opset >= 13. Weights whose zero points are integral yield the single MatMulNBits node.
    """
    from onnx import helper, numpy_helper

    prefix = prefix or output_name
    zp = _zero_point_tensor(w)
    if zp is None or zp.dtype == np.uint8 or not split_offset:
        node, inits = make_matmul_nbits_node(w, input_name, output_name, prefix=prefix,
                                             accuracy_level=accuracy_level)
        return [node], inits
    if input_rank < 1:
        raise ValueError("input_rank must be >= 1")
    zd = w.default_zero_point
    offsets = ((zd - w.zero_points.astype(np.float64)) * w.scales.astype(np.float64)).astype(np.float32)
    c_t = np.ascontiguousarray(offsets.reshape(w.N, w.k_blocks).T)          # [k_blocks, N]
    with_sums = _with_block_sum_rows(w)
    q_out, blk_sum, split, c_name, off_out = (
        f"{prefix}_nbits", f"{prefix}_blocksum", f"{prefix}_split", f"{prefix}_offsets", f"{prefix}_offset")
    node, inits = make_matmul_nbits_node(with_sums, input_name, f"{prefix}_nbits_sums", prefix=prefix,
                                         accuracy_level=accuracy_level)
    inits = [*inits,
             numpy_helper.from_array(np.array([w.N, w.k_blocks], dtype=np.int64), split),
             numpy_helper.from_array(c_t, c_name)]
    nodes = [node, helper.make_node("Split", [node.output[0], split], [q_out, blk_sum], name=f"{prefix}_Split",
                                    axis=-1)]
    if input_rank == 2:
        nodes.append(helper.make_node("Gemm", [blk_sum, c_name, q_out], [output_name], name=f"{prefix}_OffsetGemm"))
    else:
        nodes += [helper.make_node("MatMul", [blk_sum, c_name], [off_out], name=f"{prefix}_OffsetMatMul"),
                  helper.make_node("Add", [q_out, off_out], [output_name], name=f"{prefix}_Add")]
    return nodes, inits


def _with_block_sum_rows(w: NBitsWeight) -> NBitsWeight:
    """w with its zero points set to the default and k_blocks rows appended whose product with x is x's
    sum over each block: row b holds (default + 1) on block b and the default elsewhere, scale 1, so every
    term is an exact 1 * x or 0 * x."""
    zd = w.default_zero_point
    codes = np.full((w.k_blocks, w.k_blocks, w.block_size), zd, dtype=np.uint8)
    codes[np.arange(w.k_blocks), np.arange(w.k_blocks)] = zd + 1
    rows = _pack4(codes) if w.bits == 4 else codes
    return NBitsWeight(bits=w.bits, block_size=w.block_size, N=w.N + w.k_blocks, K=w.K,
                       packed=np.ascontiguousarray(np.concatenate([w.packed, rows])),
                       scales=np.concatenate([w.scales, np.ones(w.k_blocks * w.k_blocks, np.float32)]),
                       zero_points=np.full(w.zero_points.size + w.k_blocks * w.k_blocks, zd, np.float32))
