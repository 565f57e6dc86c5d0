"""Forward pass for the llama and gemma3 architectures with a KV cache.

The FFN is not computed here: each layer hands its normed FFN input to an `FfnCall`, which is exactly
where the walk FFN and its activation cache attach. Everything else runs either in per-layer onnxruntime
graphs (graphs/blocks.py's OnnxBlocks, attached with `use_graphs`: the fast path the app uses) or in numpy fp32 from
dequantised GGUF weights (the reference the graphs are tested against; weights dequantised on first use).
A pass with nothing to do between layers may instead run whole in one call of a decoder graph (graphs/decoder.py):
which passes, and what a call's results mean for the FFN, is the cache's business (cache/stepper.py), asked
through the `Stepper` an FFN brings.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol, TypeVar

import numpy as np

from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.formats.gguf import GgufError, GgufFile
from larql_desktop.engine.formats.quants import dequantize, dequantize_rows

Result = TypeVar("Result")


class FfnCall(Protocol):
    def __call__(self, layer: int, x: np.ndarray, /) -> np.ndarray:
        """x: normed FFN input (T, d) -> raw FFN output (T, d)."""


class LayerRecord(Protocol):
    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """h: the residual (T, d) after the layer's attention; x: its normed FFN input (T, d)."""


class ScoredFfnCall(Protocol):
    def __call__(self, layer: int, x: np.ndarray, scores: np.ndarray | None, /) -> np.ndarray:
        """As FfnCall, given `scores` = x @ W_gate.T (T, F) of the base weights when the layer graph computed them."""


class Stepper(Protocol):
    """The cache's side of a forward pass (cache/stepper.py): what may run whole in one of the model's decoder
    graphs, and whether the FFN takes the gate scores the layer graphs can compute alongside its input. An FFN
    brings its stepper as its `stepper` attribute (the walk's, or the plain dense FFN's); a plain callable none."""

    def run_whole(self, model: "TransformerModel", ids: np.ndarray, h: np.ndarray, start: int, kv: "KvCache"
                  ) -> np.ndarray | None:
        """The logits of the pass of `ids` (embedded: h (T, d)) after the first `start` positions of `kv`, run in
        the model's decoder graphs (kv.length advanced), or None: the model runs the pass layer by layer."""

    def scored_ffn(self, rows: int) -> ScoredFfnCall | None:
        """The FFN to hand the layer graphs' gate scores to in a pass of `rows` positions; None: the plain call."""

    def runs_decoder_steps(self) -> bool:
        """Whether a decode step may run whole in the dense or the walked decoder graph: the steps a batch of
        rows computes together (model/batch.py)."""


def stepper_of(ffn: FfnCall) -> Stepper | None:
    """The stepper `ffn` brings (see Stepper), None for a plain callable."""
    stepper: Stepper | None = getattr(ffn, "stepper", None)
    return stepper


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # (T, d) or (..., d)
    scale = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32) + eps)
    return (x * scale).astype(np.float32, copy=False) * weight


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88 (a steep inserted gate far from firing): x / inf is the right -0.
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"silu": silu, "gelu_tanh": gelu_tanh}


@dataclass(frozen=True)
class AttentionWeights:
    attn_norm: np.ndarray
    wq: np.ndarray   # (n_heads*hd, d)
    wk: np.ndarray   # (n_kv*hd, d)
    wv: np.ndarray   # (n_kv*hd, d)
    wo: np.ndarray   # (d, n_heads*hd)
    ffn_norm: np.ndarray
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None


