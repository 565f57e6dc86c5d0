"""The cache key of the walk FFN: the top-K features a normed FFN input selects by |gate score|, and a 64-bit
hash of that set of ids (LARQL's key: two inputs that select the same features share an entry), optionally
built from only the k' strongest of them (the key-stability question of the seed's ADR).

The set is hashed as its bitset (bit i set for feature i, little-endian bit order, trailing zero bytes
dropped): one canonical string per set whatever the order of the ids, ~200 bytes at K = 1213 of 1536 rather
than the 4.9 KB of the sorted int32 ids hashed before, and what a hit's selection mask packs into directly
(`mask_key`) with no ids in between."""
from __future__ import annotations

import hashlib

import numpy as np

SEED_K_RATIO = 8092 / 10240          # the seed's default K on Gemma 3 4B
FULL_K_NUM, FULL_K_DEN = 4, 5        # K >= 4/5 of the intermediate size -> dense FFN (no KNN, no cache)



def default_top_k(intermediate: int) -> int:
    return int(intermediate * SEED_K_RATIO)


def is_full_k(top_k: int, intermediate: int) -> bool:
    return top_k * FULL_K_DEN >= intermediate * FULL_K_NUM


def _bitset_key(packed: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(packed.tobytes().rstrip(b"\0"), digest_size=8).digest(), "little")


def feature_key(feature_ids: np.ndarray) -> int:
    """64-bit key of a feature set: order-independent and stable across processes (see the module's note)."""
    ids = np.asarray(feature_ids, dtype=np.int64).reshape(-1)
    bits = np.zeros(int(ids.max()) + 1 if ids.size else 0, bool)
    bits[ids] = True
    return _bitset_key(np.packbits(bits, bitorder="little"))


def mask_key(selected: np.ndarray) -> int:
    """feature_key(np.flatnonzero(selected)) of a boolean mask (F,), without making the ids."""
    return packed_mask_key(np.packbits(selected, bitorder="little"))


def packed_mask_key(packed: np.ndarray) -> int:
    """mask_key of a mask already packed (np.packbits, little-endian bit order): one row of many packed at once."""
    return _bitset_key(packed)


def _strongest_mask(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k largest magnitudes; at a tie on the k-th value the lower indices win.

    That is onnx TopK's rule (its spec, and onnxruntime's kernel: tests/test_walk_graphs.py checks it), so the
    top-K walk graph (graphs/ffn.py: TopK inside the graph) selects exactly the features this does. A plain
    argpartition would pick among tied features arbitrarily."""
    n = magnitudes.size
    threshold = np.partition(magnitudes, n - k)[n - k]    # the k-th largest
    at_least = magnitudes >= threshold                     # (NaN is never >=: NaN magnitudes rank last)
    if np.count_nonzero(at_least) == k:                    # no tie straddles the k-th place: the usual case
        return at_least
    if np.isnan(magnitudes).any():   # an overflowed input: NaN ranked last, as a stable argsort ranks it
        chosen = np.zeros(n, bool)
        chosen[np.argsort(-magnitudes, kind="stable")[:k]] = True
        return chosen
    above = magnitudes > threshold
    above[np.flatnonzero(magnitudes == threshold)[:k - np.count_nonzero(above)]] = True
    return above


def select_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask (F,) of the top-k features by |score| for one position (ties: see `_strongest_mask`)."""
    if k >= scores.size:
        return np.ones(scores.size, bool)
    return _strongest_mask(np.abs(scores), k)


def select_masks(scores: np.ndarray, k: int) -> np.ndarray:
    """select_mask of each row of scores (T, F), as (T, F) bool: one partition for all rows (a prefill's T
    positions at each layer), each row with a tie at its k-th place (or a NaN) then settled by select_mask."""
    scores = np.asarray(scores)
    rows, n = scores.shape
    if k >= n:
        return np.ones((rows, n), bool)
    magnitudes = np.abs(scores)
    thresholds = np.partition(magnitudes, n - k, axis=1)[:, n - k]
    masks = magnitudes >= thresholds[:, None]
    for row in np.flatnonzero(np.count_nonzero(masks, axis=1) != k):
        masks[row] = _strongest_mask(magnitudes[row], k)
    return masks


def select_features(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top-k features by |score| for one position, ascending (ties: see `_strongest_mask`)."""
    return np.flatnonzero(select_mask(scores, k))


def key_features(scores: np.ndarray, selected: np.ndarray, width: int) -> np.ndarray:
    """The `width` strongest of the selected features: what the cache key is built from (ascending when
    `selected` is, as select_features gives it; the same tie rule)."""
    if width >= selected.size:
        return selected
    return selected[_strongest_mask(np.abs(scores[selected]), width)]
