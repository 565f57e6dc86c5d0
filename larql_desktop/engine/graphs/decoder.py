"""The whole model in one ONNX graph: every layer's attention and dense FFN, then the output head.

The per-layer graphs (block_graphs + ffn_graphs) cost two onnxruntime calls per layer and more for the walk, so
a SmolLM2 decode step is 61 calls whose fixed costs (dispatch, waking the thread pool, binding) rival the matmuls.
When every layer would run the plain dense FFN there is nothing to do between layers, so this graph runs them
all in one call. Same kernels, 2 threads: SmolLM2 decode 46-50 -> 92-97 tok/s, Gemma 3 270M 35 -> 46 tok/s.

It is composed from the very graphs the per-layer path runs (build_layer_graph, build_dense_graph,
build_head_graph), each tensor renamed into its layer's namespace and wired output to input, so both paths
compute the same thing node for node. Inputs: the embeddings h (T, d), zeros f0 (T, d) for layer 0's "previous
FFN output", every layer's KV cache (bound as past and present, written in place), seqlens_k/total_len and one
cos/sin table per rope base. Output: the logits of the last position (1, vocab).
"""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from larql_desktop.engine.graphs.blocks import BLOCK_EXPORT_FORMAT, build_head_graph, build_layer_graph
from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.graphs.ffn import EXPORT_FORMAT as FFN_EXPORT_FORMAT, build_dense_graph
from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.graphs.store import Binding, GraphStore, LazySessions, Progress, ZeroRows, make_model, session_options

# The decoder is rebuilt whenever the graphs it is made of change.
DECODER_EXPORT_FORMAT = f"decoder1-blocks{BLOCK_EXPORT_FORMAT}-ffn{FFN_EXPORT_FORMAT}"
MANIFEST = "decoder.manifest.json"
FILE = "decoder.onnx"
FLOAT = TensorProto.FLOAT


def rope_bases(cfg: ModelConfig) -> list[float]:
    """The distinct rope bases, in the order of the decoder's cos{i}/sin{i} inputs."""
    return sorted({cfg.rope_base_for(i) for i in range(cfg.n_layers)})


def _renamed(graph: onnx.GraphProto, rename) -> tuple[list, list]:
    """The graph's nodes and initializers with every tensor name passed through `rename` ("" stays "")."""
    nodes = []
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = rename(node.name or node.output[0])
        copy.ClearField("input")
        copy.input.extend(rename(x) if x else "" for x in node.input)
        copy.ClearField("output")
        copy.output.extend(rename(x) if x else "" for x in node.output)
        nodes.append(copy)
    inits = []
    for tensor in graph.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.name = rename(tensor.name)
        inits.append(copy)
    return nodes, inits


