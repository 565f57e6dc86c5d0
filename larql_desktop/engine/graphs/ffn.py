"""Per-layer ONNX graphs for the FFN, exported from the GGUF on first use and run with onnxruntime.

Each layer gets two graphs, so the walk FFN can select features between them and a cache hit can skip the
second (plus a fused dense graph, gate and walk without the mask, for the dense FFN in one call):
  gate graph  x (T, d)                         -> scores (T, F)    scores = x @ W_gate.T
  walk graph  x (T, d), scores (T, F), mask (T|1, F) -> out (T, d)  out = W_down @ (mask * act(scores) * (W_up x))
  top-K walk graph x (T, d), k (1,) -> out (T, d)   the walk with its selection inside: TopK of |scores|, the
      mask scattered from its indices (what the walk FFN runs with every cache tier off: one call per layer)
The dense FFN is the walk with an all-ones mask. Weights stay in the GGUF's own blocks (MatMulNBits with the
exact scales and zero points), so the graphs compute with the same weights as the GGUF, not a requantised copy.
Files live under <cache>/onnx/<gguf sha256>/ with a manifest of their own digests (graphs.store.GraphStore):
a corrupt or missing file is detected at load (its whole content is hashed) and rebuilt.
"""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.model.transformer import KvCache, TransformerModel
from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.graphs.store import OPSET, Binding, GraphStore, LazySessions, Progress, make_model, session_options, write_atomic  # noqa: F401
from larql_desktop.engine.formats.quants import NBitsWeight, QuantError, dequantize, make_matmul_nbits_nodes, to_matmul_nbits

if TYPE_CHECKING:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
else:
    from larql_desktop.engine.graphs.onnx_deferred import TensorProto, helper, numpy_helper, onnx

EXPORT_FORMAT = 5   # bump when the graphs change, so old exports are rebuilt (5: block sums from MatMulNBits rows)


# MatMulNBits accuracy level of every weight: 4, int8-quantised activations in blocks of the weight's block size,
# as llama.cpp's CPU kernels quantise them (Q8_0/Q8_1). onnxruntime 1.32 runs 4-bit weights ~2x and 8-bit ones
# ~30x faster at this level than with fp32 activations (level 0). It moves answers only at near-ties:
# `verify-reference` stays at >= 99.6% agreement with llama.cpp at clear positions, but the fp32 model's
# "Paris." for SmolLM2's "What is the capital of France?" is llama.cpp's "L'Étoile…" here too.
ACCURACY_LEVEL = 4


def linear(tensors, input_name: str, output_name: str, max_node_bytes: int | None = None):
    """x @ concat(W_i).T for one or more GGUF weights with the same K: one MatMulNBits on the GGUF's own
    blocks when they share a MatMulNBits layout (bits, block size), else one node per weight (a dense MatMul
    for blocks MatMulNBits cannot hold exactly) and a Concat. Fusing weights that read the same input saves
    a kernel launch and a block-sum offset chain per weight (see quants.make_matmul_nbits_nodes).

    `max_node_bytes`: split a MatMulNBits weight whose codes are larger into row slices of at most that size,
    one node each, and concatenate their outputs (bit for bit the same: every output row is its own dot
    product). onnxruntime holds a weight's stored and prepacked copies together while it prepacks it, so
    one big weight (a head over the vocabulary) raises the process's peak memory by its whole size."""
    try:
        ws = [to_matmul_nbits(t) for t in tensors]
    except QuantError:
        ws = None
    if ws and all(w.bits == ws[0].bits and w.block_size == ws[0].block_size for w in ws):
        w0 = ws[0]
        w = w0 if len(ws) == 1 else NBitsWeight(
            bits=w0.bits, block_size=w0.block_size, N=sum(w.N for w in ws), K=w0.K,
            packed=np.concatenate([w.packed for w in ws]), scales=np.concatenate([w.scales for w in ws]),
            zero_points=np.concatenate([w.zero_points for w in ws]))
        slices = row_slices(w, max_node_bytes) if max_node_bytes else [w]
        if len(slices) == 1:
            return make_matmul_nbits_nodes(w, input_name, output_name, prefix=output_name,
                                           accuracy_level=ACCURACY_LEVEL)
        ws, tensors = slices, slices
    nodes, inits, parts = [], [], []
    for i, t in enumerate(tensors):
        part = f"{output_name}_part{i}"
        try:
            w = t if isinstance(t, NBitsWeight) else to_matmul_nbits(t)
            n, ini = make_matmul_nbits_nodes(w, input_name, part, prefix=part, accuracy_level=ACCURACY_LEVEL)
        except QuantError:
            wt = numpy_helper.from_array(np.ascontiguousarray(dequantize(t).T), part + "_Wt")
            n, ini = [helper.make_node("MatMul", [input_name, wt.name], [part])], [wt]
        nodes += n
        inits += ini
        parts.append(part)
    if len(parts) == 1:
        nodes[-1].output[0] = output_name
    else:
        nodes.append(helper.make_node("Concat", parts, [output_name], axis=-1))
    return nodes, inits


