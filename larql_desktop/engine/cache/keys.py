"""The cache key of the walk FFN: the top-K features a normed FFN input selects by |gate score|, and a 64-bit
hash of their sorted ids (LARQL's key: two inputs that select the same features share an entry), optionally
built from only the k' strongest of them (the key-stability question of the seed's ADR)."""
from __future__ import annotations

import hashlib

import numpy as np

SEED_K_RATIO = 8092 / 10240          # the seed's default K on Gemma 3 4B
FULL_K_NUM, FULL_K_DEN = 4, 5        # K >= 4/5 of the intermediate size -> dense FFN (no KNN, no cache)



def default_top_k(intermediate: int) -> int:
    return int(intermediate * SEED_K_RATIO)


def is_full_k(top_k: int, intermediate: int) -> bool:
    return top_k * FULL_K_DEN >= intermediate * FULL_K_NUM


def feature_key(feature_ids: np.ndarray) -> int:
    """64-bit key of a feature set: order-independent (ids are sorted) and stable across processes."""
    ids = np.sort(np.asarray(feature_ids).astype("<i4"))   # the same bytes as sorting int64 ids; a cheaper sort
    return int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little")


def _strongest(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest magnitudes, ascending; at a tie on the k-th value the lower indices win.

    That is onnx TopK's rule (its spec, and onnxruntime's kernel: tests/test_ffn_cache.py checks it), so the
    fused walk graph (graphs/ffn.py: TopK inside the graph) selects exactly the features this does. A plain
    argpartition would pick among tied features arbitrarily."""
    n = magnitudes.size
    threshold = np.partition(magnitudes, n - k)[n - k]    # the k-th largest
    at_least = magnitudes >= threshold                     # (NaN is never >=: NaN magnitudes rank last)
    if np.count_nonzero(at_least) == k:                    # no tie straddles the k-th place: the usual case
        return np.flatnonzero(at_least)
    if np.isnan(magnitudes).any():   # an overflowed input: NaN ranked last, as a stable argsort ranks it
        return np.sort(np.argsort(-magnitudes, kind="stable")[:k])
    above = magnitudes > threshold
    ties = np.flatnonzero(magnitudes == threshold)[:k - np.count_nonzero(above)]
    above[ties] = True
    return np.flatnonzero(above)


def select_features(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top-k features by |score| for one position, ascending (ties: see `_strongest`)."""
    if k >= scores.size:
        return np.arange(scores.size)
    return _strongest(np.abs(scores), k)


def key_features(scores: np.ndarray, selected: np.ndarray, width: int) -> np.ndarray:
    """The `width` strongest of the selected features: what the cache key is built from (ascending when
    `selected` is, as select_features gives it; the same tie rule)."""
    if width >= selected.size:
        return selected
    return selected[_strongest(np.abs(scores[selected]), width)]
