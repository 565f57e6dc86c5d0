"""The whole model in one ONNX graph: every layer's attention and dense FFN, then the output head.

The per-layer graphs (graphs/blocks.py + graphs/ffn.py) cost two onnxruntime calls per layer and more for the walk, so
a SmolLM2 decode step is 61 calls whose fixed costs (dispatch, waking the thread pool, binding) rival the matmuls.
When every layer would run the plain dense FFN there is nothing to do between layers, so this graph runs them
all in one call. Same kernels, 2 threads: SmolLM2 decode 46-50 -> 92-97 tok/s, Gemma 3 270M 35 -> 46 tok/s.

It is composed from the very graphs the per-layer path runs (build_layer_graph, build_dense_graph,
build_head_graph), each tensor renamed into its layer's namespace and wired output to input, so both paths
compute the same thing node for node. Inputs: the embeddings h (T, d), zeros f0 (T, d) for layer 0's "previous
FFN output", every layer's KV cache (bound as past and present, written in place), seqlens_k/total_len and one
cos/sin table per rope base. Output: the logits of the last position (1, vocab).

The served decoder is the same composition for a decode step whose every FFN output is known in advance: the
walk's cache hits, guessed from the key trace (cache/trace.py) before the step runs. It computes attention and
the gate scores of every layer with the given FFN outputs in between, and hands back each layer's FFN input
and scores, from which the walk checks that every guessed entry is the one a lookup would have served.

The replay decoder is the served decoder without the gate: for a step expected to repeat one the cache saw bit
for bit (a regenerated reply, the same prompt again), where each layer's FFN input equals the input its entry
was computed from. There the gate scores, the selection and the key are the entry's by construction (the same
graphs on the same input), so nothing needs them: the step costs attention alone, and the walk serves each layer
whose input it finds equal to its entry's, bit for bit (cache/stepper.py `settle_replayed_step`).

The walked decoder is the same composition for a decode step of the walk FFN whose entries are not known in
advance (the cache off, or a cold cache): every layer runs the top-K walk graph (selection inside it), and the
step hands back each layer's FFN input, scores, selection and output, from which the walk makes the keys, looks
them up and stores the misses after the call (cache/stepper.py `settle_walked_step`). Layer by layer such a step
is 61 calls (attention with the gate, then the walk, per layer, and the head) with Python between them: on
SmolLM2 the cache-off walk decoded at 72 tok/s that way and at 95 in one call (`bench`, 2 threads).

None of the served, replay and walked decoders holds the output head: the model runs the per-layer path's head
graph after them (one more call, a few tens of microseconds), so a walk keeps one copy of the head in memory where
it kept four (Gemma 3's tied head is 170 MB of Q8_0).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from larql_desktop.engine.graphs.blocks import BLOCK_EXPORT_FORMAT, build_head_graph, build_layer_graph
from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.graphs.ffn import (EXPORT_FORMAT as FFN_EXPORT_FORMAT, build_dense_graph, build_walk_threshold_graph,
                                             build_walk_top_k_graph)
from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.graphs.store import Binding, GraphStore, LazySessions, Progress, ZeroRows, make_model, session_options
from larql_desktop.engine.graphs.onnx_deferred import FLOAT

if TYPE_CHECKING:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
else:
    from larql_desktop.engine.graphs.onnx_deferred import TensorProto, helper, numpy_helper, onnx

# The decoder is rebuilt whenever the graphs it is made of change.
# 2: no head in served/walked; 3: the walked decoders select by threshold
DECODER_EXPORT_FORMAT = f"decoder3-blocks{BLOCK_EXPORT_FORMAT}-ffn{FFN_EXPORT_FORMAT}"
MANIFEST = "decoder.manifest.json"
FILE = "decoder.onnx"
SERVED_FILE = "decoder.served.onnx"
REPLAY_FILE = "decoder.replay.onnx"
WALKED_FILE = "decoder.walked.onnx"


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


def _layer(gguf: GgufFile, cfg: ModelConfig, i: int, f_in: str, gated: bool) -> tuple[list, list]:
    """Layer i's graph (build_layer_graph; the gated one, also giving "l{i}.scores", if `gated`), each tensor
    renamed into the namespace "l{i}." and wired to the shared inputs; `f_in` names what it reads as "f" (the
    previous layer's FFN output)."""
    table = rope_bases(cfg).index(cfg.rope_base_for(i))
    edges = {"h": "h" if i == 0 else f"l{i - 1}.h_out", "f": f_in,
             "seqlens_k": "seqlens_k", "total_len": "total_len", "cos": f"cos{table}", "sin": f"sin{table}",
             "past_key": f"past_key{i}", "past_value": f"past_value{i}",
             "present_key": f"present_key{i}", "present_value": f"present_value{i}"}
    return _renamed(build_layer_graph(gguf, cfg, i, gated=gated).graph, lambda name: edges.get(name, f"l{i}.{name}"))


def head_nodes(gguf: GgufFile, cfg: ModelConfig, h: str, f: str) -> tuple[list, list]:
    head_edges = {"h": h, "f": f, "logits": "logits"}
    return _renamed(build_head_graph(gguf, cfg).graph, lambda name: head_edges.get(name, f"head.{name}"))


def _cache_and_rope_io(cfg: ModelConfig) -> tuple[list, list]:
    """The inputs and outputs every decoder graph shares: the KV caches (past and present), seqlens_k/total_len
    and one cos/sin table per rope base."""
    cache = [1, cfg.n_kv_heads, "C", cfg.head_dim]
    inputs, outputs = [], []
    for i in range(cfg.n_layers):
        inputs += [helper.make_tensor_value_info(f"past_key{i}", FLOAT, cache),
                   helper.make_tensor_value_info(f"past_value{i}", FLOAT, cache)]
        outputs += [helper.make_tensor_value_info(f"present_key{i}", FLOAT, cache),
                    helper.make_tensor_value_info(f"present_value{i}", FLOAT, cache)]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
    for t in range(len(rope_bases(cfg))):
        inputs += [helper.make_tensor_value_info(f"cos{t}", FLOAT, ["P", cfg.head_dim // 2]),
                   helper.make_tensor_value_info(f"sin{t}", FLOAT, ["P", cfg.head_dim // 2])]
    return inputs, outputs


def layers_with_ffn(gguf: GgufFile, cfg: ModelConfig, build_ffn, shared: tuple[str, ...] = ()) -> tuple[list, list]:
    """Every layer's graph (not gated) followed by its FFN graph `build_ffn(gguf, cfg, layer)`, each FFN tensor
    renamed into "l{i}.ffn." and wired from the layer's "x_ffn" to its "ffn_out", which the next layer reads;
    the FFN inputs named in `shared` keep their names (one input of the whole graph)."""
    nodes, inits = [], []
    for i in range(cfg.n_layers):
        more_nodes, more_inits = _layer(gguf, cfg, i, "f0" if i == 0 else f"l{i - 1}.ffn_out", gated=False)
        nodes += more_nodes
        inits += more_inits
        ffn_edges = {"x": f"l{i}.x_ffn", "out": f"l{i}.ffn_out", **{name: name for name in shared}}
        more_nodes, more_inits = _renamed(build_ffn(gguf, cfg, i).graph,
                                          lambda name, i=i, edges=ffn_edges: edges.get(name, f"l{i}.ffn.{name}"))
        nodes += more_nodes
        inits += more_inits
    return nodes, inits


def build_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    n = cfg.n_layers
    nodes, inits = layers_with_ffn(gguf, cfg, build_dense_graph)
    # The head reads the last position only: a prefill needs no logits for the others.
    inits += [numpy_helper.from_array(np.array([-1], np.int64), "last_start"),
              numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "last_end"),
              numpy_helper.from_array(np.array([0], np.int64), "last_axis")]
    nodes += [helper.make_node("Slice", [f"l{n - 1}.h_out", "last_start", "last_end", "last_axis"], ["h_last"]),
              helper.make_node("Slice", [f"l{n - 1}.ffn_out", "last_start", "last_end", "last_axis"], ["f_last"])]
    more_nodes, more_inits = head_nodes(gguf, cfg, "h_last", "f_last")
    nodes += more_nodes
    inits += more_inits
    cache_inputs, cache_outputs = _cache_and_rope_io(cfg)
    inputs = [helper.make_tensor_value_info("h", FLOAT, ["T", cfg.hidden]),
              helper.make_tensor_value_info("f0", FLOAT, ["T", cfg.hidden])] + cache_inputs
    outputs = [helper.make_tensor_value_info("logits", FLOAT, [1, cfg.vocab_size])] + cache_outputs
    return make_model(nodes, inits, inputs, outputs, "decoder")


def _served_layers(gguf: GgufFile, cfg: ModelConfig, gated: bool) -> tuple[list, list]:
    """Every layer's graph with layer i's FFN output read from row i of the input "served" (n, d)."""
    n = cfg.n_layers
    nodes = [helper.make_node("Split", ["served"], [f"served{i}" for i in range(n)], axis=0, num_outputs=n)]
    inits = []
    for i in range(n):
        more_nodes, more_inits = _layer(gguf, cfg, i, "f0" if i == 0 else f"served{i - 1}", gated=gated)
        nodes += more_nodes
        inits += more_inits
    return nodes, inits


def served_pass_nodes(gguf: GgufFile, cfg: ModelConfig) -> tuple[list, list]:
    """The served decoder's nodes: every gated layer with layer i's FFN output read from the i-th of n equal
    parts of the input "served" (layer-major rows), gathered layer-major into "inputs", "scores", "residuals"
    and "settled" (selection_check_nodes of the input "selections"). With one row per layer this is the served
    decoder; with B (graphs/batched.py), row b of layer i at i * B + b, the batched one."""
    n = cfg.n_layers
    nodes, inits = _served_layers(gguf, cfg, gated=True)
    for name, part in (("inputs", "x_ffn"), ("scores", "scores"), ("residuals", "h_out")):
        nodes.append(helper.make_node("Concat", [f"l{i}.{part}" for i in range(n)], [name], axis=0))
    nodes += selection_check_nodes(inits)
    return nodes, inits


def replay_pass_nodes(gguf: GgufFile, cfg: ModelConfig) -> tuple[list, list]:
    """The replay decoder's nodes: as served_pass_nodes without the gate and the selection check, gathering
    "inputs" and "residuals"."""
    n = cfg.n_layers
    nodes, inits = _served_layers(gguf, cfg, gated=False)
    for name, part in (("inputs", "x_ffn"), ("residuals", "h_out")):
        nodes.append(helper.make_node("Concat", [f"l{i}.{part}" for i in range(n)], [name], axis=0))
    return nodes, inits


def build_served_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """One decode step (T = 1) with every layer's FFN output given rather than computed: the walk FFN's cache
    hits for a whole token in one call. Input "served" (n_layers, d): row i is layer i's FFN output (a cached
    entry). Outputs besides the KV rows, one row per layer: "inputs" (n, d) the normed FFN inputs
    and "scores" (n, F) their gate scores (what the walk checks each served entry against: its key and its hit
    rule), "residuals" (n, d) the residuals after each layer's attention (where a pass resumes when a served
    entry turns out not to apply). Composed from the gated layer graphs, so every tensor is computed by the same
    nodes as in the per-layer path; the head graph runs after it."""
    n = cfg.n_layers
    nodes, inits = served_pass_nodes(gguf, cfg)
    cache_inputs, cache_outputs = _cache_and_rope_io(cfg)
    inputs = [helper.make_tensor_value_info("h", FLOAT, [1, cfg.hidden]),
              helper.make_tensor_value_info("f0", FLOAT, [1, cfg.hidden]),
              helper.make_tensor_value_info("served", FLOAT, [n, cfg.hidden]),
              helper.make_tensor_value_info("selections", TensorProto.BOOL, [n, cfg.intermediate])] + cache_inputs
    outputs = [helper.make_tensor_value_info("inputs", FLOAT, [n, cfg.hidden]),
               helper.make_tensor_value_info("scores", FLOAT, [n, cfg.intermediate]),
               helper.make_tensor_value_info("residuals", FLOAT, [n, cfg.hidden]),
               helper.make_tensor_value_info("settled", TensorProto.BOOL, [n])] + cache_outputs
    return make_model(nodes, inits, inputs, outputs, "served_decoder")


def build_replay_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """The served decoder without the gate and the selection check: one decode step (T = 1) with every layer's
    FFN output given ("served", (n, d)), for a step whose FFN inputs are expected to equal, bit for bit, those
    the entries were computed from. Outputs besides the KV rows: "inputs" (n, d) the normed FFN inputs (what
    the walk compares with the entries' own) and "residuals" (n, d). Composed from the layer graphs the dense
    per-layer path runs; the head graph runs after it."""
    n = cfg.n_layers
    nodes, inits = replay_pass_nodes(gguf, cfg)
    cache_inputs, cache_outputs = _cache_and_rope_io(cfg)
    inputs = [helper.make_tensor_value_info("h", FLOAT, [1, cfg.hidden]),
              helper.make_tensor_value_info("f0", FLOAT, [1, cfg.hidden]),
              helper.make_tensor_value_info("served", FLOAT, [n, cfg.hidden])] + cache_inputs
    outputs = [helper.make_tensor_value_info("inputs", FLOAT, [n, cfg.hidden]),
               helper.make_tensor_value_info("residuals", FLOAT, [n, cfg.hidden])] + cache_outputs
    return make_model(nodes, inits, inputs, outputs, "replay_decoder")


def build_walked_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """One decode step (T = 1) of the walk FFN at every layer: each layer's top-K walk graph (gate, selection,
    mask, up and down; K is the input "k") in place of the dense FFN. Outputs besides the KV rows, one row per
    layer: "inputs" (n, d) the normed FFN inputs, "scores" (n, F) their gate scores,
    "selections" (n, F) bool the features each layer summed, "outputs" (n, d) the FFN outputs, "residuals"
    (n, d) the residuals after attention, and "settled" (n,) whether the selection is the only top K of the
    scores (no tie at the K-th place, no NaN: where it is, the walk's own selection is the same set; where it is
    not, the layer's selection and output are not the walk's, and the walk computes that layer itself).
    Composed from the layer graphs and the top-K walk graphs the per-layer path runs (selecting by threshold,
    which is their selection wherever a layer is settled); the head graph runs after."""
    n = cfg.n_layers
    nodes, inits = layers_with_ffn(gguf, cfg, build_walk_threshold_graph, shared=("k",))
    nodes += walked_pass_nodes(n, inits)
    cache_inputs, cache_outputs = _cache_and_rope_io(cfg)
    inputs = [helper.make_tensor_value_info("h", FLOAT, [1, cfg.hidden]),
              helper.make_tensor_value_info("f0", FLOAT, [1, cfg.hidden]),
              helper.make_tensor_value_info("k", TensorProto.INT64, [1])] + cache_inputs
    outputs = [helper.make_tensor_value_info("inputs", FLOAT, [n, cfg.hidden]),
               helper.make_tensor_value_info("scores", FLOAT, [n, cfg.intermediate]),
               helper.make_tensor_value_info("selections", TensorProto.BOOL, [n, cfg.intermediate]),
               helper.make_tensor_value_info("outputs", FLOAT, [n, cfg.hidden]),
               helper.make_tensor_value_info("residuals", FLOAT, [n, cfg.hidden]),
               helper.make_tensor_value_info("settled", TensorProto.BOOL, [n])] + cache_outputs
    return make_model(nodes, inits, inputs, outputs, "walked_decoder")


def walked_pass_nodes(n: int, inits: list) -> list:
    """The walked decoder's outputs gathered from its `n` layers (their FFNs build_walk_threshold_graph's),
    layer-major: "inputs", "scores", "outputs", "residuals", "selections" (bool) and "settled"
    (threshold_check_nodes)."""
    nodes = [helper.make_node("Concat", [f"l{i}.{part}" for i in range(n)], [name], axis=0)
             for name, part in (("inputs", "x_ffn"), ("scores", "ffn.scores"), ("outputs", "ffn_out"),
                                ("residuals", "h_out"), ("selection_weights", "ffn.mask"))]
    nodes.append(helper.make_node("Cast", ["selection_weights"], ["selections"], to=TensorProto.BOOL))
    return nodes + threshold_check_nodes(inits)


def threshold_check_nodes(inits: list) -> list:
    """"settled" (rows,): per layer row, whether its threshold selection ("selection_weights", 0/1 floats) holds
    exactly "k" features and its "scores" no NaN. A threshold selection of k features is the scores' only top
    k (no tie at the k-th place), so it is the exact rule's; at a tie it holds more. The NaN test sums the row
    (a NaN or +inf beside -inf makes the sum NaN: such a row is left to the walk too)."""
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "check_axis"))
    return [
        helper.make_node("ReduceSum", ["selection_weights", "check_axis"], ["check_count"], keepdims=0),
        helper.make_node("Cast", ["k"], ["check_k"], to=TensorProto.FLOAT),
        helper.make_node("Equal", ["check_count", "check_k"], ["check_exact"]),
        helper.make_node("ReduceSum", ["scores", "check_axis"], ["check_total"], keepdims=0),
        helper.make_node("IsNaN", ["check_total"], ["check_nan"]),
        helper.make_node("Not", ["check_nan"], ["check_finite"]),
        helper.make_node("And", ["check_exact", "check_finite"], ["settled"]),
    ]


def mixed_pass_nodes(gguf: GgufFile, cfg: ModelConfig) -> tuple[list, list]:
    """The walked and the served decoder in one graph, row by row (graphs/batched.py's mixed decoder): every layer
    gated (its "scores" as the served decoder's) and followed by the top-K walk graph (the exact TopK selection:
    the selection check below is the served rows' and holds for it);
    where the input "given" (rows, 1) is true, the layer's FFN output is the row's part of "served" (layer-major,
    as served_pass_nodes reads it) and its scores and selection the gated layer's and the row's part of the input
    "selections_in" (layer-major too), elsewhere the walk's. Gathered as walked_pass_nodes gathers them:
    "inputs", "scores", "selections", "outputs", "residuals", "settled"."""
    n = cfg.n_layers
    nodes = [helper.make_node("Split", ["served"], [f"served{i}" for i in range(n)], axis=0, num_outputs=n),
             helper.make_node("Split", ["selections_in"], [f"guessed{i}" for i in range(n)], axis=0, num_outputs=n)]
    inits: list = []
    for i in range(n):
        more_nodes, more_inits = _layer(gguf, cfg, i, "f0" if i == 0 else f"l{i - 1}.ffn_out", gated=True)
        nodes += more_nodes
        inits += more_inits
        edges = {"x": f"l{i}.x_ffn", "out": f"l{i}.walk_out", "k": "k"}
        more_nodes, more_inits = _renamed(build_walk_top_k_graph(gguf, cfg, i).graph,
                                          lambda name, edges=edges, i=i: edges.get(name, f"l{i}.ffn.{name}"))
        nodes += more_nodes
        inits += more_inits
        nodes += [helper.make_node("Where", ["given", f"served{i}", f"l{i}.walk_out"], [f"l{i}.ffn_out"]),
                  helper.make_node("Where", ["given", f"l{i}.scores", f"l{i}.ffn.scores"], [f"l{i}.mixed_scores"]),
                  # (Where takes no bool tensors on the CPU: the selections are chosen as the walk's mask weights)
                  helper.make_node("Cast", [f"guessed{i}"], [f"l{i}.guessed_weights"], to=TensorProto.FLOAT),
                  helper.make_node("Where", ["given", f"l{i}.guessed_weights", f"l{i}.ffn.mask"],
                                   [f"l{i}.mixed_selection"])]
    nodes += [helper.make_node("Concat", [f"l{i}.{part}" for i in range(n)], [name], axis=0)
              for name, part in (("inputs", "x_ffn"), ("scores", "mixed_scores"), ("outputs", "ffn_out"),
                                 ("residuals", "h_out"), ("selection_weights", "mixed_selection"))]
    nodes.append(helper.make_node("Cast", ["selection_weights"], ["selections"], to=TensorProto.BOOL))
    nodes += selection_check_nodes(inits)
    return nodes, inits


def selection_check_nodes(inits: list) -> list:
    """"settled" (n,): per layer, whether the guessed selection ("selections", (n, F) bool) is exactly the top
    |selection| features of the layer's scores by magnitude with no tie at the boundary (its weakest selected
    magnitude above its strongest unselected one) and no NaN among the scores. Where it is, the key of the
    scores is the guessed key whatever the tie rule; elsewhere the walk makes the key itself. (numpy's masked
    reductions cost ~0.4 ms for SmolLM2's 30 x 1536 scores; these nodes a few microseconds.)"""
    inits += [numpy_helper.from_array(np.array(np.inf, np.float32), "check_inf"),
              numpy_helper.from_array(np.array(-1.0, np.float32), "check_below"),
              numpy_helper.from_array(np.array([1], np.int64), "check_axis")]
    return [
        helper.make_node("Abs", ["scores"], ["check_magnitudes"]),
        helper.make_node("Where", ["selections", "check_magnitudes", "check_inf"], ["check_in"]),
        helper.make_node("ReduceMin", ["check_in", "check_axis"], ["check_weakest_in"], keepdims=0),
        helper.make_node("Where", ["selections", "check_below", "check_magnitudes"], ["check_out"]),
        helper.make_node("ReduceMax", ["check_out", "check_axis"], ["check_strongest_out"], keepdims=0),
        helper.make_node("Greater", ["check_weakest_in", "check_strongest_out"], ["check_separated"]),
        helper.make_node("IsNaN", ["scores"], ["check_nan"]),
        helper.make_node("Cast", ["check_nan"], ["check_nan_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["check_nan_f", "check_axis"], ["check_nan_rows"], keepdims=0),
        helper.make_node("Cast", ["check_nan_rows"], ["check_nan_any"], to=TensorProto.BOOL),
        helper.make_node("Not", ["check_nan_any"], ["check_finite"]),
        helper.make_node("And", ["check_separated", "check_finite"], ["settled"]),
    ]


@dataclass(frozen=True)
class ServedPass:
    """What one call of the served decoder graph computed, per layer (rows): the normed FFN inputs (n, d), their
    gate scores (n, F), the residuals after attention (n, d) and whether the guessed selection is the scores'
    own. (The logits are the head graph's of the last residual and FFN output: the model runs it after the call,
or a batch of rows once for them all, handing them in as `logits`.)"""
    inputs: np.ndarray
    scores: np.ndarray
    residuals: np.ndarray
    settled: np.ndarray     # (n,) bool: the guessed selection is the scores' top K, no tie at the K-th place
    logits: np.ndarray | None = None    # (1, vocab) the head's, when the caller ran it (a batch, for all rows)


@dataclass(frozen=True)
class ReplayPass:
    """What one call of the replay decoder graph computed, per layer (rows): the normed FFN inputs (n, d) and
    the residuals after attention (n, d). No gate scores: a layer that needs them computes them itself."""
    inputs: np.ndarray
    residuals: np.ndarray
    logits: np.ndarray | None = None    # as ServedPass's
    scores = None


@dataclass(frozen=True)
class WalkedPass:
    """What one call of the walked decoder graph computed, per layer (rows): the normed FFN inputs (n, d), their
    gate scores (n, F), the features summed (n, F) bool, the FFN outputs (n, d), the residuals after attention
    (n, d) and whether each selection is the scores' only top K (where not, that layer's selection and output
    are not the walk's: see build_walked_decoder_graph). (The logits: as for ServedPass.)"""
    inputs: np.ndarray
    scores: np.ndarray
    selections: np.ndarray
    outputs: np.ndarray
    residuals: np.ndarray
    settled: np.ndarray
    logits: np.ndarray | None = None    # as ServedPass's


class OnnxDecoder:
    """The whole-model graphs of one model, checked/exported at load, their sessions made on first use: the
    dense decoder (every layer's dense FFN computed), the served decoder (every layer's FFN output given) and
    the walked decoder (every layer's top-K walk computed)."""

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path,
                 threads: int = 2, progress: Progress | None = None):
        self.config = config
        self.bases = rope_bases(config)
        self.directory = Path(onnx_root) / checksum
        store = GraphStore(self.directory, MANIFEST, DECODER_EXPORT_FORMAT, progress)
        self.rebuilt = store.rebuilt
        build = partial(build_decoder_graph, gguf, config)
        store.ensure(FILE, build, "Exporting the whole-model decoder graph to ONNX", optimized=True)
        build_served = partial(build_served_decoder_graph, gguf, config)
        store.ensure(SERVED_FILE, build_served, "Exporting the served decoder graph to ONNX", 0.4, optimized=True)
        build_replay = partial(build_replay_decoder_graph, gguf, config)
        store.ensure(REPLAY_FILE, build_replay, "Exporting the replay decoder graph to ONNX", 0.55, optimized=True)
        build_walked = partial(build_walked_decoder_graph, gguf, config)
        store.ensure(WALKED_FILE, build_walked, "Exporting the walked decoder graph to ONNX", 0.7, optimized=True)
        store.save()
        # One session doing all the work: its threads should spin between the ~800 kernels of a step rather
        # than sleep and be woken for each (77 vs 55 tok/s on SmolLM2 with a pool of its own).
        opts = partial(session_options, threads, spinning=True)
        self._sessions = LazySessions(store, [(FILE, build)], opts, optimized=True)
        self._served = LazySessions(store, [(SERVED_FILE, build_served)], opts, optimized=True)
        self._replay = LazySessions(store, [(REPLAY_FILE, build_replay)], opts, optimized=True)
        self._walked = LazySessions(store, [(WALKED_FILE, build_walked)], opts, optimized=True)
        self._local = threading.local()
        self._zeros = ZeroRows(config.hidden)   # layer 0's "previous FFN output"

    def load_sessions(self, progress: Progress | None = None, walk: bool = False) -> None:
        """Create the dense decoder's session now, or with `walk` the served, replay and walked decoders' (what a
        walk runs)."""
        if walk:
            self._served.load_all(progress, "Loading the served decoder graph")
            self._replay.load_all(progress, "Loading the replay decoder graph")
            self._walked.load_all(progress, "Loading the walked decoder graph")
        else:
            self._sessions.load_all(progress, "Loading the decoder graph")

    def _bindings(self) -> "_ThreadBindings":
        state = getattr(self._local, "state", None)
        if state is None:     # per thread: bindings are not thread-safe, sessions are
            state = self._local.state = _ThreadBindings(
                {"dense": self._sessions, "served": self._served, "replay": self._replay,
                 "walked": self._walked}, self.config)
        return state

    def _bind_step(self, b: "_DecoderBinding", h: np.ndarray, start: int, kv, rope) -> None:
        T = h.shape[0]
        b.bind_cache(kv)
        b.seqlens[0] = start + T - 1
        b.total[()] = start + T
        for t, base in enumerate(self.bases):
            cos, sin = rope.table(base, start + T)
            b.binding.bind_input(f"cos{t}", cos)
            b.binding.bind_input(f"sin{t}", sin)
        b.binding.bind_input("h", np.ascontiguousarray(h, dtype=np.float32))
        b.binding.bind_input("f0", self._zeros(T))

    def run(self, h: np.ndarray, start: int, kv, rope) -> np.ndarray:
        """Logits (1, vocab) of the last of the T positions h (T, d) after kv's `start` tokens; writes rows
        start..start+T of every layer's keys/values in place (kv has room: the caller reserved it)."""
        b = self._bindings().dense
        self._bind_step(b, h, start, kv, rope)
        logits = np.empty((1, self.config.vocab_size), np.float32)
        b.binding.bind_output("logits", logits)
        b.binding.run()
        return logits

    def run_served(self, h: np.ndarray, start: int, kv, rope, served: np.ndarray,
                   selections: np.ndarray) -> ServedPass:
        """One decode step, h (1, d) at position `start`, with layer i's FFN output taken from served[i]
        (n, d) rather than computed; `selections` (n, F) bool: the features each layer is guessed to select.
        Writes row `start` of every layer's keys/values in place."""
        b = self._bindings().served
        self._bind_step(b, h, start, kv, rope)
        cfg = self.config
        n = cfg.n_layers
        out = ServedPass(np.empty((n, cfg.hidden), np.float32), np.empty((n, cfg.intermediate), np.float32),
                         np.empty((n, cfg.hidden), np.float32), np.empty(n, bool))
        b.binding.bind_input("served", np.ascontiguousarray(served, dtype=np.float32))
        b.binding.bind_input("selections", np.ascontiguousarray(selections, dtype=bool))
        for name in ("inputs", "scores", "residuals", "settled"):
            b.binding.bind_output(name, getattr(out, name))
        b.binding.run()
        return out

    def run_replay(self, h: np.ndarray, start: int, kv, rope, served: np.ndarray) -> ReplayPass:
        """One decode step, h (1, d) at position `start`, with layer i's FFN output taken from served[i] (n, d)
        and no gate computed. Writes row `start` of every layer's keys/values in place."""
        b = self._bindings().replay
        self._bind_step(b, h, start, kv, rope)
        cfg = self.config
        out = ReplayPass(np.empty((cfg.n_layers, cfg.hidden), np.float32),
                         np.empty((cfg.n_layers, cfg.hidden), np.float32))
        b.binding.bind_input("served", np.ascontiguousarray(served, dtype=np.float32))
        b.binding.bind_output("inputs", out.inputs)
        b.binding.bind_output("residuals", out.residuals)
        b.binding.run()
        return out

    def run_walked(self, h: np.ndarray, start: int, kv, rope, k: int) -> WalkedPass:
        """One decode step, h (1, d) at position `start`, with the top-`k` walk FFN at every layer. Writes row
        `start` of every layer's keys/values in place."""
        b = self._bindings().walked
        self._bind_step(b, h, start, kv, rope)
        b.k[0] = k
        cfg = self.config
        n = cfg.n_layers
        arrays = {"inputs": np.empty((n, cfg.hidden), np.float32),
                  "scores": np.empty((n, cfg.intermediate), np.float32),
                  "selections": np.empty((n, cfg.intermediate), bool),
                  "outputs": np.empty((n, cfg.hidden), np.float32),
                  "residuals": np.empty((n, cfg.hidden), np.float32),
                  "settled": np.empty(n, bool)}
        for name, array in arrays.items():
            b.binding.bind_output(name, array)
        b.binding.run()
        return WalkedPass(**arrays)


class _ThreadBindings:
    """One thread's bindings of the decoder sessions, each made on its first use."""

    def __init__(self, sessions: dict[str, LazySessions], config: ModelConfig):
        self._sessions = sessions
        self._config = config
        self._made: dict[str, _DecoderBinding] = {}

    def _get(self, kind: str) -> "_DecoderBinding":
        b = self._made.get(kind)
        if b is None:
            b = self._made[kind] = _DecoderBinding(Binding(self._sessions[kind][0]), self._config)
        return b

    @property
    def dense(self) -> "_DecoderBinding":
        return self._get("dense")

    @property
    def served(self) -> "_DecoderBinding":
        return self._get("served")

    @property
    def replay(self) -> "_DecoderBinding":
        return self._get("replay")

    @property
    def walked(self) -> "_DecoderBinding":
        b = self._get("walked")
        if b.k is None:                          # bound once: run_walked updates it in place
            b.k = np.zeros(1, np.int64)
            b.binding.bind_input("k", b.k)
        return b


class _DecoderBinding:
    def __init__(self, binding: Binding, config: ModelConfig):
        self.binding = binding
        self.config = config
        self.seqlens = np.zeros(1, np.int32)     # updated in place, bound once
        self.total = np.zeros((), np.int32)
        binding.bind_input("seqlens_k", self.seqlens)
        binding.bind_input("total_len", self.total)
        self.k: np.ndarray | None = None         # the walked decoder's K
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
