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


def select_features(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top-k features by |score| for one position (in no particular order)."""
    if k >= scores.size:
        return np.arange(scores.size)
    return np.argpartition(-np.abs(scores), k - 1)[:k]


def key_features(scores: np.ndarray, selected: np.ndarray, width: int) -> np.ndarray:
    """The `width` strongest of the selected features: what the cache key is built from."""
    if width >= selected.size:
        return selected
    return selected[np.argpartition(-np.abs(scores[selected]), width - 1)[:width]]
