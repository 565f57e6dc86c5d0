"""The analyses behind the window's pictures, on the real SmolLM2 without Qt: the reply x layer picture's codes, the
recomputed pass (where an INSERTed feature fires), the logit lens (its last layer is the model's own prediction)
and each feature's promoted tokens (against an independent numpy projection)."""
from __future__ import annotations

import numpy as np
import pytest

from larql_desktop.engine.analysis.lens import FeatureVocabulary, logit_lens, softmax_rows
from larql_desktop.engine.analysis.reply_pass import Cell, outcome_grid, run_reply_pass, uncached_walk
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.formats.quants import dequantize
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.model.outcomes import LayerOutcome
from larql_desktop.engine.model.transformer import KvCache, rms_norm
from larql_desktop.engine.model.overlay import Patch, PatchOperation

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(smollm2):
    return LarqlEngine(smollm2)


def test_outcome_grid_codes_each_recorded_outcome_and_marks_insert_fired():
    layers = [(LayerOutcome(0, "bypass", bypass="prefill"), LayerOutcome(1, "miss")),
              (LayerOutcome(0, "hit", "L2"), LayerOutcome(1, "bypass", bypass="patched")),
              ()]
    fired = np.array([[False, False, False], [False, True, False]])
    grid = outcome_grid(layers, 2, fired)
    assert grid.tolist() == [[Cell.BYPASS_PREFILL, Cell.L2_HIT, Cell.UNKNOWN],
                             [Cell.MISS, Cell.INSERT_FIRED, Cell.UNKNOWN]]


def test_the_logit_lens_last_layer_is_the_models_own_prediction(engine, smollm2):
    ids = chat_prompt_ids(smollm2, QUESTION)
    own = softmax_rows(smollm2.transformer.forward(ids, KvCache(smollm2.config), uncached_walk(engine)))[0]
    own_top = np.argsort(-own)[:5]
    reply_pass = run_reply_pass(engine, ids, [len(ids) - 1])
    assert reply_pass.residuals.shape == (smollm2.config.n_layers, 1, smollm2.config.hidden)
    lens = logit_lens(smollm2, reply_pass, 0, int(own_top[0]))
    assert len(lens.layers) == smollm2.config.n_layers
    last = lens.layers[-1]
    assert last.top_ids[0] == own_top[0] and last.chosen_rank == 1
    # The model's own five most likely tokens have the same probabilities at the lens's last layer.
    lens_p = dict(zip(last.top_ids, last.top_probabilities))
    assert set(lens_p) == set(int(i) for i in own_top) or \
        all(abs(own[i] - last.top_probabilities[-1]) < 2e-3 for i in set(own_top) ^ set(lens_p))
    for i in own_top:
        if int(i) in lens_p:
            assert lens_p[int(i)] == pytest.approx(float(own[i]), abs=2e-3)
    # Earlier layers rank the final choice lower (the first layer's residual hardly predicts it).
    assert lens.layers[0].chosen_rank > 1
    with pytest.raises(ValueError, match="out of range"):
        logit_lens(smollm2, reply_pass, 1, 0)


def test_an_inserted_feature_fires_where_its_biased_gate_is_positive(engine, smollm2):
    cfg = smollm2.config
    zeros = np.zeros(cfg.hidden, np.float32)
    ops = (PatchOperation("insert", 3, 11, zeros, zeros, zeros, gate_bias=1.0, entity="e", relation="r", target="t"),
           PatchOperation("insert", 5, 12, zeros, zeros, zeros, gate_bias=-1.0, entity="e", relation="r", target="t"))
    patch = Patch(ops, smollm2.name, smollm2.checksum, "always at 3, never at 5")
    engine.apply_patch(patch)
    try:
        ids = chat_prompt_ids(smollm2, QUESTION)
        reply_pass = run_reply_pass(engine, ids, [2, len(ids) - 1])
    finally:
        engine.remove_patch(patch.id)
    assert reply_pass.fired[3].all() and not np.delete(reply_pass.fired, 3, axis=0).any()
    assert reply_pass.fired_features[3] == ((11,), (11,)) and reply_pass.fired_features[5] == ((), ())
    with pytest.raises(ValueError, match="positions must lie within"):
        run_reply_pass(engine, ids, [len(ids)])


def test_promoted_tokens_equal_an_independent_numpy_projection(engine, smollm2):
    layer, features = 7, [0, 5, 900]
    vocabulary = FeatureVocabulary(engine)
    promoted = vocabulary.promoted(layer, features)
    # Independently: the down column through rms_norm(output_norm) and the (tied) embedding matrix, in numpy.
    t = smollm2.gguf.tensors
    down = dequantize(t[f"blk.{layer}.ffn_down.weight"])
    head = dequantize(t.get("output.weight", t["token_embd.weight"]))
    norm = dequantize(t["output_norm.weight"])
    for feature, tokens in zip(features, promoted):
        logits = rms_norm(down[:, feature][None, :], norm, smollm2.config.norm_eps)[0] @ head.T
        fifth = np.sort(logits)[-5]
        assert tokens.feature == feature and len(tokens.ids) == 5
        # The head graph multiplies in its own precision (its activations quantised): within 1% of numpy's fp32.
        assert np.allclose(logits[list(tokens.ids)], tokens.logits, rtol=1e-2)
        assert all(logits[i] >= fifth - 1e-2 * abs(fifth) for i in tokens.ids)   # the five largest, up to ties
        assert list(tokens.logits) == sorted(tokens.logits, reverse=True)
    assert vocabulary.promoted(layer, [5])[0] is promoted[1]                 # cached per layer
    with pytest.raises(ValueError, match="features must lie within"):
        vocabulary.promoted(layer, [smollm2.config.intermediate])