# MatMulNBits computes output rows in tiles; a slice that starts on a tile boundary gets the same tiles, so the
# same rounding, as the whole weight (a slice of 16,389 rows changed 5 of 98,304 SmolLM2 logits by 2e-6).
SLICE_ROW_MULTIPLE = 64


def row_slices(w: NBitsWeight, max_bytes: int) -> list[NBitsWeight]:
    """`w` cut into consecutive row ranges whose packed codes hold at most `max_bytes` each, each a multiple of
    SLICE_ROW_MULTIPLE rows (but the last)."""
    row_bytes = w.packed[0].nbytes
    rows = max(SLICE_ROW_MULTIPLE, max_bytes // row_bytes // SLICE_ROW_MULTIPLE * SLICE_ROW_MULTIPLE)
    kb = w.k_blocks
    return [NBitsWeight(bits=w.bits, block_size=w.block_size, N=min(w.N, lo + rows) - lo, K=w.K,
                        packed=w.packed[lo:lo + rows], scales=w.scales[lo * kb:(lo + rows) * kb],
                        zero_points=w.zero_points[lo * kb:(lo + rows) * kb])
            for lo in range(0, w.N, rows)]


_model = make_model


def build_gate_graph(gguf: GgufFile, cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    t = gguf.tensors[f"blk.{layer}.ffn_gate.weight"]
    nodes, inits = linear([t], "x", "scores")
    return _model(nodes, inits,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", cfg.hidden])],
                  [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["T", cfg.intermediate])],
                  f"gate_{layer}")


def _activation_nodes(cfg: ModelConfig, scores: str, out: str) -> list:
    if cfg.activation == "silu":
        return [helper.make_node("Sigmoid", [scores], [out + "_sig"]), helper.make_node("Mul", [scores, out + "_sig"], [out])]
    return [helper.make_node("Gelu", [scores], [out], approximate="tanh")]


def build_walk_graph(gguf: GgufFile, cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    up_nodes, up_inits = linear([gguf.tensors[f"blk.{layer}.ffn_up.weight"]], "x", "up")
    down_nodes, down_inits = linear([gguf.tensors[f"blk.{layer}.ffn_down.weight"]], "hidden", "out")
    nodes = up_nodes + _activation_nodes(cfg, "scores", "act") + [
        helper.make_node("Mul", ["act", "up"], ["gated"]),
        helper.make_node("Mul", ["gated", "mask"], ["hidden"]),
    ] + down_nodes
    return _model(nodes, up_inits + down_inits,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", cfg.hidden]),
                   helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["T", cfg.intermediate]),
                   helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["M", cfg.intermediate])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", cfg.hidden])],
                  f"walk_{layer}")


