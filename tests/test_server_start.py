"""Starting the HTTP API costs no more memory than the model it serves: the input-norm limit the walk-ffn route
checks residuals against is read from the norm weights alone, not from dequantised attention weights."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from larql_desktop.api.server import INPUT_NORM_MARGIN, create_app, max_ffn_input_norm
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.transformer import TransformerModel


def test_the_app_starts_without_dequantising_the_attention_weights(smollm2):
    fresh = replace(smollm2, transformer=TransformerModel(smollm2.gguf, smollm2.config))
    create_app(LarqlEngine(fresh))
    assert not fresh.transformer.attention_weights_loaded
    limits = max_ffn_input_norm(fresh)
    assert not fresh.transformer.attention_weights_loaded
    # The same limits as from the dequantised layers (which the numpy path loads on first use).
    d = smollm2.config.hidden
    expected = [INPUT_NORM_MARGIN * np.sqrt(d) * float(np.abs(w.ffn_norm).max()) for w in fresh.transformer.layers]
    assert fresh.transformer.attention_weights_loaded
    assert limits.shape == (smollm2.config.n_layers,)
    np.testing.assert_array_equal(limits, np.array(expected))
    np.testing.assert_array_equal(max_ffn_input_norm(fresh), limits)    # and again from the loaded layers
