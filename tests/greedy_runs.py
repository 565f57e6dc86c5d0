"""A prefill and greedy decode through any FFN, for tests comparing what different FFNs and caches compute."""
from __future__ import annotations

import numpy as np

from larql_desktop.engine.model.transformer import KvCache


def run_sequence(model, ffn, ids, n_decode):
    """Prefill `ids`, then greedily decode; returns (tokens, logits of every decode step)."""
    kv = KvCache(model.config)
    logits = model.transformer.forward(ids, kv, ffn)[-1]
    tokens, all_logits = [], []
    for _ in range(n_decode):
        token = int(np.argmax(logits))
        tokens.append(token)
        logits = model.transformer.forward([token], kv, ffn)[-1]
        all_logits.append(logits)
    return tokens, np.stack(all_logits)