def build_dense_graph(gguf: GgufFile, cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    """The dense FFN in one call: the walk without the mask, with gate and up in one MatMulNBits (they read
    the same input; the int8 quantisation of x is per block, so each half equals its separate product)."""
    t = gguf.tensors
    gate_up_nodes, gate_up_inits = linear([t[f"blk.{layer}.ffn_gate.weight"], t[f"blk.{layer}.ffn_up.weight"]],
                                          "x", "gate_up")
    down_nodes, down_inits = linear([t[f"blk.{layer}.ffn_down.weight"]], "gated", "out")
    nodes = gate_up_nodes + [helper.make_node("Split", ["gate_up"], ["scores", "up"], axis=-1, num_outputs=2)]
    nodes += _activation_nodes(cfg, "scores", "act") + [helper.make_node("Mul", ["act", "up"], ["gated"])] + down_nodes
    return _model(nodes, gate_up_inits + down_inits,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", cfg.hidden])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", cfg.hidden])],
                  f"dense_{layer}")


def top_k_mask_nodes(scores: str, k: str, mask: str) -> list:
    """Nodes making `mask` (T, F): 1.0 at each row's k largest |scores|, 0.0 elsewhere. At a tie on the k-th
    |score| TopK keeps the lower index (the ONNX spec's rule, and onnxruntime's), which keys.select_features
    follows."""
    return [
        helper.make_node("Abs", [scores], [mask + "_magnitudes"]),
        helper.make_node("TopK", [mask + "_magnitudes", k], [mask + "_top_values", mask + "_top_ids"],
                         axis=-1, largest=1, sorted=0),
        helper.make_node("Shape", [scores], [mask + "_shape"]),
        helper.make_node("ConstantOfShape", [mask + "_shape"], [mask + "_zeros"],
                         value=numpy_helper.from_array(np.zeros(1, np.float32))),
        helper.make_node("Shape", [mask + "_top_ids"], [mask + "_ids_shape"]),
        helper.make_node("ConstantOfShape", [mask + "_ids_shape"], [mask + "_ones"],
                         value=numpy_helper.from_array(np.ones(1, np.float32))),
        helper.make_node("ScatterElements", [mask + "_zeros", mask + "_top_ids", mask + "_ones"], [mask], axis=-1),
    ]


def top_k_threshold_nodes(scores: str, k: str, mask: str) -> list:
    """Nodes making `mask` (T, F): 1.0 at every |score| at least a row's k-th largest, 0.0 elsewhere. That is
    top_k_mask_nodes' mask wherever the k-th and (k+1)-th largest |scores| differ; at a tie on the k-th place it
    holds every tied feature, more than k, so a caller counts the mask (threshold_check_nodes) and leaves such a
    row to the exact rule. Cheaper than the scatter: the k-th largest is the largest of the F - k + 1 smallest
    (a smaller TopK, F - k + 1 = 324 of SmolLM2's 1,536 at the default K), and a comparison makes the mask
    (SmolLM2's batched walked decoder at 8 rows: ~35 -> ~30 ms a step)."""
    def constant(name: str, value: int) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [mask + name], value=numpy_helper.from_array(np.array([value], np.int64)))
    return [
        constant("_one", 1),
        constant("_last_axis", -1),
        helper.make_node("Abs", [scores], [mask + "_magnitudes"]),
        helper.make_node("Shape", [scores], [mask + "_width"], start=-1),
        helper.make_node("Sub", [mask + "_width", k], [mask + "_unselected"]),
        helper.make_node("Add", [mask + "_unselected", mask + "_one"], [mask + "_low_count"]),
        helper.make_node("TopK", [mask + "_magnitudes", mask + "_low_count"], [mask + "_low_values", mask + "_low_ids"],
                         axis=-1, largest=0, sorted=0),
        helper.make_node("ReduceMax", [mask + "_low_values", mask + "_last_axis"], [mask + "_threshold"], keepdims=1),
        helper.make_node("GreaterOrEqual", [mask + "_magnitudes", mask + "_threshold"], [mask + "_selected"]),
        helper.make_node("Cast", [mask + "_selected"], [mask], to=TensorProto.FLOAT),
    ]


