"""The batched served and replay decoders (graphs/batched.py) on the real models: each row of one call, at its own
position with its own planned FFN outputs, computes what the single served and replay decoders compute for it
alone, bit for bit (its KV rows too), and the head run once for all rows gives each row the logits the head gives
it alone; Gemma with a row past its sliding window."""
from __future__ import annotations

import numpy as np
import pytest

from larql_desktop.engine.completions import decode_batch
from larql_desktop.engine.graphs.decoder import ReplayPass, ServedPass, WalkedPass
from larql_desktop.engine.model.transformer import KvCache

TEXTS = ["The capital of France is", "A spider has eight legs and spins webs of silk. ",
         "Water boils at one hundred degrees Celsius at sea level. "]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    return request.getfixturevalue(request.param)


def _copy(model, kv: KvCache) -> KvCache:
    out = KvCache(model.config, capacity=kv.length + 4)
    for i in range(model.config.n_layers):
        out.keys[i][:, :kv.length] = kv.keys[i][:, :kv.length]
        out.values[i][:, :kv.length] = kv.values[i][:, :kv.length]
    out.length = kv.length
    return out


def _rows(model) -> list[tuple[KvCache, int]]:
    """Prefilled contexts of different lengths (one past the sliding window where the model has one) and the
    token each decodes next."""
    window = model.config.sliding_window or 0
    rows = []
    for i, text in enumerate(TEXTS):
        repeats = 1 if i != 1 else 3
        ids = model.tokenizer.encode(text * repeats)
        while i == 1 and len(ids) <= window + 1:      # the row attends across the window's edge
            repeats *= 2
            ids = model.tokenizer.encode(text * repeats)
        kv = KvCache(model.config)
        logits = model.transformer.forward(ids, kv, model.ffn)
        rows.append((kv, int(np.argmax(logits[-1]))))
    return rows


