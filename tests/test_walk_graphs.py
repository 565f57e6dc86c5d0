"""The walk's selection inside the graphs: onnx TopK and keys.select_features pick the same features (ties
included), the top-K walk graph computes the walk graph's output bit for bit, and a walk with every cache tier
off runs it (one FFN call per layer, no scores handed over)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from larql_desktop.engine.cache.keys import (default_top_k, feature_key, key_features, mask_key, select_features,
                                             select_mask, select_masks)
from larql_desktop.engine.cache.tiers import TierSettings
from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.graphs.decoder import threshold_check_nodes
from larql_desktop.engine.graphs.ffn import top_k_mask_nodes, top_k_threshold_nodes
from larql_desktop.engine.graphs.store import make_model, session_options
from larql_desktop.engine.model.overlay import BaseFeatureWeights, Patch, PatchOperation, PatchOverlay

OFF = TierSettings(enabled=False)


def reference_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The rule spelled out: by |score| descending, the lower index first among equals; ascending ids."""
    order = np.lexsort((np.arange(scores.size), -np.abs(scores)))
    return np.sort(order[:k])


@pytest.fixture(scope="module")
def mask_session():
    """The very nodes the top-K walk graph selects with, alone in a graph."""
    model = make_model(top_k_mask_nodes("scores", "k", "mask"), [],
                       [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["T", "F"]),
                        helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                       [helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["T", "F"])], "top_k_mask")
    return ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def threshold_session():
    """The whole-step decoders' selection and its check (the nodes the walked decoders are built from), alone."""
    inits: list = []
    nodes = top_k_threshold_nodes("scores", "k", "selection_weights") + threshold_check_nodes(inits)
    model = make_model(nodes, inits,
                       [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["T", "F"]),
                        helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                       [helper.make_tensor_value_info("selection_weights", TensorProto.FLOAT, ["T", "F"]),
                        helper.make_tensor_value_info("settled", TensorProto.BOOL, ["T"])], "top_k_threshold")
    return ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])


def tie_heavy_rows(rng, rows: int, width: int) -> np.ndarray:
    """Small integers with random signs: most k-th places are ties, some between +v and -v."""
    return rng.integers(-6, 7, (rows, width)).astype(np.float32)


def test_select_features_breaks_ties_by_lower_index_and_returns_ascending_ids():
    rng = np.random.default_rng(0)
    for _ in range(500):
        width = int(rng.integers(2, 200))
        k = int(rng.integers(1, width))
        row = tie_heavy_rows(rng, 1, width)[0] if rng.random() < 0.7 else rng.standard_normal(width).astype(np.float32)
        chosen = select_features(row, k)
        assert np.array_equal(chosen, reference_top_k(row, k))
    scores = np.array([2.0, -3.0, 3.0, 1.0, -3.0, 2.0], np.float32)
    assert select_features(scores, 2).tolist() == [1, 2]          # three at |3|: the two lowest ids
    assert select_features(scores, 4).tolist() == [0, 1, 2, 4]    # the |2| tie: id 0 before id 5
    chosen = select_features(scores, 5)
    assert key_features(scores, chosen, 2).tolist() == [1, 2]     # the key's k' strongest: the same rule