def build_walk_top_k_graph(gguf: GgufFile, cfg: ModelConfig, layer: int, select_nodes=top_k_mask_nodes
                           ) -> onnx.ModelProto:
    """Gate, selection, mask, up and down in one call: the walk FFN with no cache to consult needs neither the
    scores nor the selection in Python. The selection follows keys.select_features' rule (top_k_mask_nodes;
    `select_nodes` may be top_k_threshold_nodes, whose rows with a tie at the k-th place the caller checks)
    and the mask multiplies in the walk graph's order; gate and up run as one MatMulNBits, as in the dense
    graph (x's int8 blocks are the same for both halves, so the scores equal the gate graph's and the layer
    graph's bit for bit: tests/test_ffn_cache.py checks the outputs against the walk graph's)."""
    t = gguf.tensors
    gate_up_nodes, gate_up_inits = linear([t[f"blk.{layer}.ffn_gate.weight"], t[f"blk.{layer}.ffn_up.weight"]],
                                          "x", "gate_up")
    down_nodes, down_inits = linear([t[f"blk.{layer}.ffn_down.weight"]], "hidden", "out")
    select = select_nodes("scores", "k", "mask")
    nodes = gate_up_nodes + [helper.make_node("Split", ["gate_up"], ["scores", "up"], axis=-1, num_outputs=2)]
    nodes += select + _activation_nodes(cfg, "scores", "act") + [
        helper.make_node("Mul", ["act", "up"], ["gated"]),
        helper.make_node("Mul", ["gated", "mask"], ["hidden"]),
    ] + down_nodes
    return _model(nodes, gate_up_inits + down_inits,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", cfg.hidden]),
                   helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", cfg.hidden])],
                  f"walk_top_k_{layer}")


