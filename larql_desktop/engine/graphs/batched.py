"""The whole-model decoders for B sequences at once: one decode step (one token) of every row in one call.

Concurrent API requests decode together this way (engine/model/batch.py): the weights are read once per step for
all rows, so B rows cost little more than one on a memory-bound CPU. It is graphs/decoder.py's dense decoder
composition (the same layer, dense FFN and head graphs, node for node) with the batch on the first axis:

  inputs   h (B, d) each row's embedded token, f0 (B, d) zeros, every layer's KV cache (B, kv_heads, C, hd)
           (bound as past and present: each row's new keys/values land in place at its own position),
           seqlens_k (B,) each row's position, total_len the largest position + 1, one cos/sin table per rope base
  output   logits (B, vocab)

Every node but attention works row by row already (norms, MatMulNBits with int8 activations quantised per row
block, the head). GroupQueryAttention takes the batch from the 3-D query: the layer graph folds its (T, d) rows
into one sequence (1, T, d); here each row is a sequence of its own (B, 1, d), whose rotary position and attended
keys come from its own seqlens_k (past keys 0..seqlens_k[b], the sliding window counted from there).

The batched walked decoder is graphs/decoder.py's walked decoder so batched (the top-K walk at every layer, K one
input for all rows): its per-layer outputs come layer-major, (n_layers * B, ...), row b of layer i at i * B + b;
`run_walked` hands back one decoder.WalkedPass per row, which the walk settles as it settles a single step.
The batched served and replay decoders are graphs/decoder.py's served and replay decoders so batched: the served
FFN outputs (and the served decoder's guessed selections) come in layer-major too, (n_layers * B, ...), each row
its own plan's; `run_served` and `run_replay` hand back one decoder.ServedPass / ReplayPass per row. The mixed
decoder runs walked rows and served rows in one call (decoder.mixed_pass_nodes: each row the walk or its given
outputs, by the input "given"), so a step whose rows want both costs one call, not two.
"""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.graphs.blocks import rows_as_sequences
from larql_desktop.engine.graphs.decoder import (DECODER_EXPORT_FORMAT, ReplayPass, ServedPass, WalkedPass,
                                                 head_nodes, layers_with_ffn, mixed_pass_nodes, replay_pass_nodes,
                                                 rope_bases, served_pass_nodes, walked_pass_nodes)
from larql_desktop.engine.graphs.ffn import build_dense_graph, build_walk_threshold_graph
from larql_desktop.engine.graphs.store import Binding, GraphStore, LazySessions, Progress, ZeroRows, make_model, session_options
from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.graphs.onnx_deferred import FLOAT

if TYPE_CHECKING:
    import onnx
    from onnx import TensorProto, helper
else:
    from larql_desktop.engine.graphs.onnx_deferred import TensorProto, helper, onnx

BATCHED_EXPORT_FORMAT = f"batched1-{DECODER_EXPORT_FORMAT}"
MANIFEST = "batched.manifest.json"
FILE = "decoder.batched.onnx"
WALKED_FILE = "decoder.batched_walked.onnx"
SERVED_FILE = "decoder.batched_served.onnx"
REPLAY_FILE = "decoder.batched_replay.onnx"
MIXED_FILE = "decoder.batched_mixed.onnx"