def test_the_key_of_a_mask_is_the_key_of_its_ids():
    rng = np.random.default_rng(5)
    for _ in range(300):
        width = int(rng.integers(1, 3000))
        mask = rng.random(width) < rng.random()
        ids = np.flatnonzero(mask)
        assert mask_key(mask) == feature_key(ids) == feature_key(rng.permutation(ids))
        assert mask_key(np.concatenate([mask, np.zeros(int(rng.integers(1, 40)), bool)])) == mask_key(mask)
        row = rng.integers(-3, 4, width).astype(np.float32)
        assert np.array_equal(np.flatnonzero(select_mask(row, width // 2 + 1)), select_features(row, width // 2 + 1))
    assert feature_key([0]) != feature_key([]) != feature_key([8]) != feature_key([0, 8])
    assert feature_key(np.array([3, 900], np.int32)) == feature_key([900, 3])


@pytest.mark.parametrize("key_width", [None, 40])
def test_the_walk_keys_a_lookup_by_its_selected_features(smollm2, key_width):
    cfg = smollm2.config
    log = []
    walk = WalkFfn(smollm2.ffn, WalkSettings(key_width=key_width), model_checksum=smollm2.checksum,
                   l1=LarqlEngine(smollm2).l2, key_log=log)
    x = np.random.default_rng(6).standard_normal((1, cfg.hidden)).astype(np.float32)
    scores = smollm2.ffn.gate_scores(4, x)
    walk.call_with_scores(4, x, scores)
    k, width = walk.settings.top_k, walk.settings.key_width
    assert log == [(4, (walk.namespace(), feature_key(key_features(scores[0], select_features(scores[0], k), width))))]


def test_nan_scores_rank_last():
    scores = np.array([np.nan, 1.0, -4.0, np.nan, 2.0], np.float32)
    assert select_features(scores, 3).tolist() == [1, 2, 4]
    assert select_features(scores, 4).tolist() == [0, 1, 2, 4]


def test_the_masks_of_many_rows_at_once_are_each_rows_own():
    """select_masks (a prefill's positions in one partition) against select_mask row by row: ties at the k-th
    place, between +v and -v, NaN rows and every k from 1 to the width."""
    rng = np.random.default_rng(2)
    for trial in range(300):
        width = int(rng.integers(1, 400))
        k = int(rng.integers(1, width + 2))
        rows = tie_heavy_rows(rng, 5, width) if trial % 2 else rng.standard_normal((5, width)).astype(np.float32)
        if trial % 3 == 0:
            rows[int(rng.integers(5)), rng.integers(0, width, 3)] = np.nan
        masks = select_masks(rows, k)
        assert masks.dtype == bool and masks.shape == rows.shape
        assert np.array_equal(masks, np.stack([select_mask(row, k) for row in rows]))
    assert select_masks(np.array([[1.0, -3.0, 3.0, 2.0]], np.float32), 2).tolist() == [[False, True, True, False]]


def test_onnx_top_k_mask_selects_what_select_features_selects(mask_session):
    rng = np.random.default_rng(1)
    for trial in range(200):
        width = int(rng.integers(2, 1600))
        k = int(rng.integers(1, width + 1))
        rows = tie_heavy_rows(rng, 3, width) if trial % 2 else rng.standard_normal((3, width)).astype(np.float32)
        mask = mask_session.run(None, {"scores": rows, "k": np.array([k], np.int64)})[0]
        assert set(np.unique(mask).tolist()) <= {0.0, 1.0}
        for row, row_mask in zip(rows, mask):
            assert np.array_equal(np.flatnonzero(row_mask), select_features(row, k))


def test_a_settled_threshold_selection_is_the_top_k_and_an_unsettled_one_a_tie(threshold_session):
    """Where the check says settled, the threshold mask is select_features' choice; where it does not, the row has
    a tie at the k-th place or a NaN (the walk then selects itself). Every k from 1 to the width, ties between +v
    and -v, NaN and infinite rows."""
    rng = np.random.default_rng(3)
    outcomes = {True: 0, False: 0}
    for trial in range(300):
        width = int(rng.integers(2, 1600))
        k = int(rng.integers(1, width + 1))
        rows = tie_heavy_rows(rng, 4, width) if trial % 2 else rng.standard_normal((4, width)).astype(np.float32)
        if trial % 5 == 0:
            rows[0, int(rng.integers(width))] = np.nan
            rows[1, int(rng.integers(width))] = np.inf
        mask, settled = threshold_session.run(None, {"scores": rows, "k": np.array([k], np.int64)})
        assert set(np.unique(mask).tolist()) <= {0.0, 1.0}
        for row, row_mask, row_settled in zip(rows, mask, settled):
            outcomes[bool(row_settled)] += 1
            exact = select_features(row, k)
            if row_settled:
                assert np.array_equal(np.flatnonzero(row_mask), exact)
            else:
                magnitudes = np.sort(np.abs(row))[::-1]
                tie = k < width and magnitudes[k - 1] == magnitudes[k]
                assert tie or np.isnan(row).any()
    assert outcomes[True] > 300 and outcomes[False] > 300     # both cases were met
    real = rng.standard_normal((8, 1536)).astype(np.float32)
    assert threshold_session.run(None, {"scores": real, "k": np.array([1213], np.int64)})[1].all()


def _walked(graphs, layer: int, x: np.ndarray, k: int) -> np.ndarray:
    """The walk graph on the rows x, each row's mask the top k of its own gate scores (select_mask)."""
    scores = graphs.gate_scores(layer, x)
    mask = np.stack([select_mask(row, k) for row in scores]).astype(np.float32)
    return graphs.walk(layer, x, scores, mask)


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_top_k_walk_graph_is_the_walk_graph_bit_for_bit(model_name, request):
    model = request.getfixturevalue(model_name)
    cfg, graphs = model.config, model.ffn
    rng = np.random.default_rng(2)
    for layer in (0, cfg.n_layers // 2, cfg.n_layers - 1):
        x = (rng.standard_normal((4, cfg.hidden)) * rng.uniform(0.2, 5.0)).astype(np.float32)
        for k in (default_top_k(cfg.intermediate), 100, 1):
            assert np.array_equal(graphs.walk_top_k(layer, x, k), _walked(graphs, layer, x, k))   # prefill rows
            # One decode row, against the walk graph on that row alone: with AVX2 only, onnxruntime's
            # MatMulNBits rounds a row differently in a batch of 4 than alone (with AVX-512 it did not), so a row
            # is compared with the same computation at the same batch size.
            assert np.array_equal(graphs.walk_top_k(layer, x[1:2], k), _walked(graphs, layer, x[1:2], k))


def test_cache_off_walk_runs_the_top_k_graph_and_matches_the_cached_path(smollm2):
    cfg = smollm2.config
    off = LarqlEngine(smollm2, l1=OFF, l2=OFF).new_session().ffn
    cached = LarqlEngine(smollm2).new_session().ffn
    assert not off.stepper.takes_gate_scores    # the model runs the plain layer graph: no scores to hand over
    assert not off.stepper.takes_gate_scores_for(1) and off.stepper.takes_gate_scores_for(56)   # prefill: the layer graph's
    assert cached.stepper.takes_gate_scores and cached.stepper.takes_gate_scores_for(1)
    x = np.random.default_rng(3).standard_normal((1, cfg.hidden)).astype(np.float32)
    for layer in range(cfg.n_layers):
        out = off(layer, x)
        assert off.last_outcome == "bypass" and off.last_bypass == "cache_off"
        assert np.array_equal(out, smollm2.ffn.walk_top_k(layer, x, off.settings.top_k))
        assert np.array_equal(out, cached(layer, x))                        # a miss: the Python selection
        assert cached.last_outcome == "miss"


def test_an_insert_override_keeps_the_python_selection(smollm2):
    """A layer with an override needs the scores (its features' patched gates): the walk takes them again."""
    cfg = smollm2.config
    x = np.random.default_rng(4).standard_normal((1, cfg.hidden)).astype(np.float32)
    layer = 5
    feature = int(np.argmax(np.abs(smollm2.ffn.gate_scores(layer, x)[0])))     # surely among the selected
    base = BaseFeatureWeights(smollm2.gguf)
    gate, up, down = base.vectors(layer, feature)
    patch = Patch((PatchOperation("update", layer, feature, gate=gate, up=up, down=down * 3),),
                  smollm2.name, smollm2.checksum)
    walk = WalkFfn(smollm2.ffn, WalkSettings(), model_checksum=smollm2.checksum, patches=PatchOverlay.build([patch], base))
    plain = WalkFfn(smollm2.ffn, WalkSettings(), model_checksum=smollm2.checksum)
    assert walk.stepper.takes_gate_scores and not plain.stepper.takes_gate_scores
    assert not np.array_equal(walk(layer, x), plain(layer, x))               # the override is applied
    assert walk.last_bypass == "patched"
    assert np.array_equal(walk(layer + 1, x), plain(layer + 1, x))           # other layers: the base walk