def build_walk_threshold_graph(gguf: GgufFile, cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    """The top-K walk graph selecting by threshold (top_k_threshold_nodes): the whole-step decoders' FFN, whose
    "settled" output (threshold_check_nodes) names the layers where that is the exact top K."""
    return build_walk_top_k_graph(gguf, cfg, layer, top_k_threshold_nodes)


BUILDERS = {"gate": build_gate_graph, "walk": build_walk_graph, "dense": build_dense_graph,
            "walk_top_k": build_walk_top_k_graph}


class PlainDenseStepper:
    """The Stepper of the plain dense FFN (model/transformer.py): every pass, prefill or decode, in one call of the
    model's whole-model dense decoder graph (graphs/decoder.py), which wires the very per-layer graphs together."""

    def run_whole(self, model: TransformerModel, ids: np.ndarray, h: np.ndarray, start: int, kv: KvCache
                  ) -> np.ndarray | None:
        logits = model.decoder.run(h, start, kv, model.rope)
        kv.length = start + ids.size
        return logits

    def scored_ffn(self, rows: int) -> None:
        return None      # the dense FFN starts from x, not from the gate scores

    def runs_decoder_steps(self) -> bool:
        return True


PLAIN_DENSE = PlainDenseStepper()


class OnnxFfn:
    """The exported gate, walk and dense graphs of every layer, in onnxruntime sessions made on first use.

    All files are checked (and exported again if missing or changed) at load; a layer's sessions are created on
    its first call (the dense sessions by the per-layer dense path, gate/walk by the walk FFN), or all at once
    by `load_sessions`.
    """

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path,
                 threads: int = 2, progress: Progress | None = None):
        self.config = config
        self.gguf = gguf
        self.directory = Path(onnx_root) / checksum
        self._store = GraphStore(self.directory, "manifest.json", EXPORT_FORMAT, progress)
        self.rebuilt = self._store.rebuilt   # files exported (or re-exported because missing/corrupt) by this load
        n = config.n_layers
        files: dict[str, list] = {kind: [] for kind in BUILDERS}
        for layer in range(n):
            for kind, builder in BUILDERS.items():
                name = f"layer{layer:02d}.{kind}.onnx"
                build = partial(builder, gguf, config, layer)
                self._store.ensure(name, build, f"Exporting layer {layer + 1}/{n} {kind} graph to ONNX",
                                   (layer + 0.5) / n)
                files[kind].append((name, build))
        self._store.save()
        # Cache entries made by other graphs are never served: the export format, and the content of these very
        # files (an L3 entry computed before a graph file was found corrupt and rebuilt is not reached after).
        self.numerics = f"onnx-ffn-{EXPORT_FORMAT}-{self._store.digest(n for f in files.values() for n, _ in f)}"
        opts = partial(session_options, threads)
        self._gate, self._walk, self._dense, self._walk_top_k = (
            LazySessions(self._store, files[kind], opts) for kind in ("gate", "walk", "dense", "walk_top_k"))
        self._ones = np.ones((1, config.intermediate), np.float32)
        self._local = threading.local()   # per thread: IO bindings of the dense sessions

    def load_sessions(self, progress: Progress | None = None, kinds=tuple(BUILDERS)) -> None:
        """Create every layer's sessions of these kinds now rather than on first use."""
        sessions = {"dense": self._dense, "gate": self._gate, "walk": self._walk, "walk_top_k": self._walk_top_k}
        for kind in kinds:
            sessions[kind].load_all(progress, f"Loading the {kind} FFN graphs")

    # -- running ------------------------------------------------------------------------------------------
    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self._gate[layer].run(None, {"x": x})[0]            # (T, F)

    def walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(T, d), through an IO binding as `dense` (the walk runs once per layer and token on a miss)."""
        bindings = getattr(self._local, "walk", None)
        if bindings is None:
            bindings = self._local.walk = [None] * self.config.n_layers
        b = bindings[layer]
        if b is None:
            b = bindings[layer] = Binding(self._walk[layer])
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.config.hidden), np.float32)
        b.bind_input("x", x)
        b.bind_input("scores", np.ascontiguousarray(scores, dtype=np.float32))
        b.bind_input("mask", np.ascontiguousarray(mask, dtype=np.float32))
        b.bind_output("out", out)
        b.run()
        return out

    def walk_top_k(self, layer: int, x: np.ndarray, k: int) -> np.ndarray:
        """(T, d): the walk over each position's top-k features by |gate score|, selected inside the graph."""
        bindings = getattr(self._local, "walk_top_k", None)
        if bindings is None:
            bindings = self._local.walk_top_k = [None] * self.config.n_layers
        b = bindings[layer]
        if b is None:
            b = bindings[layer] = Binding(self._walk_top_k[layer])
        ks = getattr(self._local, "k", None)
        if ks is None or ks[0] != k:            # bound once per K: an unchanged K keeps its array
            ks = self._local.k = np.array([k], np.int64)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.config.hidden), np.float32)
        b.bind_input("x", x)
        b.bind_input("k", ks)
        b.bind_output("out", out)
        b.run()
        return out

    def dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        """(T, d) in one call, through an IO binding (session.run's feed dict costs ~15 us per call)."""
        bindings = getattr(self._local, "dense", None)
        if bindings is None:
            bindings = self._local.dense = [None] * self.config.n_layers
        b = bindings[layer]
        if b is None:
            b = bindings[layer] = Binding(self._dense[layer])
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.config.hidden), np.float32)
        b.bind_input("x", x)
        b.bind_output("out", out)
        b.run()
        return out

    __call__ = dense
    stepper = PLAIN_DENSE     # the plain dense FFN everywhere: the model may run whole passes in its decoder graph
