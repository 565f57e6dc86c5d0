"""Starting the HTTP API costs no more memory than the model it serves: the input-norm limit the walk-ffn route
checks residuals against is read from the norm weights alone, not from dequantised attention weights; and a stopped
server lets its engine and decode batch go."""
from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import numpy as np
import openai

from larql_desktop.api.server import INPUT_NORM_MARGIN, create_app, max_ffn_input_norm, start_server
from larql_desktop.engine.cache.walk import WalkSettings
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


def test_a_stopped_server_lets_its_engine_and_decode_batch_go(smollm2):
    """FastAPI keeps the last endpoints a process served in module-wide caches; ours close over the engine and the
    batch, so a stopped server kept both (and the batched decoder's sessions) until the process ended."""
    for dense in (True, False):
        engine = LarqlEngine(smollm2, walk=WalkSettings(dense=dense))
        handle = start_server(engine, "127.0.0.1", 0)
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="anything", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=smollm2.name, max_tokens=3,
                                               messages=[{"role": "user", "content": "Hello"}])
        assert reply.usage.completion_tokens >= 1
        client.close()
        batch = handle.server.config.app.state.batch
        assert batch is not None
        gone = [weakref.ref(engine), weakref.ref(batch)]
        handle.stop()
        del engine, handle, client, reply, batch
        gc.collect()
        assert [ref() is None for ref in gone] == [True, True], f"dense={dense}"