def zeroed_layer_pairs(n_layers: int, shape: tuple[int, ...]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Keys and values of `shape` for each of `n_layers` layers, all zeros, as views of one anonymous mapping in
    small pages: memory only for the pages written. A cache is written sparsely, a few positions of every head of
    every layer (one head's rows of a 256-position SmolLM2 cache are 64 kB apart), so numpy's own allocation,
    which asks for huge pages for arrays this large, made the whole capacity resident at the first token (its
    first write to each 2 MB page faults in all of it): 12 MB a session, a batch pool of 8 rows 94 MB. Arrays
    from the heap instead come from freed chunks that calloc must clear, resident as well."""
    count = 2 * n_layers * math.prod(shape)
    pages = mmap.mmap(-1, max(1, count * 4))       # anonymous: zero-filled by the kernel
    if hasattr(mmap, "MADV_NOHUGEPAGE"):           # where huge pages are on for every mapping, not only on request
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    block = np.frombuffer(pages, np.float32, count=count).reshape((2, n_layers, *shape))
    return list(block[0]), list(block[1])


class KvCache:
    """Keys/values per layer, grown by doubling; `truncate` rolls the context back (regenerate)."""

    def __init__(self, config: ModelConfig, capacity: int = 256):
        self.config = config
        self.length = 0
        self._cap = capacity
        self.keys, self.values = zeroed_layer_pairs(config.n_layers, (config.n_kv_heads, capacity, config.head_dim))

    def reserve(self, needed: int) -> None:
        if needed <= self._cap:
            return
        cap = self._cap
        while cap < needed:
            cap *= 2
        cfg = self.config
        keys, values = zeroed_layer_pairs(cfg.n_layers, (cfg.n_kv_heads, cap, cfg.head_dim))
        for new, old in zip(keys + values, self.keys + self.values):
            new[:, :self.length] = old[:, :self.length]
        self.keys[:], self.values[:], self._cap = keys, values, cap    # the same lists: holders see the new arrays

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a context of {self.length} tokens to {length}")
        self.length = length

    def copy_prefix(self, source: "KvCache", length: int, layer: int | None = None) -> None:
        """The first `length` positions of `source` (a context that begins as this one does) into this cache:
        every layer's, after which it holds those `length` positions; or one layer's, as a pass about to run
        that layer on them needs (the pass sets the length)."""
        self.reserve(length)
        for i in range(self.config.n_layers) if layer is None else (layer,):
            self.keys[i][:, :length] = source.keys[i][:, :length]
            self.values[i][:, :length] = source.values[i][:, :length]
        if layer is None:
            self.length = length


class RopeTables:
    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self._tables: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, base: float, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = self.table(base, int(positions.max()) + 1)
        return cos[positions], sin[positions]   # (T, hd/2)

    def table(self, base: float, needed: int) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin for positions 0.. at least needed-1: (P, hd/2) each."""
        table = self._tables.get(base)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 1024, 0 if table is None else 2 * table[0].shape[0])
            inv_freq = base ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
            angles = np.arange(size, dtype=np.float64)[:, None] * inv_freq[None, :]
            table = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
            self._tables[base] = table
        return table


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, adjacent_pairs: bool) -> np.ndarray:
    """x: (heads, T, hd); cos/sin: (T, hd/2)."""
    if adjacent_pairs:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class TransformerModel:
    """Weights and forward pass of one GGUF model (FFN excluded, see FfnCall)."""

    def __init__(self, gguf: GgufFile, config: ModelConfig | None = None):
        self.gguf = gguf
        self.config = cfg = config or ModelConfig.from_gguf(gguf)
        t = gguf.tensors

        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                         "ffn_gate", "ffn_up", "ffn_down"):
                if f"{p}{name}.weight" not in t:
                    raise GgufError(f"{gguf.path}: missing tensor {p}{name}.weight for a {cfg.arch} model")
        if "output_norm.weight" not in t:
            raise GgufError(f"{gguf.path}: missing tensor 'output_norm.weight' for a {cfg.arch} model")
        self._layers: list[AttentionWeights] | None = None
        self.output_norm = dequantize(t["output_norm.weight"])
        self.token_embd = t["token_embd.weight"]
        # Tied embeddings when the GGUF has no separate output matrix (both packaged models).
        self.output_tensor = t.get("output.weight", self.token_embd)
        self._output_matrix: np.ndarray | None = None
        self.rope = RopeTables(cfg.head_dim)
        # Attached by `use_graphs` from the graphs layer above this one (hence untyped here):
        self.graphs: Any = None   # graphs.blocks.OnnxBlocks: forward then runs in onnxruntime
        self.decoder: Any = None  # graphs.decoder.OnnxDecoder: whole passes in one call (the Stepper's choice)
        self.softmax: Any = None  # graphs.softmax.OnnxSoftmax over the vocabulary: a reply's token probabilities

    def use_graphs(self, graphs, decoder=None, softmax=None) -> None:
        """Run forward through onnxruntime layer/head graphs (None: back to the numpy reference), whole dense
        passes through the decoder graph when one is given, and the probabilities a reply's token view shows
        through `softmax` when one is given (else numpy)."""
        self.graphs = graphs
        self.decoder = decoder if graphs is not None else None
        self.softmax = softmax if graphs is not None else None

    @property
    def layers(self) -> list[AttentionWeights]:
        """Dequantised fp32 attention weights for the numpy path, made on first use (~100 MB)."""
        if self._layers is None:
            t = self.gguf.tensors

            def optional(name: str) -> np.ndarray | None:
                return dequantize(t[name]) if name in t else None

            self._layers = [AttentionWeights(
                attn_norm=dequantize(t[p + "attn_norm.weight"]), wq=dequantize(t[p + "attn_q.weight"]),
                wk=dequantize(t[p + "attn_k.weight"]), wv=dequantize(t[p + "attn_v.weight"]),
                wo=dequantize(t[p + "attn_output.weight"]), ffn_norm=dequantize(t[p + "ffn_norm.weight"]),
                q_norm=optional(p + "attn_q_norm.weight"), k_norm=optional(p + "attn_k_norm.weight"),
                post_attn_norm=optional(p + "post_attention_norm.weight"),
                post_ffn_norm=optional(p + "post_ffw_norm.weight"),
            ) for p in (f"blk.{i}." for i in range(self.config.n_layers))]
        return self._layers

    @property
    def attention_weights_loaded(self) -> bool:
        """Whether `layers` has dequantised the fp32 attention weights (the numpy path's, ~100 MB)."""
        return self._layers is not None

    def ffn_norm(self, layer: int) -> np.ndarray:
        """Layer `layer`'s FFN input norm weight (d,) in fp32: the same values as `layers[layer].ffn_norm`, read
        alone, so asking for it never dequantises the attention weights."""
        if self._layers is not None:
            return self._layers[layer].ffn_norm
        return dequantize(self.gguf.tensors[f"blk.{layer}.ffn_norm.weight"])

    # -- pieces -------------------------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return dequantize_rows(self.token_embd, ids) * np.float32(self.config.embed_scale)   # (T, d)

    @property
    def output_matrix(self) -> np.ndarray:
        if self._output_matrix is None:
            self._output_matrix = dequantize(self.output_tensor)   # (vocab, d)
        return self._output_matrix

    def logits(self, h: np.ndarray) -> np.ndarray:
        return rms_norm(h, self.output_norm, self.config.norm_eps) @ self.output_matrix.T   # (T, vocab)

    def attention(self, layer: int, x: np.ndarray, kv: KvCache, positions: np.ndarray) -> np.ndarray:
        cfg, w = self.config, self.layers[layer]
        T, hd = x.shape[0], cfg.head_dim
        q = (x @ w.wq.T).reshape(T, cfg.n_heads, hd).transpose(1, 0, 2)       # (H, T, hd)
        k = (x @ w.wk.T).reshape(T, cfg.n_kv_heads, hd).transpose(1, 0, 2)    # (KV, T, hd)
        v = (x @ w.wv.T).reshape(T, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.norm_eps)
            k = rms_norm(k, w.k_norm, cfg.norm_eps)
        cos, sin = self.rope.get(cfg.rope_base_for(layer), positions)
        q = apply_rope(q, cos, sin, cfg.rope_adjacent_pairs)
        k = apply_rope(k, cos, sin, cfg.rope_adjacent_pairs)
        start = int(positions[0])
        kv.keys[layer][:, start:start + T] = k
        kv.values[layer][:, start:start + T] = v
        S = start + T
        keys, values = kv.keys[layer][:, :S], kv.values[layer][:, :S]          # (KV, S, hd)
        group = cfg.n_heads // cfg.n_kv_heads
        qg = q.reshape(cfg.n_kv_heads, group * T, hd)
        scores = (qg @ keys.transpose(0, 2, 1)).reshape(cfg.n_kv_heads, group, T, S) * np.float32(cfg.attn_scale)
        key_pos = np.arange(S)
        allowed = key_pos[None, :] <= positions[:, None]                      # (T, S) causal
        window = cfg.window_for(layer)
        if window:
            allowed &= (positions[:, None] - key_pos[None, :]) < window
        scores = np.where(allowed, scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = (probs.reshape(cfg.n_kv_heads, group * T, S) @ values)          # (KV, group*T, hd)
        out = out.reshape(cfg.n_heads, T, hd).transpose(1, 0, 2).reshape(T, cfg.n_heads * hd)
        return out @ w.wo.T                                                     # (T, d)

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, ids, kv: KvCache, ffn: FfnCall, all_logits: bool = False,
                record: LayerRecord | None = None, stepper: Stepper | None = None) -> np.ndarray:
        """Run `ids` after the kv cache's context; returns logits (T, vocab) or (1, vocab) for the last one.
        `record(i, h, x)` is given each layer's residual after its attention and its FFN input (fresh arrays,
        (T, d)): what `resume` needs to re-run the layers after one whose FFN changed. `stepper` (by default the
        one `ffn` brings) may run a pass that needs neither whole in a decoder graph."""
        return run_to_end(self.forward_by_layer(ids, kv, ffn, all_logits, record, stepper))

    def forward_by_layer(self, ids, kv: KvCache, ffn: FfnCall, all_logits: bool = False,
                         record: LayerRecord | None = None, stepper: Stepper | None = None
                         ) -> Generator[int, None, np.ndarray]:
        """`forward` as a generator that yields between the layers of a pass run in the per-layer graphs (the
        layers done so far) and returns the logits: a server can run another request's step between two layers
        of a long prompt's chunk and take the chunk up again, through the same graph calls on the same inputs
        (the same bits). The kv cache must not change meanwhile. A pass that runs whole in one graph call (or in
        numpy) runs at the first `next()`."""
        cfg = self.config
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens to run")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range for a vocabulary of {cfg.vocab_size}")
        start = kv.length
        kv.reserve(start + ids.size)
        h = self.embed(ids)
        stepper = stepper if stepper is not None else stepper_of(ffn)
        if stepper is not None and self.decoder is not None and not all_logits and record is None:
            logits = stepper.run_whole(self, ids, h, start, kv)
            if logits is not None:
                return logits
        if self.graphs is not None:
            return (yield from self._graph_layers(h, start, kv, ffn, stepper, all_logits, record))
        return self._forward_numpy(h, 0, None, start, kv, ffn, all_logits, record)

    def resume(self, layer: int, h: np.ndarray, x: np.ndarray, kv: KvCache, ffn: FfnCall,
               record: LayerRecord | None = None, stepper: Stepper | None = None) -> np.ndarray:
        """The last position's logits of a pass re-run from `layer`'s FFN on, under `ffn`: `h` and `x` are what
        `record` gave for `layer` in a pass over the kv cache's last T positions (its layers up to `layer`
        stand: nothing before that FFN depends on it), the layers after it are recomputed and their KV rows
        rewritten. `record` is called for the layers after `layer`."""
        T = h.shape[0]
        start = kv.length - T
        if start < 0:
            raise ValueError(f"the kv cache holds {kv.length} positions, fewer than the {T} to resume")
        if not 0 <= layer < self.config.n_layers:
            raise ValueError(f"layer must be within 0..{self.config.n_layers - 1}, not {layer}")
        if self.graphs is not None:
            f = np.ascontiguousarray(ffn(layer, x), dtype=np.float32)
            return self.run_graph_layers(h, start, kv, ffn, stepper if stepper is not None else stepper_of(ffn),
                                         record=record, first=layer + 1, f=f)
        return self._forward_numpy(h, layer, x, start, kv, ffn, False, record)

    def _forward_numpy(self, h, first: int, x, start: int, kv: KvCache, ffn: FfnCall, all_logits: bool,
                       record: LayerRecord | None) -> np.ndarray:
        """Layers from `first` on; with `x`, layer `first`'s attention already ran (h is its residual)."""
        cfg = self.config
        T = h.shape[0]
        positions = np.arange(start, start + T)
        for i in range(first, cfg.n_layers):
            w = self.layers[i]
            if x is None or i > first:
                a = self.attention(i, rms_norm(h, w.attn_norm, cfg.norm_eps), kv, positions)
                if w.post_attn_norm is not None:
                    a = rms_norm(a, w.post_attn_norm, cfg.norm_eps)
                h = h + a
                x = rms_norm(h, w.ffn_norm, cfg.norm_eps)
                if record is not None:
                    record(i, h, x)
            f = ffn(i, x)
            if w.post_ffn_norm is not None:
                f = rms_norm(f, w.post_ffn_norm, cfg.norm_eps)
            h = h + f
        kv.length = start + T
        return self.logits(h if all_logits else h[-1:])

    def run_graph_layers(self, h: np.ndarray, start: int, kv: KvCache, ffn: FfnCall, stepper: Stepper | None = None,
                         *, all_logits: bool = False, record: LayerRecord | None = None, first: int = 0,
                         f: np.ndarray | None = None) -> np.ndarray:
        """The layers from `first` on in the per-layer graphs, then the head: `h` (T, d) is the residual going into
        layer `first` and `f` the FFN output (T, d) of the layer before it (None: layer 0, nothing to add)."""
        return run_to_end(self._graph_layers(h, start, kv, ffn, stepper, all_logits, record, first, f))

    def _graph_layers(self, h: np.ndarray, start: int, kv: KvCache, ffn: FfnCall, stepper: Stepper | None,
                      all_logits: bool, record: LayerRecord | None, first: int = 0, f: np.ndarray | None = None
                      ) -> Generator[int, None, np.ndarray]:
        """run_graph_layers, yielding the layers done between two layers (not after the last: the pass is then
        as good as done)."""
        cfg, graphs = self.config, self.graphs
        T = h.shape[0]
        bases = {base: self.rope.table(base, start + T) for base in {cfg.rope_base_for(i) for i in range(cfg.n_layers)}}
        if f is None:
            f = graphs.zeros(T)   # layer 0 has no previous FFN output to add
        scored = stepper.scored_ffn(T) if stepper is not None and graphs.has_gate_scores else None
        for i in range(first, cfg.n_layers):
            if i > first:
                yield i
            cos, sin = bases[cfg.rope_base_for(i)]
            if scored is not None:
                h, x, scores = graphs.run_layer(i, h, f, kv.keys[i], kv.values[i], start, cos, sin, gate_scores=True)
                if record is not None:
                    record(i, h, x)
                out = scored(i, x, scores)
            else:
                h, x = graphs.run_layer(i, h, f, kv.keys[i], kv.values[i], start, cos, sin)
                if record is not None:
                    record(i, h, x)
                out = ffn(i, x)
            f = np.ascontiguousarray(out, dtype=np.float32)
        kv.length = start + T
        return graphs.run_head(h, f) if all_logits else graphs.run_head(h[-1:], f[-1:])


def run_to_end(steps: Generator[Any, None, Result]) -> Result:
    """What a generator returns, run to its end."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class NumpyDenseFfn:
    """Dense FFN in numpy fp32 from dequantised weights: the reference the ONNX graphs are checked against."""

    def __init__(self, model: TransformerModel):
        t = model.gguf.tensors
        self.act = ACTIVATIONS[model.config.activation]
        self.weights = [tuple(dequantize(t[f"blk.{i}.{n}.weight"]) for n in ("ffn_gate", "ffn_up", "ffn_down"))
                        for i in range(model.config.n_layers)]

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        g, u, d = self.weights[layer]
        return (self.act(x @ g.T) * (x @ u.T)) @ d.T
