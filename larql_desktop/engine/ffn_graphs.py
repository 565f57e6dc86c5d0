"""Per-layer ONNX graphs for the FFN, exported from the GGUF on first use and run with onnxruntime.

Each layer gets two graphs, so the walk FFN can select features between them and a cache hit can skip the
second (plus a fused dense graph, gate and walk without the mask, for the dense FFN in one call):
  gate graph  x (T, d)                         -> scores (T, F)    scores = x @ W_gate.T
  walk graph  x (T, d), scores (T, F), mask (T|1, F) -> out (T, d)  out = W_down @ (mask * act(scores) * (W_up x))
The dense FFN is the walk with an all-ones mask. Weights stay in the GGUF's own blocks (MatMulNBits with the
exact scales and zero points), so the graphs compute with the same weights as the GGUF, not a requantised copy.
Files live under <cache>/onnx/<gguf sha256>/ with a manifest of their own checksums (graph_store.GraphStore):
a corrupt or missing file is detected at load and rebuilt.
"""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from .config import ModelConfig
from .gguf import GgufFile
from .graph_store import OPSET, Binding, GraphStore, Progress, make_model, session_options, write_atomic  # noqa: F401
from .quants import QuantError, dequantize, make_matmul_nbits_nodes, to_matmul_nbits

EXPORT_FORMAT = 2   # bump when the graphs change, so old exports are rebuilt


def accuracy_level_for(w) -> int:
    """MatMulNBits accuracy level for a weight. Level 4 multiplies with int8-quantised activations (as
    llama.cpp's CPU kernels do); onnxruntime 1.32 needs it for 8-bit weights (Q5_0/Q6_K/Q8_0 are ~30x slower
    at level 0). 4-bit weights keep fp32 activations: with int8 ones SmolLM2's near-tie answers flip (its
    "What is the capital of France?" turned from the fp32 model's "Paris." into llama.cpp's "L'Étoile…")."""
    return 4 if w.bits == 8 else 0


def _linear(tensor, input_name: str, output_name: str):
    """x @ W.T from the GGUF's own blocks where MatMulNBits can hold them exactly, else a dense MatMul."""
    try:
        w = to_matmul_nbits(tensor)
    except QuantError:
        wt = numpy_helper.from_array(np.ascontiguousarray(dequantize(tensor).T), output_name + "_Wt")
        return [helper.make_node("MatMul", [input_name, wt.name], [output_name])], [wt]
    return make_matmul_nbits_nodes(w, input_name, output_name, prefix=output_name,
                                   accuracy_level=accuracy_level_for(w))


_model = make_model


def build_gate_graph(gguf: GgufFile, cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    t = gguf.tensors[f"blk.{layer}.ffn_gate.weight"]
    nodes, inits = _linear(t, "x", "scores")
    return _model(nodes, inits,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", cfg.hidden])],
                  [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["T", cfg.intermediate])],
                  f"gate_{layer}")


def build_walk_graph(gguf: GgufFile, cfg: ModelConfig, layer: int) -> onnx.ModelProto:
    up_nodes, up_inits = _linear(gguf.tensors[f"blk.{layer}.ffn_up.weight"], "x", "up")
    down_nodes, down_inits = _linear(gguf.tensors[f"blk.{layer}.ffn_down.weight"], "hidden", "out")
    if cfg.activation == "silu":
        act = [helper.make_node("Sigmoid", ["scores"], ["sig"]), helper.make_node("Mul", ["scores", "sig"], ["act"])]
    else:
        act = [helper.make_node("Gelu", ["scores"], ["act"], approximate="tanh")]
    nodes = up_nodes + act + [
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
    """gate and walk fused, without the mask: the dense FFN in one call."""
    gate_nodes, gate_inits = _linear(gguf.tensors[f"blk.{layer}.ffn_gate.weight"], "x", "scores")
    walk = build_walk_graph(gguf, cfg, layer).graph
    nodes = gate_nodes + [n for n in walk.node if n.output[0] != "hidden"]
    for n in nodes:                       # the walk's down projection reads the unmasked product
        for i, name in enumerate(n.input):
            if name == "hidden":
                n.input[i] = "gated"
    return _model(nodes, gate_inits + list(walk.initializer),
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", cfg.hidden])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", cfg.hidden])],
                  f"dense_{layer}")


BUILDERS = {"gate": build_gate_graph, "walk": build_walk_graph, "dense": build_dense_graph}


class OnnxFfn:
    """The exported gate, walk and dense graphs of every layer, loaded into onnxruntime sessions.

    All files are checked (and exported again if missing or corrupt) at load; the dense sessions are created
    then, the gate/walk sessions of a layer on its first walk call (the dense path never needs them).
    """

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path,
                 threads: int = 2, progress: Progress | None = None):
        self.config = config
        self.gguf = gguf
        self.directory = Path(onnx_root) / checksum
        self._store = GraphStore(self.directory, "manifest.json", EXPORT_FORMAT, progress)
        self.rebuilt = self._store.rebuilt   # files exported (or re-exported because missing/corrupt) by this load
        self._opts = session_options(threads)
        n = config.n_layers
        self._dense: list[ort.InferenceSession] = []
        self._gate: list[ort.InferenceSession | None] = [None] * n
        self._walk: list[ort.InferenceSession | None] = [None] * n
        self._lock = threading.Lock()
        for layer in range(n):
            for kind, builder in BUILDERS.items():
                name = f"layer{layer:02d}.{kind}.onnx"
                build = partial(builder, gguf, config, layer)
                message = f"Exporting layer {layer + 1}/{n} {kind} graph to ONNX"
                if kind == "dense":
                    self._dense.append(self._store.session(name, build, self._opts, message, (layer + 0.5) / n))
                else:
                    self._store.ensure(name, build, message, (layer + 0.5) / n)
            if progress and not self.rebuilt:
                progress(f"Loading ONNX graphs ({layer + 1}/{n})", (layer + 1) / n)
        self._store.save()
        self._ones = np.ones((1, config.intermediate), np.float32)
        self._local = threading.local()   # per thread: IO bindings of the dense sessions

    def _walk_sessions(self, layer: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
        gate, walk = self._gate[layer], self._walk[layer]
        if gate is None or walk is None:
            with self._lock:
                if self._gate[layer] is None or self._walk[layer] is None:
                    for kind, sessions in (("gate", self._gate), ("walk", self._walk)):
                        build = partial(BUILDERS[kind], self.gguf, self.config, layer)
                        sessions[layer] = self._store.session(f"layer{layer:02d}.{kind}.onnx", build, self._opts,
                                                              verified=True)
                gate, walk = self._gate[layer], self._walk[layer]
        return gate, walk

    def load_walk_sessions(self) -> None:
        """Create every layer's gate/walk sessions now rather than on first use."""
        for layer in range(self.config.n_layers):
            self._walk_sessions(layer)

    # -- running ------------------------------------------------------------------------------------------
    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self._walk_sessions(layer)[0].run(None, {"x": x})[0]            # (T, F)

    def walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self._walk_sessions(layer)[1].run(None, {"x": x, "scores": scores, "mask": mask})[0]   # (T, d)

    def dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        """(T, d) in one call, through an IO binding (session.run's feed dict costs ~15 us per call)."""
        bindings = getattr(self._local, "dense", None)
        if bindings is None:
            bindings = self._local.dense = [Binding(s) for s in self._dense]
        b = bindings[layer]
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.config.hidden), np.float32)
        b.bind_input("x", x)
        b.bind_output("out", out)
        b.run()
        return out

    __call__ = dense
