"""Per-layer ONNX graphs for everything but the FFN, and the output head, run with onnxruntime.

The numpy forward pass (model/transformer.py) spends most of a decode step on fp32 attention projections, the fp32 output
head and Python overhead. These graphs move that work into onnxruntime with the GGUF's own quant blocks
(MatMulNBits, as the FFN graphs), leaving one call per layer around the FFN:

  layer graph  h (T, d), f (T, d) = previous layer's raw FFN output (zeros before layer 0), KV cache
      h1 = h + post_ffn_norm_prev(f);  x = rms_norm(h1, attn_norm)
      q, k, v = x @ [Wq; Wk; Wv].T (one MatMulNBits);  q/k norms (Gemma 3)
      attention with rope, causal / sliding-window mask and the KV cache (com.microsoft GroupQueryAttention;
      the cache's numpy buffers are bound as both past and present, so the new keys/values land in place)
      h_out = h1 + post_attn_norm(attn @ Wo.T);  x_ffn = rms_norm(h_out, ffn_norm)     -> h_out, x_ffn
      (the "gated" variant also gives the FFN's gate scores x_ffn @ W_gate.T: the walk FFN starts from them,
      so a walk step saves a call per layer)
  FFN          x_ffn -> f, the FfnCall (unchanged: the walk FFN and the activation cache attach there)
  head graph   h, f of the last layer -> logits = rms_norm(h + post_ffn_norm(f), output_norm) @ W_out.T

The output head stays in its GGUF blocks (Q8_0 for both packaged models): no fp32 copy of a 262144 x 640
matrix. Files go through graphs/store.py's GraphStore like the FFN graphs (own manifest, own export format).
"""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.graphs.ffn import linear
from larql_desktop.engine.graphs.store import Binding, GraphStore, LazySessions, Progress, ZeroRows, make_model, session_options
from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.formats.quants import dequantize
from larql_desktop.engine.graphs.onnx_deferred import FLOAT

if TYPE_CHECKING:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
else:
    from larql_desktop.engine.graphs.onnx_deferred import TensorProto, helper, numpy_helper, onnx

BLOCK_EXPORT_FORMAT = 5   # bump when these graphs change, so old exports are rebuilt (5: the head in row slices)

# The head's weight (vocabulary x hidden, 27 MB of 8-bit codes on SmolLM2, 168 MB on Gemma 3) in row slices of
# at most this many bytes: onnxruntime's prepacking holds a weight's stored and packed copies at once, so one
# node raised peak memory by the whole weight (232 -> 209 MB for the SmolLM2 decoder in 4 slices, 205 in 8).
HEAD_NODE_BYTES = 8 << 20


MANIFEST = "blocks.manifest.json"


def _f32(gguf: GgufFile, name: str) -> np.ndarray:
    return np.ascontiguousarray(dequantize(gguf.tensors[name]), dtype=np.float32)


def _residual_in(gguf: GgufFile, cfg: ModelConfig, layer: int, nodes, inits) -> str:
    """Name of f as added to the residual stream: the previous layer's post-FFN norm applies (Gemma 3)."""
    if cfg.has_post_norms and layer > 0:
        inits.append(numpy_helper.from_array(_f32(gguf, f"blk.{layer - 1}.post_ffw_norm.weight"), "post_ffn_w"))
        nodes.append(helper.make_node("SimplifiedLayerNormalization", ["f", "post_ffn_w"], ["f_normed"],
                                      axis=-1, epsilon=float(cfg.norm_eps)))
        return "f_normed"
    return "f"


# The layer graph's reshapes into GroupQueryAttention's (batch, sequence, width) layout end in this name.
_SEQUENCE_SHAPE = "_3d_shape"