def build_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    n, bases = cfg.n_layers, rope_bases(cfg)
    nodes, inits = [], []
    for i in range(n):
        table = bases.index(cfg.rope_base_for(i))
        edges = {"h": "h" if i == 0 else f"l{i - 1}.h_out", "f": "f0" if i == 0 else f"l{i - 1}.ffn_out",
                 "seqlens_k": "seqlens_k", "total_len": "total_len", "cos": f"cos{table}", "sin": f"sin{table}",
                 "past_key": f"past_key{i}", "past_value": f"past_value{i}",
                 "present_key": f"present_key{i}", "present_value": f"present_value{i}"}
        more_nodes, more_inits = _renamed(build_layer_graph(gguf, cfg, i).graph,
                                          lambda name, i=i, edges=edges: edges.get(name, f"l{i}.{name}"))
        nodes += more_nodes
        inits += more_inits
        ffn_edges = {"x": f"l{i}.x_ffn", "out": f"l{i}.ffn_out"}
        more_nodes, more_inits = _renamed(build_dense_graph(gguf, cfg, i).graph,
                                          lambda name, i=i, edges=ffn_edges: edges.get(name, f"l{i}.ffn.{name}"))
        nodes += more_nodes
        inits += more_inits
    # The head reads the last position only: a prefill needs no logits for the others.
    inits += [numpy_helper.from_array(np.array([-1], np.int64), "last_start"),
              numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "last_end"),
              numpy_helper.from_array(np.array([0], np.int64), "last_axis")]
    nodes += [helper.make_node("Slice", [f"l{n - 1}.h_out", "last_start", "last_end", "last_axis"], ["h_last"]),
              helper.make_node("Slice", [f"l{n - 1}.ffn_out", "last_start", "last_end", "last_axis"], ["f_last"])]
    head_edges = {"h": "h_last", "f": "f_last", "logits": "logits"}
    more_nodes, more_inits = _renamed(build_head_graph(gguf, cfg).graph,
                                      lambda name: head_edges.get(name, f"head.{name}"))
    nodes += more_nodes
    inits += more_inits

    cache = [1, cfg.n_kv_heads, "C", cfg.head_dim]
    inputs = [helper.make_tensor_value_info("h", FLOAT, ["T", cfg.hidden]),
              helper.make_tensor_value_info("f0", FLOAT, ["T", cfg.hidden])]
    outputs = [helper.make_tensor_value_info("logits", FLOAT, [1, cfg.vocab_size])]
    for i in range(n):
        inputs += [helper.make_tensor_value_info(f"past_key{i}", FLOAT, cache),
                   helper.make_tensor_value_info(f"past_value{i}", FLOAT, cache)]
        outputs += [helper.make_tensor_value_info(f"present_key{i}", FLOAT, cache),
                    helper.make_tensor_value_info(f"present_value{i}", FLOAT, cache)]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
    for t in range(len(bases)):
        inputs += [helper.make_tensor_value_info(f"cos{t}", FLOAT, ["P", cfg.head_dim // 2]),
                   helper.make_tensor_value_info(f"sin{t}", FLOAT, ["P", cfg.head_dim // 2])]
    return make_model(nodes, inits, inputs, outputs, "decoder")


class OnnxDecoder:
    """The whole-model graph of one model, checked/exported at load, its session made on first use."""

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path,
                 threads: int = 2, progress: Progress | None = None):
        self.config = config
        self.bases = rope_bases(config)
        self.directory = Path(onnx_root) / checksum
        store = GraphStore(self.directory, MANIFEST, DECODER_EXPORT_FORMAT, progress)
        self.rebuilt = store.rebuilt
        build = partial(build_decoder_graph, gguf, config)
        store.ensure(FILE, build, "Exporting the whole-model decoder graph to ONNX", optimized=True)
        store.save()
        # One session doing all the work: its threads should spin between the ~800 kernels of a step rather
        # than sleep and be woken for each (77 vs 55 tok/s on SmolLM2 with a pool of its own).
        self._sessions = LazySessions(store, [(FILE, build)], partial(session_options, threads, spinning=True),
                                      optimized=True)
        self._local = threading.local()
        self._zeros = ZeroRows(config.hidden)   # layer 0's "previous FFN output"

    def load_sessions(self, progress: Progress | None = None) -> None:
        self._sessions.load_all(progress, "Loading the decoder graph")

    def run(self, h: np.ndarray, start: int, kv, rope) -> np.ndarray:
        """Logits (1, vocab) of the last of the T positions h (T, d) after kv's `start` tokens; writes rows
        start..start+T of every layer's keys/values in place (kv has room: the caller reserved it)."""
        state = getattr(self._local, "state", None)
        if state is None:     # per thread: bindings are not thread-safe, sessions are
            state = self._local.state = _DecoderBinding(Binding(self._sessions[0]), self.config)
        T = h.shape[0]
        state.bind_cache(kv)
        state.seqlens[0] = start + T - 1
        state.total[()] = start + T
        b = state.binding
        for t, base in enumerate(self.bases):
            cos, sin = rope.table(base, start + T)
            b.bind_input(f"cos{t}", cos)
            b.bind_input(f"sin{t}", sin)
        b.bind_input("h", np.ascontiguousarray(h, dtype=np.float32))
        b.bind_input("f0", self._zeros(T))
        logits = np.empty((1, self.config.vocab_size), np.float32)
        b.bind_output("logits", logits)
        b.run()
        return logits


class _DecoderBinding:
    def __init__(self, binding: Binding, config: ModelConfig):
        self.binding = binding
        self.config = config
        self.seqlens = np.zeros(1, np.int32)     # updated in place, bound once
        self.total = np.zeros((), np.int32)
        binding.bind_input("seqlens_k", self.seqlens)
        binding.bind_input("total_len", self.total)
        self._cache_arrays: list = []

    def bind_cache(self, kv) -> None:
        """Bind every layer's keys/values as (1, KV, cap, hd) views, past and present alike; only when the
        cache changed (another session's, or this one grew)."""
        arrays = [*kv.keys, *kv.values]
        if len(arrays) == len(self._cache_arrays) and all(a is b for a, b in zip(arrays, self._cache_arrays)):
            return
        b = self.binding
        for i in range(self.config.n_layers):
            keys, values = kv.keys[i][None], kv.values[i][None]
            b.bind_input(f"past_key{i}", keys)
            b.bind_input(f"past_value{i}", values)
            b.bind_output(f"present_key{i}", keys)
            b.bind_output(f"present_value{i}", values)
        self._cache_arrays = arrays
