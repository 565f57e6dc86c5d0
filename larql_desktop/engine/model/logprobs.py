"""Log probabilities of sampled tokens, as the OpenAI API's `logprobs` reports them: the log-softmax of the model's
raw logits at that step (before penalties, temperature, top-k/top-p/min-p), with the most likely alternatives."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from larql_desktop.engine.model.generation import top_ids

MAX_TOP_LOGPROBS = 20       # as the OpenAI API caps top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float                          # of the sampled token
    top: tuple[tuple[int, float], ...]      # (token id, logprob) of the most likely tokens, most likely first


def token_logprobs(logits: np.ndarray, token_id: int, top_n: int) -> TokenLogprobs:
    """The log-softmax of `logits` (vocab,) at `token_id` and at the `top_n` most likely ids (a tie to the lower
    id). In float64, one pass: log p_i = z_i - max - log(sum exp(z - max)), exact to float64 rounding of the
    float32 logits (only requests that ask for logprobs pay its ~0.2 ms over SmolLM2's vocabulary)."""
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {top_n}")
    z32 = np.asarray(logits, dtype=np.float32).reshape(-1)
    z = z32.astype(np.float64)
    peak = float(z.max())
    log_total = peak + float(np.log(np.exp(z - peak).sum()))
    top = top_ids(z32, top_n) if top_n else ()
    return TokenLogprobs(int(token_id), float(z[token_id] - log_total),
                         tuple((int(i), float(z[i] - log_total)) for i in top))
