"""Per-layer ONNX graphs for the FFN, exported from the GGUF on first use and run with onnxruntime.

Each layer gets two graphs, so the walk FFN can select features between them and a cache hit can skip the
second:
  gate graph  x (T, d)                         -> scores (T, F)    scores = x @ W_gate.T
  walk graph  x (T, d), scores (T, F), mask (T|1, F) -> out (T, d)  out = W_down @ (mask * act(scores) * (W_up x))
The dense FFN is the walk with an all-ones mask. Weights stay in the GGUF's own blocks (MatMulNBits with the
exact scales and zero points), so the graphs compute with the same weights as the GGUF, not a requantised copy.
Files live under <cache>/onnx/<gguf sha256>/ with a manifest of their own checksums: a corrupt or missing file
is detected at load and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from .config import ModelConfig
from .gguf import GgufFile
from .quants import QuantError, dequantize, make_matmul_nbits_nodes, to_matmul_nbits

EXPORT_FORMAT = 1   # bump when the graphs change, so old exports are rebuilt
# MatMulNBits accuracy level 4 multiplies with int8-quantised activations, as llama.cpp's CPU kernels do;
# at level 0 onnxruntime 1.32 has no fast kernel for 8-bit weights (Q5_0/Q6_K/Q8_0: ~30x slower).
ACCURACY_LEVEL = 4
OPSET = 21          # Gelu with approximate="tanh" needs opset 20+
Progress = Callable[[str, float], None]


def _linear(tensor, input_name: str, output_name: str):
    """x @ W.T from the GGUF's own blocks where MatMulNBits can hold them exactly, else a dense MatMul."""
    try:
        w = to_matmul_nbits(tensor)
    except QuantError:
        wt = numpy_helper.from_array(np.ascontiguousarray(dequantize(tensor).T), output_name + "_Wt")
        return [helper.make_node("MatMul", [input_name, wt.name], [output_name])], [wt]
    return make_matmul_nbits_nodes(w, input_name, output_name, prefix=output_name, accuracy_level=ACCURACY_LEVEL)


def _model(nodes, inits, inputs, outputs, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="larql-desktop")
    model.ir_version = 10
    return model


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


def session_options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, int(threads))
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Dozens of sessions each with a spinning pool make every call cost milliseconds.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class OnnxFfn:
    """The exported gate and walk graphs of every layer, loaded into onnxruntime sessions."""

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path,
                 threads: int = 2, progress: Progress | None = None):
        self.config = config
        self.directory = Path(onnx_root) / checksum
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rebuilt: list[str] = []   # files exported (or re-exported because missing/corrupt) by this load
        opts = session_options(threads)
        manifest = self._read_manifest()
        builders = {"gate": build_gate_graph, "walk": build_walk_graph}
        self._gate: list[ort.InferenceSession] = []
        self._walk: list[ort.InferenceSession] = []
        n = config.n_layers
        for layer in range(n):
            for kind, builder in builders.items():
                name = f"layer{layer:02d}.{kind}.onnx"
                data = self._load_verified(name, manifest)
                session = None
                if data is not None:
                    try:
                        session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
                    except Exception:       # unreadable despite a matching hash: rebuild it
                        session = None
                if session is None:
                    if progress:
                        progress(f"Exporting layer {layer + 1}/{n} {kind} graph to ONNX", (layer + 0.5) / n)
                    data = builder(gguf, config, layer).SerializeToString()
                    _write_atomic(self.directory / name, data)
                    manifest[name] = hashlib.sha256(data).hexdigest()
                    self.rebuilt.append(name)
                    session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
                (self._gate if kind == "gate" else self._walk).append(session)
            if progress and not self.rebuilt:
                progress(f"Loading ONNX graphs ({layer + 1}/{n})", (layer + 1) / n)
        if self.rebuilt:
            _write_atomic(self.directory / "manifest.json",
                          json.dumps({"format": EXPORT_FORMAT, "files": manifest}, indent=1).encode())
        self._ones = np.ones((1, config.intermediate), np.float32)

    def _read_manifest(self) -> dict[str, str]:
        try:
            doc = json.loads((self.directory / "manifest.json").read_text())
            if doc.get("format") == EXPORT_FORMAT and isinstance(doc.get("files"), dict):
                return dict(doc["files"])
        except (OSError, ValueError):
            pass
        return {}

    def _load_verified(self, name: str, manifest: dict[str, str]) -> bytes | None:
        try:
            data = (self.directory / name).read_bytes()
        except OSError:
            return None
        return data if manifest.get(name) == hashlib.sha256(data).hexdigest() else None

    # -- running ------------------------------------------------------------------------------------------
    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self._gate[layer].run(None, {"x": x})[0]            # (T, F)

    def walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self._walk[layer].run(None, {"x": x, "scores": scores, "mask": mask})[0]   # (T, d)

    def dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.walk(layer, x, self.gate_scores(layer, x), self._ones)

    __call__ = dense