def rows_as_sequences(inits: list) -> None:
    """Turn the layer graphs' (1, T, width) reshapes (all rows one sequence) into (B, 1, width) (a sequence per
    row), in place."""
    for i, tensor in enumerate(inits):
        if tensor.name.endswith(_SEQUENCE_SHAPE):
            shape = numpy_helper.to_array(tensor)
            if shape.tolist()[:2] != [1, -1]:
                raise ValueError(f"{tensor.name}: expected a (1, -1, width) reshape, found {shape.tolist()}")
            inits[i] = numpy_helper.from_array(np.array([-1, 1, shape[2]], np.int64), tensor.name)


def build_layer_graph(gguf: GgufFile, cfg: ModelConfig, layer: int, gated: bool = False,
                      rows: bool = False) -> onnx.ModelProto:
    """The layer graph of the module docstring; with `rows`, each of its B rows is a sequence of its own (one new
    token on its own KV cache, (B, KV, C, hd), at its own position seqlens_k (B,)), as the batched decoder's
    layers are: B passes' one-token steps in one call instead of B."""
    p = f"blk.{layer}."
    H, KV, hd, d, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden, float(cfg.norm_eps)
    nodes, inits = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    f_in = _residual_in(gguf, cfg, layer, nodes, inits)
    const("attn_norm_w", _f32(gguf, p + "attn_norm.weight"))
    nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ["h", f_in, "attn_norm_w"],
                                  ["x", "", "", "h1"], domain="com.microsoft", epsilon=eps))
    t = gguf.tensors
    qkv_nodes, qkv_inits = linear([t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]],
                                   "x", "qkv")
    nodes += qkv_nodes
    inits += qkv_inits
    gqa_in = ["qkv3"]
    if cfg.has_qk_norm:
        # Per-head RMS norms of q and k before rope. (GroupQueryAttention's own q/k-norm inputs did not
        # match the reference here, so they run as separate nodes.)
        const("qkv_split", np.array([H * hd, KV * hd, KV * hd], np.int64))
        nodes.append(helper.make_node("Split", ["qkv", "qkv_split"], ["q", "k", "v"], axis=-1))
        for a, heads in (("q", H), ("k", KV)):
            const(f"{a}_norm_w", _f32(gguf, f"{p}attn_{a}_norm.weight"))
            const(f"{a}_heads_shape", np.array([-1, heads, hd], np.int64))
            const(f"{a}_3d_shape", np.array([1, -1, heads * hd], np.int64))
            nodes += [helper.make_node("Reshape", [a, f"{a}_heads_shape"], [f"{a}_heads"]),
                      helper.make_node("SimplifiedLayerNormalization", [f"{a}_heads", f"{a}_norm_w"],
                                       [f"{a}_normed"], axis=-1, epsilon=eps),
                      helper.make_node("Reshape", [f"{a}_normed", f"{a}_3d_shape"], [f"{a}3"])]
        const("v_3d_shape", np.array([1, -1, KV * hd], np.int64))
        nodes.append(helper.make_node("Reshape", ["v", "v_3d_shape"], ["v3"]))
        gqa_in = ["q3", "k3", "v3"]
    else:
        const("qkv_3d_shape", np.array([1, -1, (H + 2 * KV) * hd], np.int64))
        nodes.append(helper.make_node("Reshape", ["qkv", "qkv_3d_shape"], ["qkv3"]))
        gqa_in = ["qkv3", "", ""]
    window = cfg.window_for(layer)
    nodes.append(helper.make_node(
        "GroupQueryAttention", gqa_in + ["past_key", "past_value", "seqlens_k", "total_len", "cos", "sin"],
        ["attn3", "present_key", "present_value"], domain="com.microsoft",
        num_heads=H, kv_num_heads=KV, do_rotary=1, rotary_interleaved=int(cfg.rope_adjacent_pairs),
        scale=float(cfg.attn_scale),
        # GQA keeps local_window_size + 1 keys including the query's own; llama.cpp keeps p_q - p_k < window
        # (checked against the numpy reference in tests/test_fast_paths.py).
        local_window_size=window if window else -1))
    const("attn_2d_shape", np.array([-1, H * hd], np.int64))
    nodes.append(helper.make_node("Reshape", ["attn3", "attn_2d_shape"], ["attn"]))
    o_nodes, o_inits = linear([t[p + "attn_output.weight"]], "attn", "a")
    nodes += o_nodes
    inits += o_inits
    a = "a"
    if cfg.has_post_norms:
        const("post_attn_w", _f32(gguf, p + "post_attention_norm.weight"))
        nodes.append(helper.make_node("SimplifiedLayerNormalization", ["a", "post_attn_w"], ["a_normed"],
                                      axis=-1, epsilon=eps))
        a = "a_normed"
    const("ffn_norm_w", _f32(gguf, p + "ffn_norm.weight"))
    nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ["h1", a, "ffn_norm_w"],
                                  ["x_ffn", "", "", "h_out"], domain="com.microsoft", epsilon=eps))
    if rows:
        rows_as_sequences(inits)
    cache = ["B" if rows else 1, KV, "C", hd]
    inputs = [helper.make_tensor_value_info("h", FLOAT, ["T", d]),
              helper.make_tensor_value_info("f", FLOAT, ["T", d]),
              helper.make_tensor_value_info("past_key", FLOAT, cache),
              helper.make_tensor_value_info("past_value", FLOAT, cache),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B" if rows else 1]),
              helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
              helper.make_tensor_value_info("cos", FLOAT, ["P", hd // 2]),
              helper.make_tensor_value_info("sin", FLOAT, ["P", hd // 2])]
    outputs = [helper.make_tensor_value_info("h_out", FLOAT, ["T", d]),
               helper.make_tensor_value_info("x_ffn", FLOAT, ["T", d]),
               helper.make_tensor_value_info("present_key", FLOAT, cache),
               helper.make_tensor_value_info("present_value", FLOAT, cache)]
    if gated:
        gate_nodes, gate_inits = linear([t[f"{p}ffn_gate.weight"]], "x_ffn", "scores")
        nodes += gate_nodes
        inits += gate_inits
        outputs.append(helper.make_tensor_value_info("scores", FLOAT, ["T", cfg.intermediate]))
    return make_model(nodes, inits, inputs, outputs, f"layer_{layer}")


def build_head_graph(gguf: GgufFile, cfg: ModelConfig) -> onnx.ModelProto:
    nodes, inits = [], []
    f_in = _residual_in(gguf, cfg, cfg.n_layers, nodes, inits)
    inits.append(numpy_helper.from_array(_f32(gguf, "output_norm.weight"), "output_norm_w"))
    nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ["h", f_in, "output_norm_w"],
                                  ["x"], domain="com.microsoft", epsilon=float(cfg.norm_eps)))
    out = gguf.tensors.get("output.weight", gguf.tensors["token_embd.weight"])   # tied embeddings
    head_nodes, head_inits = linear([out], "x", "logits", max_node_bytes=HEAD_NODE_BYTES)
    return make_model(nodes + head_nodes, inits + head_inits,
                      [helper.make_tensor_value_info("h", FLOAT, ["T", cfg.hidden]),
                       helper.make_tensor_value_info("f", FLOAT, ["T", cfg.hidden])],
                      [helper.make_tensor_value_info("logits", FLOAT, ["T", cfg.vocab_size])], "head")


class OnnxBlocks:
    """The layer graphs and the head graph of one model, loaded into onnxruntime sessions.

    `run_layer`/`run_head` are what TransformerModel.forward calls; they bind numpy buffers directly (the
    KV cache in place, fresh output arrays), so nothing is copied on the way in or out.
    """

    def __init__(self, gguf: GgufFile, config: ModelConfig, checksum: str, onnx_root: Path,
                 threads: int = 2, progress: Progress | None = None):
        self.config = config
        self.directory = Path(onnx_root) / checksum
        store = GraphStore(self.directory, MANIFEST, BLOCK_EXPORT_FORMAT, progress)
        self.rebuilt = store.rebuilt
        n = config.n_layers
        layer_files, gated_files, rows_files = [], [], []
        for layer in range(n):
            for kind, files in (("attn", layer_files), ("attn_gate", gated_files), ("attn_rows", rows_files)):
                name = f"layer{layer:02d}.{kind}.onnx"
                build = partial(build_layer_graph, gguf, config, layer, gated=kind == "attn_gate",
                                rows=kind == "attn_rows")
                files.append((name, build))
                # The row-batched graphs are checked (or exported) when their session is made: only INSERT runs
                # them, and a chat's start-up should not hash or export 30 files it never reads.
                if kind != "attn_rows":
                    store.ensure(name, build, f"Exporting layer {layer + 1}/{n} attention graph to ONNX",
                                 layer / (n + 1))
        head_build = partial(build_head_graph, gguf, config)
        store.ensure("head.onnx", head_build, "Exporting the output head to ONNX", n / (n + 1))
        store.save()
        # Names these very files' content, as OnnxFfn.numerics does the FFN's: what a pass computed with them is
        # kept (INSERT's capture store) only for the same graphs.
        # The row-batched graphs are left out: they give each row the layer graph's bits (tests/test_together.py),
        # so captures made with them are the same captures.
        names = [name for name, _ in layer_files + gated_files] + ["head.onnx"]
        self.numerics: str | None = f"onnx-blocks-{BLOCK_EXPORT_FORMAT}-{store.digest(names)}"
        opts = partial(session_options, threads)
        self._layers = LazySessions(store, layer_files, opts)
        self._gated = LazySessions(store, gated_files, opts)
        self._rows: LazySessions | None = LazySessions(store, rows_files, opts)
        self._heads = LazySessions(store, [("head.onnx", head_build)], opts)
        self._local = threading.local()
        self.zeros = ZeroRows(config.hidden)   # layer 0's "previous FFN output"

    @property
    def has_gate_scores(self) -> bool:
        """Whether run_layer can also give the FFN's gate scores (the gated graphs exist)."""
        return self._gated is not None

    @property
    def runs_rows_together(self) -> bool:
        """Whether run_layer_rows can run (the row-batched layer graphs exist)."""
        return self._rows is not None

    def load_sessions(self, progress: Progress | None = None, gated: bool = False) -> None:
        """Create the sessions now rather than on first use: the plain attention graphs, or the gated ones
        (what the walk FFN runs)."""
        (self._gated if gated else self._layers).load_all(progress, "Loading the attention graphs")
        self._heads.load_all()

    @classmethod
    def from_sessions(cls, config: ModelConfig, layers: list[ort.InferenceSession],
                      head: ort.InferenceSession) -> "OnnxBlocks":
        """Blocks from sessions made elsewhere (tests: graphs built in memory for a modified config)."""
        self = cls.__new__(cls)
        self.config, self.directory, self.rebuilt, self.numerics = config, None, [], None
        self._layers, self._gated, self._rows, self._heads = list(layers), None, None, [head]
        self._local = threading.local()
        self.zeros = ZeroRows(config.hidden)
        return self

    def _state(self):
        state = getattr(self._local, "state", None)
        if state is None:   # per thread: bindings are not thread-safe, sessions are
            state = self._local.state = _ThreadState(self._layers, self._gated, self._rows, self._heads)
        return state

    def run_layer(self, layer: int, h: np.ndarray, f: np.ndarray, keys: np.ndarray, values: np.ndarray,
                  start: int, cos: np.ndarray, sin: np.ndarray, gate_scores: bool = False):
        """One layer up to the FFN input; writes rows start..start+T of keys/values (KV, cap, hd) in place.
        h, f: (T, d) contiguous float32; cos/sin: rope tables covering positions < start + T.
        Returns (h_out, x_ffn), or (h_out, x_ffn, the FFN's gate scores (T, F)) with `gate_scores`."""
        T, d = h.shape
        state = self._state()
        state.seqlens[0] = start + T - 1
        state.total[()] = start + T
        b = state.layer(layer, gate_scores)
        h_out = np.empty((T, d), np.float32)
        x_ffn = np.empty((T, d), np.float32)
        views = state.kv_views[layer]
        if views[0] is not keys or views[1] is not values:   # a new cache, or this one grew
            views = state.kv_views[layer] = (keys, values, keys[None], values[None])
        keys4, values4 = views[2], views[3]            # (1, KV, cap, hd): past and present share them
        _bind_layer(b, h, f, keys4, values4, state.seqlens, state.total, cos, sin, h_out, x_ffn)
        if not gate_scores:
            b.run()
            return h_out, x_ffn
        scores = np.empty((T, self.config.intermediate), np.float32)
        b.bind_output("scores", scores)
        b.run()
        return h_out, x_ffn, scores

    def run_layer_rows(self, layer: int, h: np.ndarray, f: np.ndarray, keys: np.ndarray, values: np.ndarray,
                       positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`run_layer` of B one-token passes in one call: row b of h, f (B, d) is the token at positions[b] of
        its own context, whose keys/values are row b of keys/values (B, KV, C, hd), C > every position, written
        in place at its position. Each row's h_out, x_ffn and new key/value are what run_layer gives it alone,
        bit for bit (the nodes are per row, and GroupQueryAttention takes each row as a sequence).
        Returns (h_out, x_ffn), (B, d) each."""
        if self._rows is None:
            raise RuntimeError("these blocks have no row-batched layer graphs")
        B, d = h.shape
        state = self._state()
        b = state.rows(layer)
        h_out = np.empty((B, d), np.float32)
        x_ffn = np.empty((B, d), np.float32)
        _bind_layer(b, h, f, keys, values, np.ascontiguousarray(positions, dtype=np.int32),
                    np.array(int(np.max(positions)) + 1, np.int32), cos, sin, h_out, x_ffn)
        b.run()
        return h_out, x_ffn

    def run_head(self, h: np.ndarray, f: np.ndarray) -> np.ndarray:
        b = self._state().head
        logits = np.empty((h.shape[0], self.config.vocab_size), np.float32)
        b.bind_input("h", h)
        b.bind_input("f", f)
        b.bind_output("logits", logits)
        b.run()
        return logits


def _bind_layer(b: Binding, h: np.ndarray, f: np.ndarray, keys: np.ndarray, values: np.ndarray, seqlens: np.ndarray,
                total: np.ndarray, cos: np.ndarray, sin: np.ndarray, h_out: np.ndarray, x_ffn: np.ndarray) -> None:
    """A layer graph's inputs and outputs, its KV cache bound as both past and present (written in place)."""
    for name, array in (("h", h), ("f", f), ("past_key", keys), ("past_value", values), ("seqlens_k", seqlens),
                        ("total_len", total), ("cos", cos), ("sin", sin)):
        b.bind_input(name, array)
    for name, array in (("h_out", h_out), ("x_ffn", x_ffn), ("present_key", keys), ("present_value", values)):
        b.bind_output(name, array)


class _ThreadState:
    """One thread's IO bindings, made on the first call of each session."""

    def __init__(self, layers, gated, rows, heads):
        self._sessions = {False: layers, True: gated}
        self._rows_sessions = rows
        self._rows: list[Binding | None] = [None] * len(layers)
        self._heads = heads
        self._bindings: dict[bool, list[Binding | None]] = {False: [None] * len(layers), True: [None] * len(layers)}
        self._head: Binding | None = None
        self.kv_views = [(None, None, None, None)] * len(layers)
        self.seqlens = np.zeros(1, np.int32)     # updated in place, bound once
        self.total = np.zeros((), np.int32)

    def layer(self, i: int, gated: bool = False) -> Binding:
        b = self._bindings[gated][i]
        if b is None:
            b = self._bindings[gated][i] = Binding(self._sessions[gated][i])
        return b

    def rows(self, i: int) -> Binding:
        b = self._rows[i]
        if b is None:
            b = self._rows[i] = Binding(self._rows_sessions[i])
        return b

    @property
    def head(self) -> Binding:
        if self._head is None:
            self._head = Binding(self._heads[0])
        return self._head
