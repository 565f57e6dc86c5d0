"""Model hyper-parameters read once from a GGUF header; architecture quirks are settled here, not in forward."""
from __future__ import annotations

import math
from dataclasses import dataclass

from larql_desktop.engine.formats.gguf import GgufError, GgufFile

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int            # d
    intermediate: int      # FFN width (number of features per layer)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope_base: float
    context_length: int
    # llama.cpp's "NORM" rope rotates adjacent pairs (GGUF stores llama q/k permuted for it);
    # Gemma uses NEOX rope, which rotates the two halves of each head.
    rope_adjacent_pairs: bool
    activation: str        # "silu" or "gelu_tanh"
    embed_scale: float     # Gemma multiplies embeddings by sqrt(d)
    attn_scale: float
    # Gemma 3: local layers use a sliding window and their own rope base; every Nth layer is global.
    sliding_window: int = 0
    rope_base_local: float = 0.0
    global_layer_period: int = 0
    has_qk_norm: bool = False
    has_post_norms: bool = False

    def is_local_layer(self, layer: int) -> bool:
        return self.global_layer_period > 0 and (layer + 1) % self.global_layer_period != 0

    def rope_base_for(self, layer: int) -> float:
        return self.rope_base_local if self.is_local_layer(layer) else self.rope_base

    def window_for(self, layer: int) -> int:
        """Attention window in positions (0 means unlimited)."""
        return self.sliding_window if self.is_local_layer(layer) else 0

    @classmethod
    def from_gguf(cls, gguf: GgufFile) -> "ModelConfig":
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GgufError(f"{gguf.path}: unsupported architecture {arch!r}; "
                            f"larql-desktop runs {', '.join(SUPPORTED_ARCHITECTURES)} models")

        def need(suffix):
            value = gguf.arch_key(suffix)
            if value is None:
                raise GgufError(f"{gguf.path}: missing metadata key {arch}.{suffix}")
            return value

        hidden = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = int(gguf.arch_key("attention.key_length", hidden // n_heads))
        token_embd = gguf.tensors.get("token_embd.weight")
        if token_embd is None:
            raise GgufError(f"{gguf.path}: no token_embd.weight tensor")
        common = dict(
            arch=arch,
            n_layers=int(need("block_count")),
            hidden=hidden,
            intermediate=int(need("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(gguf.arch_key("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab_size=int(token_embd.shape[0]),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            context_length=int(gguf.arch_key("context_length", 2048)),
        )
        if arch == "llama":
            return cls(**common, rope_base=float(gguf.arch_key("rope.freq_base", 10000.0)),
                       rope_adjacent_pairs=True, activation="silu", embed_scale=1.0,
                       attn_scale=1.0 / math.sqrt(head_dim))
        # gemma3: values llama.cpp hard-codes because the GGUF does not carry them.
        return cls(**common, rope_base=float(gguf.arch_key("rope.freq_base", 1_000_000.0)),
                   rope_adjacent_pairs=False, activation="gelu_tanh", embed_scale=math.sqrt(hidden),
                   attn_scale=1.0 / math.sqrt(head_dim),
                   sliding_window=int(gguf.arch_key("attention.sliding_window", 512)),
                   rope_base_local=10_000.0, global_layer_period=6,
                   has_qk_norm=True, has_post_norms=True)
