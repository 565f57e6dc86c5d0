"""The feature view (engine/analysis/features.py) on the real SmolLM2: strongest features, key and fired INSERTs."""
from __future__ import annotations

import numpy as np
import pytest

from larql_desktop.engine.analysis.collapse import prompt_ids
from larql_desktop.engine.analysis.features import feature_view, normed_ffn_input
from larql_desktop.engine.cache.keys import feature_key, key_features, select_features
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.model.overlay import Patch, PatchOperation

LAYER = 9


def _dense_inputs(model, ids) -> np.ndarray:
    """(n_layers, d) normed FFN inputs at the last of `ids`, computed independently with the dense FFN."""
    rows = [None] * model.config.n_layers

    def recording(layer, x):
        rows[layer] = x[-1].copy()
        return model.ffn.dense(layer, x)
    model.transformer.forward(ids, KvCache(model.config), recording)
    return np.stack(rows)


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_strongest_feature_and_key_match_an_independent_computation(request, model_name):
    smollm2 = request.getfixturevalue(model_name)
    # Full K is dense: the residual stream is the model's own, so a dense recording reproduces the input.
    engine = LarqlEngine(smollm2, WalkSettings(top_k=smollm2.config.intermediate - 1, key_width=16))
    ids = prompt_ids(smollm2, "What is the capital of France?")
    view = feature_view(engine, ids, LAYER)
    x = _dense_inputs(smollm2, ids)[LAYER]
    scores = smollm2.ffn.gate_scores(LAYER, x[None, :])[0].astype(np.float64)
    assert view.rows[0].feature == int(np.argmax(np.abs(scores)))
    assert len(view.rows) == 20 and view.position == len(ids) - 1 and view.token_id == ids[-1]
    strongest = np.argsort(-np.abs(scores))[:20]
    assert [r.feature for r in view.rows] == strongest.tolist()
    assert np.allclose([r.score for r in view.rows], scores[strongest], rtol=1e-3, atol=1e-3)
    key = key_features(scores, select_features(scores, view.top_k), 16)
    assert view.key_width == 16 and view.key_hash == feature_key(key)
    assert [r.in_key for r in view.rows] == [f in set(key.tolist()) for f in strongest]
    assert sum(r.in_key for r in view.rows) == 16      # the 16 strongest form the key
    assert view.fired == () and not view.layer_patched and all(r.patch_id is None for r in view.rows)


def test_an_insert_that_fires_on_the_input_is_flagged_with_its_patch(smollm2):
    engine = LarqlEngine(smollm2)
    ids = prompt_ids(smollm2, "What is the capital of France?")
    # The input at LAYER is unchanged by a patch at LAYER (only later layers see its output).
    x = normed_ffn_input(engine, ids, LAYER)
    cfg = smollm2.config
    rng = np.random.default_rng(0)
    fires = (x / float(x @ x) * 80.0).astype(np.float32)     # gate score 80 - 1 at x: the strongest
    small = lambda: (rng.standard_normal(cfg.hidden) * 0.01).astype(np.float32)  # noqa: E731
    ops = (PatchOperation("insert", LAYER, 17, fires, small(), small(), -1.0, "e", "r", "t"),
           PatchOperation("insert", LAYER, 23, -fires, small(), small(), -1.0, "e", "r", "t"))  # silent here
    patch = Patch(ops, smollm2.name, smollm2.checksum)
    engine.apply_patch(patch)
    view = feature_view(engine, ids, LAYER)
    assert view.layer_patched
    assert view.rows[0].feature == 17 and view.rows[0].patch_id == patch.id and view.rows[0].fired_override
    assert view.rows[0].score == pytest.approx(79.0, rel=1e-3)
    assert [r.feature for r in view.fired] == [17]
    assert all(r.patch_id is None for r in view.rows[1:])
    engine.remove_patch(patch.id)
    after = feature_view(engine, ids, LAYER)
    assert after.fired == () and all(r.patch_id is None for r in after.rows)


@pytest.mark.parametrize("ids, layer, top_n, message", [
    ([], 0, 20, "at least one token"), ([1, 2], 99, 20, "out of range"), ([1, 2], 0, 0, "at least one feature")])
def test_bad_requests_are_refused(smollm2, ids, layer, top_n, message):
    with pytest.raises(ValueError, match=message):
        feature_view(LarqlEngine(smollm2), ids, layer, top_n)