def _batched_io(cfg: ModelConfig) -> tuple[list, list]:
    """h, f0, the KV caches (past and present), seqlens_k/total_len and the rope tables, with B rows."""
    n = cfg.n_layers
    cache: list[str | int] = ["B", cfg.n_kv_heads, "C", cfg.head_dim]
    inputs = [helper.make_tensor_value_info("h", FLOAT, ["B", cfg.hidden]),
              helper.make_tensor_value_info("f0", FLOAT, ["B", cfg.hidden])]
    outputs = []
    for i in range(n):
        inputs += [helper.make_tensor_value_info(f"past_key{i}", FLOAT, cache),
                   helper.make_tensor_value_info(f"past_value{i}", FLOAT, cache)]
        outputs += [helper.make_tensor_value_info(f"present_key{i}", FLOAT, cache),
                    helper.make_tensor_value_info(f"present_value{i}", FLOAT, cache)]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
               helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
    for t in range(len(rope_bases(cfg))):
        inputs += [helper.make_tensor_value_info(f"cos{t}", FLOAT, ["P", cfg.head_dim // 2]),
                   helper.make_tensor_value_info(f"sin{t}", FLOAT, ["P", cfg.head_dim // 2])]
    return inputs, outputs


def build_batched_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    n = cfg.n_layers
    nodes, inits = layers_with_ffn(gguf, cfg, build_dense_graph)
    rows_as_sequences(inits)
    more_nodes, more_inits = head_nodes(gguf, cfg, f"l{n - 1}.h_out", f"l{n - 1}.ffn_out")
    nodes += more_nodes
    inits += more_inits
    inputs, outputs = _batched_io(cfg)
    outputs.insert(0, helper.make_tensor_value_info("logits", FLOAT, ["B", cfg.vocab_size]))
    return make_model(nodes, inits, inputs, outputs, "batched_decoder")


def build_batched_walked_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """The walked decoder (graphs/decoder.py) over B rows: outputs "inputs", "scores", "selections", "outputs",
    "residuals" (n * B, ...) and "settled" (n * B,), layer-major."""
    n = cfg.n_layers
    nodes, inits = layers_with_ffn(gguf, cfg, build_walk_threshold_graph, shared=("k",))
    rows_as_sequences(inits)
    nodes += walked_pass_nodes(n, inits)
    inputs, outputs = _batched_io(cfg)
    inputs.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    rows = "nB"
    outputs[:0] = [helper.make_tensor_value_info("inputs", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("scores", FLOAT, [rows, cfg.intermediate]),
                   helper.make_tensor_value_info("selections", TensorProto.BOOL, [rows, cfg.intermediate]),
                   helper.make_tensor_value_info("outputs", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("residuals", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("settled", TensorProto.BOOL, [rows])]
    return make_model(nodes, inits, inputs, outputs, "batched_walked_decoder")


def build_batched_served_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """The served decoder (graphs/decoder.py) over B rows: inputs "served" (n * B, d) and "selections" (n * B, F),
    outputs "inputs", "scores", "residuals" (n * B, ...) and "settled" (n * B,), layer-major."""
    nodes, inits = served_pass_nodes(gguf, cfg)
    rows_as_sequences(inits)
    inputs, outputs = _batched_io(cfg)
    rows = "nB"
    inputs += [helper.make_tensor_value_info("served", FLOAT, [rows, cfg.hidden]),
               helper.make_tensor_value_info("selections", TensorProto.BOOL, [rows, cfg.intermediate])]
    outputs[:0] = [helper.make_tensor_value_info("inputs", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("scores", FLOAT, [rows, cfg.intermediate]),
                   helper.make_tensor_value_info("residuals", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("settled", TensorProto.BOOL, [rows])]
    return make_model(nodes, inits, inputs, outputs, "batched_served_decoder")


def build_batched_replay_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """The replay decoder (graphs/decoder.py) over B rows: input "served" (n * B, d), outputs "inputs" and
    "residuals" (n * B, d), layer-major."""
    nodes, inits = replay_pass_nodes(gguf, cfg)
    rows_as_sequences(inits)
    inputs, outputs = _batched_io(cfg)
    rows = "nB"
    inputs.append(helper.make_tensor_value_info("served", FLOAT, [rows, cfg.hidden]))
    outputs[:0] = [helper.make_tensor_value_info("inputs", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("residuals", FLOAT, [rows, cfg.hidden])]
    return make_model(nodes, inits, inputs, outputs, "batched_replay_decoder")


def build_batched_mixed_decoder_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    """Walked and served rows in one call: the batched walked decoder's inputs and outputs, and "given" (B, 1)
    bool, "served" (n * B, d) and "selections_in" (n * B, F) for the rows whose FFN outputs are given."""
    nodes, inits = mixed_pass_nodes(gguf, cfg)
    rows_as_sequences(inits)
    inputs, outputs = _batched_io(cfg)
    rows = "nB"
    inputs += [helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
               helper.make_tensor_value_info("given", TensorProto.BOOL, ["B", 1]),
               helper.make_tensor_value_info("served", FLOAT, [rows, cfg.hidden]),
               helper.make_tensor_value_info("selections_in", TensorProto.BOOL, [rows, cfg.intermediate])]
    outputs[:0] = [helper.make_tensor_value_info("inputs", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("scores", FLOAT, [rows, cfg.intermediate]),
                   helper.make_tensor_value_info("selections", TensorProto.BOOL, [rows, cfg.intermediate]),
                   helper.make_tensor_value_info("outputs", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("residuals", FLOAT, [rows, cfg.hidden]),
                   helper.make_tensor_value_info("settled", TensorProto.BOOL, [rows])]
    return make_model(nodes, inits, inputs, outputs, "batched_mixed_decoder")


def _per_row(arrays: dict[str, np.ndarray], n: int, B: int) -> list[dict[str, np.ndarray]]:
    """Layer-major outputs (n * B, ...) as each row's (n, ...) arrays."""
    by_row = {name: array.reshape(n, B, *array.shape[1:]) for name, array in arrays.items()}
    return [{name: np.ascontiguousarray(array[:, b]) for name, array in by_row.items()} for b in range(B)]


class OnnxBatchedDecoder:
    """The batched dense decoder of one model: exported beside the other decoders on first use (its own manifest),
    its session made on first use. Not thread-safe per thread of use: one caller steps a batch at a time."""

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path, threads: int = 2,
                 progress: Progress | None = None):
        self.config = config
        self.bases = rope_bases(config)
        store = GraphStore(Path(onnx_root) / checksum, MANIFEST, BATCHED_EXPORT_FORMAT, progress)
        build = partial(build_batched_decoder_graph, gguf, config)
        store.ensure(FILE, build, "Exporting the batched decoder graph to ONNX", optimized=True)
        build_walked = partial(build_batched_walked_decoder_graph, gguf, config)
        store.ensure(WALKED_FILE, build_walked, "Exporting the batched walked decoder graph to ONNX", 0.5,
                     optimized=True)
        build_served = partial(build_batched_served_decoder_graph, gguf, config)
        store.ensure(SERVED_FILE, build_served, "Exporting the batched served decoder graph to ONNX", 0.7,
                     optimized=True)
        build_replay = partial(build_batched_replay_decoder_graph, gguf, config)
        store.ensure(REPLAY_FILE, build_replay, "Exporting the batched replay decoder graph to ONNX", 0.85,
                     optimized=True)
        build_mixed = partial(build_batched_mixed_decoder_graph, gguf, config)
        store.ensure(MIXED_FILE, build_mixed, "Exporting the batched mixed decoder graph to ONNX", 0.9,
                     optimized=True)
        store.save()
        opts = partial(session_options, threads, spinning=True)
        self._sessions = {"dense": LazySessions(store, [(FILE, build)], opts, optimized=True),
                          "walked": LazySessions(store, [(WALKED_FILE, build_walked)], opts, optimized=True),
                          "served": LazySessions(store, [(SERVED_FILE, build_served)], opts, optimized=True),
                          "replay": LazySessions(store, [(REPLAY_FILE, build_replay)], opts, optimized=True),
                          "mixed": LazySessions(store, [(MIXED_FILE, build_mixed)], opts, optimized=True)}
        self._local = threading.local()
        self._zeros = ZeroRows(config.hidden)

    def load_session(self, walk: bool = False) -> None:
        """Make the dense decoder's session now, or with `walk` the walked, served, replay and mixed decoders'
        (what a walk's decode steps run)."""
        for kind in ("walked", "served", "replay", "mixed") if walk else ("dense",):
            self._sessions[kind].load_all(None, "Loading the batched decoder graph")

    def run(self, h: np.ndarray, positions: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
            rope) -> np.ndarray:
        """Logits (B, vocab) of one token per row: h (B, d) the rows' embedded tokens at `positions` (B,) int;
        keys/values: per layer (B, kv_heads, C, hd) contiguous, each row holding its context before its
        position, written in place at it (C > every position: the caller made room)."""
        binding = self._bind("dense", h, positions, keys, values, rope)
        logits = np.empty((h.shape[0], self.config.vocab_size), np.float32)
        binding.bind_output("logits", logits)
        binding.run()
        return logits

    def run_walked(self, h: np.ndarray, positions: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                   rope, k: int) -> list[WalkedPass]:
        """As `run` with the top-`k` walk at every layer: what each row computed (one WalkedPass per row)."""
        binding = self._bind("walked", h, positions, keys, values, rope)
        binding.bind_input("k", np.array([k], np.int64))
        cfg, B, n = self.config, h.shape[0], self.config.n_layers
        arrays = {"inputs": np.empty((n * B, cfg.hidden), np.float32),
                  "scores": np.empty((n * B, cfg.intermediate), np.float32),
                  "selections": np.empty((n * B, cfg.intermediate), bool),
                  "outputs": np.empty((n * B, cfg.hidden), np.float32),
                  "residuals": np.empty((n * B, cfg.hidden), np.float32),
                  "settled": np.empty(n * B, bool)}
        for name, array in arrays.items():
            binding.bind_output(name, array)
        binding.run()
        return [WalkedPass(**row) for row in _per_row(arrays, n, B)]

    def run_served(self, h: np.ndarray, positions: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                   rope, served: np.ndarray, selections: np.ndarray, replayed: Sequence[bool] = ()
                   ) -> list[ServedPass | ReplayPass]:
        """As `run` with every layer's FFN output given: served (n * B, d) and the guessed selections
        (n * B, F) bool, layer-major (row b of layer i at i * B + b); what each row computed (one ServedPass per
        row, or for the rows `replayed` names, what `run_replay` computes for them: the same inputs and
        residuals, the gate aside)."""
        cfg, B, n = self.config, h.shape[0], self.config.n_layers
        self._check_layer_major(served, n * B)
        binding = self._bind("served", h, positions, keys, values, rope)
        binding.bind_input("served", np.ascontiguousarray(served, dtype=np.float32))
        binding.bind_input("selections", np.ascontiguousarray(selections, dtype=bool))
        arrays = {"inputs": np.empty((n * B, cfg.hidden), np.float32),
                  "scores": np.empty((n * B, cfg.intermediate), np.float32),
                  "residuals": np.empty((n * B, cfg.hidden), np.float32),
                  "settled": np.empty(n * B, bool)}
        for name, array in arrays.items():
            binding.bind_output(name, array)
        binding.run()
        replayed = list(replayed) or [False] * B
        return [ReplayPass(row["inputs"], row["residuals"]) if replay else ServedPass(**row)
                for replay, row in zip(replayed, _per_row(arrays, n, B))]

    def run_replay(self, h: np.ndarray, positions: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                   rope, served: np.ndarray) -> list[ReplayPass]:
        """As `run_served` without the gate (no selections, no scores): one ReplayPass per row."""
        cfg, B, n = self.config, h.shape[0], self.config.n_layers
        self._check_layer_major(served, n * B)
        binding = self._bind("replay", h, positions, keys, values, rope)
        binding.bind_input("served", np.ascontiguousarray(served, dtype=np.float32))
        arrays = {"inputs": np.empty((n * B, cfg.hidden), np.float32),
                  "residuals": np.empty((n * B, cfg.hidden), np.float32)}
        for name, array in arrays.items():
            binding.bind_output(name, array)
        binding.run()
        return [ReplayPass(**row) for row in _per_row(arrays, n, B)]

    def run_mixed(self, h: np.ndarray, positions: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                  rope, k: int, kinds: Sequence[str], served: np.ndarray, selections: np.ndarray
                  ) -> list[WalkedPass | ServedPass | ReplayPass]:
        """Each row as its kind asks (`kinds`, one per row): "walked" as `run_walked` computes it (a WalkedPass),
        "served" as `run_served` (a ServedPass) and "replay" as `run_replay` (a ReplayPass), with served and
        selections as there (the walked rows' parts are not read)."""
        cfg, B, n = self.config, h.shape[0], self.config.n_layers
        self._check_layer_major(served, n * B)
        if len(kinds) != B or not set(kinds) <= {"walked", "served", "replay"}:
            raise ValueError(f"one kind per row (walked, served or replay) for {B} rows, not {list(kinds)}")
        binding = self._bind("mixed", h, positions, keys, values, rope)
        binding.bind_input("k", np.array([k], np.int64))
        binding.bind_input("given", np.array([kind != "walked" for kind in kinds], bool).reshape(B, 1))
        binding.bind_input("served", np.ascontiguousarray(served, dtype=np.float32))
        binding.bind_input("selections_in", np.ascontiguousarray(selections, dtype=bool))
        arrays = {"inputs": np.empty((n * B, cfg.hidden), np.float32),
                  "scores": np.empty((n * B, cfg.intermediate), np.float32),
                  "selections": np.empty((n * B, cfg.intermediate), bool),
                  "outputs": np.empty((n * B, cfg.hidden), np.float32),
                  "residuals": np.empty((n * B, cfg.hidden), np.float32),
                  "settled": np.empty(n * B, bool)}
        for name, array in arrays.items():
            binding.bind_output(name, array)
        binding.run()
        out: list[WalkedPass | ServedPass | ReplayPass] = []
        for kind, row in zip(kinds, _per_row(arrays, n, B)):
            if kind == "served":
                out.append(ServedPass(row["inputs"], row["scores"], row["residuals"], row["settled"]))
            elif kind == "replay":
                out.append(ReplayPass(row["inputs"], row["residuals"]))
            else:
                out.append(WalkedPass(**row))
        return out

    def _check_layer_major(self, served: np.ndarray, rows: int) -> None:
        if served.shape != (rows, self.config.hidden):
            raise ValueError(f"served outputs of shape {served.shape}, not ({rows}, {self.config.hidden}): one row "
                             "per layer and batch row, layer-major")

    def _bind(self, kind: str, h: np.ndarray, positions: np.ndarray, keys: list[np.ndarray],
              values: list[np.ndarray], rope) -> Binding:
        B = h.shape[0]
        if not B == positions.shape[0] == keys[0].shape[0]:
            raise ValueError(f"{B} rows of h, {positions.shape[0]} positions, {keys[0].shape[0]} cache rows")
        bindings = getattr(self._local, "bindings", None)
        if bindings is None:
            bindings = self._local.bindings = {}
        binding = bindings.get(kind)
        if binding is None:
            binding = bindings[kind] = Binding(self._sessions[kind][0])
        seqlens = np.ascontiguousarray(positions, dtype=np.int32)
        total = int(seqlens.max()) + 1
        if total > keys[0].shape[2]:
            raise ValueError(f"position {total - 1} is beyond the cache's {keys[0].shape[2]} positions")
        binding.bind_input("seqlens_k", seqlens)
        binding.bind_input("total_len", np.array(total, np.int32))
        for t, base in enumerate(self.bases):
            cos, sin = rope.table(base, total)
            binding.bind_input(f"cos{t}", cos)
            binding.bind_input(f"sin{t}", sin)
        binding.bind_input("h", np.ascontiguousarray(h, dtype=np.float32))
        binding.bind_input("f0", self._zeros(B))
        for i in range(self.config.n_layers):
            binding.bind_input(f"past_key{i}", keys[i])
            binding.bind_input(f"past_value{i}", values[i])
            binding.bind_output(f"present_key{i}", keys[i])
            binding.bind_output(f"present_value{i}", values[i])
        return binding
