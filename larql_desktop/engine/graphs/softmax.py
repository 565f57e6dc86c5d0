"""The softmax of one step's logits in onnxruntime, for the probabilities a reply's token view shows.

A chat reply shows, per token, the model's most likely tokens with their probabilities, so every decode step
needs the softmax's normaliser over the whole vocabulary. numpy's float32 exp is not vectorised on an AVX2-only
CPU: the pass took 82 us of a SmolLM2 step (49,152 logits) and 424 us of a Gemma step (262,144), where MLAS's
Softmax takes 33 and 144 us, call included. Its exp and float32 sums give probabilities within ~5e-5 of a
float64 softmax (relative): far below the 0.1% the token view prints. One node, no file: its serialised
graph is kept in graphs/onnx_deferred.py, so that a load needs no `onnx`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnxruntime as ort

from larql_desktop.engine.graphs.onnx_deferred import SOFTMAX_MODEL
from larql_desktop.engine.graphs.store import PROVIDERS, Binding, session_options


class OnnxSoftmax:
    """Softmax over a vector of `size` float32 logits. The session is shared; `bound()` gives each caller
    (one per thread at a time) its own binding and output buffer."""

    def __init__(self, size: int, threads: int = 1):
        if size < 1:
            raise ValueError(f"a softmax needs at least one logit, not {size}")
        self.size = int(size)
        self._session = ort.InferenceSession(SOFTMAX_MODEL, session_options(threads), providers=PROVIDERS)

    def bound(self) -> Callable[[np.ndarray], np.ndarray]:
        """A function from logits (float32, `size`) to their probabilities. It writes them into one buffer,
        overwritten by its next call: read what you need before calling again."""
        binding = Binding(self._session)
        out = np.empty(self.size, np.float32)
        binding.bind_output("probabilities", out)

        def probabilities(logits: np.ndarray) -> np.ndarray:
            z = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
            if z.size != self.size:
                raise ValueError(f"{z.size} logits given to a softmax over {self.size}")
            binding.bind_input("logits", z)
            binding.run()
            return out
        return probabilities