def _pool(model, rows: list[tuple[KvCache, int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A batch's KV pool (per layer (B, kv_heads, C, hd)) holding each row's prefilled context, with room for one
    more position each."""
    cfg = model.config
    capacity = max(kv.length for kv, _ in rows) + 2
    keys = [np.zeros((len(rows), cfg.n_kv_heads, capacity, cfg.head_dim), np.float32) for _ in range(cfg.n_layers)]
    values = [np.zeros_like(k) for k in keys]
    for b, (kv, _) in enumerate(rows):
        for i in range(cfg.n_layers):
            keys[i][b, :, :kv.length] = kv.keys[i][:, :kv.length]
            values[i][b, :, :kv.length] = kv.values[i][:, :kv.length]
    return keys, values


def _assert_row_kv_equal(pool_keys, pool_values, b: int, kv: KvCache, own: KvCache) -> None:
    """Row b of the pool holds what the single decoder left in `own`: the context and the step's new position."""
    for i in range(len(pool_keys)):
        assert np.array_equal(pool_keys[i][b, :, :kv.length + 1], own.keys[i][:, :kv.length + 1])
        assert np.array_equal(pool_values[i][b, :, :kv.length + 1], own.values[i][:, :kv.length + 1])


def test_batched_served_and_replay_rows_equal_the_single_decoders_bit_for_bit(model):
    cfg, transformer = model.config, model.transformer
    single, batched = transformer.decoder, decode_batch(model, 4).decoder
    rows = _rows(model)
    B, n = len(rows), cfg.n_layers
    # Each row's plan: what its walked step computes (outputs and selections), as a served step is given them.
    plans = []
    for kv, token in rows:
        walked = single.run_walked(transformer.embed(np.array([token])), kv.length, _copy(model, kv), transformer.rope,
                                   64)
        plans.append((walked.outputs, walked.selections))
    h = transformer.embed(np.array([token for _, token in rows]))
    positions = np.array([kv.length for kv, _ in rows], np.int64)
    served = np.stack([outputs for outputs, _ in plans], axis=1).reshape(n * B, cfg.hidden)       # layer-major
    selections = np.stack([chosen for _, chosen in plans], axis=1).reshape(n * B, cfg.intermediate)

    # "both": the served decoder's call with row 1 replayed (a step whose rows want both runs them in one call).
    for call in ("served", "replay", "both"):
        pool_keys, pool_values = _pool(model, rows)
        if call != "replay":
            together = batched.run_served(h, positions, pool_keys, pool_values, transformer.rope, served, selections,
                                          [call == "both" and b == 1 for b in range(B)])
        else:
            together = batched.run_replay(h, positions, pool_keys, pool_values, transformer.rope, served)
        head = transformer.graphs.run_head(np.stack([p.residuals[-1] for p in together]),
                                           np.stack([outputs[-1] for outputs, _ in plans]))
        for b, ((kv, token), (outputs, chosen)) in enumerate(zip(rows, plans)):
            kind = "replay" if call == "replay" or (call == "both" and b == 1) else "served"
            assert isinstance(together[b], ReplayPass if kind == "replay" else ServedPass)
            own = _copy(model, kv)
            alone = (single.run_served(h[b:b + 1], kv.length, own, transformer.rope, outputs, chosen)
                     if kind == "served" else
                     single.run_replay(h[b:b + 1], kv.length, own, transformer.rope, outputs))
            assert np.array_equal(together[b].inputs, alone.inputs), (kind, b)
            assert np.array_equal(together[b].residuals, alone.residuals), (kind, b)
            if kind == "served":
                assert np.array_equal(together[b].scores, alone.scores), b
                assert np.array_equal(together[b].settled, alone.settled), b
                assert together[b].settled.any()           # the walked step's own selections: the scores' top K
            _assert_row_kv_equal(pool_keys, pool_values, b, kv, own)      # the row's new keys and values, in place
            logits = transformer.graphs.run_head(alone.residuals[-1:], outputs[-1:])
            assert np.array_equal(head[b:b + 1], logits), (call, b)


def test_the_batched_decoders_refuse_outputs_not_one_per_layer_and_row_and_unknown_kinds(smollm2):
    cfg = smollm2.config
    batched = decode_batch(smollm2, 2).decoder
    keys = [np.zeros((2, cfg.n_kv_heads, 8, cfg.head_dim), np.float32) for _ in range(cfg.n_layers)]
    with pytest.raises(ValueError, match="one row per layer and batch row, layer-major"):
        batched.run_replay(np.zeros((2, cfg.hidden), np.float32), np.array([1, 2]), keys, keys,
                           smollm2.transformer.rope, np.zeros((cfg.n_layers, cfg.hidden), np.float32))
    served = np.zeros((2 * cfg.n_layers, cfg.hidden), np.float32)
    with pytest.raises(ValueError, match=r"one kind per row \(walked, served or replay\) for 2 rows"):
        batched.run_mixed(np.zeros((2, cfg.hidden), np.float32), np.array([1, 2]), keys, keys,
                          smollm2.transformer.rope, 64, ["dense", "walked"], served,
                          np.zeros((2 * cfg.n_layers, cfg.intermediate), bool))


def test_the_mixed_decoder_computes_each_row_as_the_decoder_of_its_kind(model):
    cfg, transformer = model.config, model.transformer
    single, batched = transformer.decoder, decode_batch(model, 4).decoder
    rows = _rows(model)
    B, n, k = len(rows), cfg.n_layers, 64
    h = transformer.embed(np.array([token for _, token in rows]))
    kinds = ["walked", "served", "replay"]           # the long row served, the last replayed, their own plans
    served = np.zeros((n, B, cfg.hidden), np.float32)
    selections = np.zeros((n, B, cfg.intermediate), bool)
    plans = {}
    for b in (1, 2):
        plans[b] = single.run_walked(h[b:b + 1], rows[b][0].length, _copy(model, rows[b][0]), transformer.rope, k)
        served[:, b], selections[:, b] = plans[b].outputs, plans[b].selections
    positions = np.array([kv.length for kv, _ in rows], np.int64)
    pool_keys, pool_values = _pool(model, rows)
    together = batched.run_mixed(h, positions, pool_keys, pool_values, transformer.rope, k, kinds,
                                 served.reshape(n * B, -1), selections.reshape(n * B, -1))
    for b, (kv, _) in enumerate(rows):
        own = _copy(model, kv)
        if kinds[b] == "served":
            alone = single.run_served(h[b:b + 1], kv.length, own, transformer.rope, plans[b].outputs,
                                      plans[b].selections)
            fields = ("inputs", "scores", "residuals", "settled")
            assert isinstance(together[b], ServedPass) and together[b].settled.all()   # the scores' own top K
        elif kinds[b] == "replay":
            alone = single.run_replay(h[b:b + 1], kv.length, own, transformer.rope, plans[b].outputs)
            fields = ("inputs", "residuals")
            assert isinstance(together[b], ReplayPass)
        else:
            alone = single.run_walked(h[b:b + 1], kv.length, own, transformer.rope, k)
            fields = ("inputs", "scores", "selections", "outputs", "residuals", "settled")
            assert isinstance(together[b], WalkedPass)
        for field in fields:
            assert np.array_equal(getattr(together[b], field), getattr(alone, field)), (b, field)
        _assert_row_kv_equal(pool_keys, pool_values, b, kv, own)


def test_the_batched_walked_decoder_computes_each_row_as_the_single_walked_decoder(model):
    """A step whose rows are all walked runs in the walked decoder (not the mixed one, which costs more): each
    row's pass and KV bit for bit the single walked decoder's."""
    cfg, transformer = model.config, model.transformer
    single, batched = transformer.decoder, decode_batch(model, 4).decoder
    rows = _rows(model)
    n, k = cfg.n_layers, int(cfg.intermediate * 0.79)
    h = transformer.embed(np.array([token for _, token in rows]))
    positions = np.array([kv.length for kv, _ in rows], np.int64)
    pool_keys, pool_values = _pool(model, rows)
    together = batched.run_walked(h, positions, pool_keys, pool_values, transformer.rope, k)
    for b, (kv, _) in enumerate(rows):
        own = _copy(model, kv)
        alone = single.run_walked(h[b:b + 1], kv.length, own, transformer.rope, k)
        assert isinstance(together[b], WalkedPass) and together[b].selections.sum(axis=1).tolist() == [k] * n
        for field in ("inputs", "scores", "selections", "outputs", "residuals", "settled"):
            assert np.array_equal(getattr(together[b], field), getattr(alone, field)), (b, field)
        _assert_row_kv_equal(pool_keys, pool_values, b, kv, own)
