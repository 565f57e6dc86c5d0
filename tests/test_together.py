"""Passes of several contexts run together (engine/model/together.py: each context's attention alone, one FFN call
and one head call for the rows of all) compute what each pass computes alone, bit for bit: the logits, every
layer's recorded rows and the KV cache; under the dense FFN, the walk and an INSERT overlay, on both models."""
import numpy as np
import pytest

from larql_desktop.engine.cache.tiers import CacheTier
from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.model.overlay import BaseFeatureWeights, Patch, PatchOperation, PatchOverlay
from larql_desktop.engine.model.together import (ROWS_TOGETHER, Resumed, Run, forward_together, resume_together,
                                                  runs_together)
from larql_desktop.engine.model.transformer import KvCache

TEXTS = ["The capital of France is", "The capital of France is Paris, and the capital of Spain is",
         "Tell me a short story about a dragon who", "Water boils at"]


def _ffn(model, kind: str) -> WalkFfn:
    """The dense FFN, the walk, or the dense FFN under an overlay whose one inserted feature fires on some rows."""
    if kind != "patched":
        return WalkFfn(model.ffn, WalkSettings(dense=kind == "dense"), model_checksum=model.checksum)
    layer = model.config.n_layers - 3
    x = _recorded(model, TEXTS[0], WalkFfn(model.ffn, WalkSettings(dense=True),
                                           model_checksum=model.checksum))[1][layer]
    gate = (x[-1] / np.linalg.norm(x[-1]) ** 2).astype(np.float32)       # scores 1 on the prompt's last row
    scores = x @ gate
    down = np.random.default_rng(0).standard_normal(model.config.hidden).astype(np.float32) * 20
    op = PatchOperation("insert", layer, 7, gate * 10, x[-1] / float(x[-1] @ x[-1]), down,
                        float(-10 * np.median(scores)), entity="France", relation="capital-of", target="Lyon")
    overlay = PatchOverlay.build((Patch((op,), model.name, model.checksum),), BaseFeatureWeights(model.gguf))
    return WalkFfn(model.ffn, WalkSettings(dense=True), model_checksum=model.checksum, patches=overlay)


def _recorded(model, text, ffn, kv=None):
    """A lone pass of `text` recording every layer: (logits of its last position, inputs, residuals, kv)."""
    kv = kv if kv is not None else KvCache(model.config, capacity=64)
    inputs, residuals = [], []
    logits = model.transformer.forward(model.tokenizer.encode(text), kv, ffn,
                                       record=lambda i, h, x: (residuals.append(h), inputs.append(x)))[-1]
    return logits, inputs, residuals, kv


def _copy(kv: KvCache) -> KvCache:
    twin = KvCache(kv.config, capacity=64)
    for mine, theirs in ((twin.keys, kv.keys), (twin.values, kv.values)):
        for layer, rows in enumerate(theirs):
            mine[layer][:, :kv.length] = rows[:, :kv.length]
    twin.length = kv.length
    return twin


def _collector():
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    return rows, lambda i, h, x: rows.append((h, x))


def _assert_same_cache(a: KvCache, b: KvCache) -> None:
    assert a.length == b.length
    for layer in range(a.config.n_layers):
        np.testing.assert_array_equal(a.keys[layer][:, :a.length], b.keys[layer][:, :b.length])
        np.testing.assert_array_equal(a.values[layer][:, :a.length], b.values[layer][:, :b.length])


def _shared(a: list[int], b: list[int]) -> int:
    """How many first tokens b shares with a, leaving b at least one to run."""
    n = 0
    while n < min(len(a), len(b) - 1) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
@pytest.mark.parametrize("kind", ["dense", "walk", "patched"])
def test_passes_run_together_equal_each_pass_alone(request, fixture, kind):
    model = request.getfixturevalue(fixture)
    tr, tok, cfg = model.transformer, model.tokenizer, model.config
    ffn = _ffn(model, kind)
    assert runs_together(tr, ffn)
    story = tok.encode(TEXTS[2])
    told = _recorded(model, TEXTS[2], ffn)[3]
    told.truncate(len(story) - 1)
    first, second = tok.encode(TEXTS[0]), tok.encode(TEXTS[1])
    boiled = _recorded(model, TEXTS[3], ffn)[3]
    boiled.truncate(len(tok.encode(TEXTS[3])) - 2)
    shared = _shared(first, second)
    # A whole prompt; a prompt's last token on its KV rows; a prompt; one that begins as it does, on its rows;
    # another prompt's last token but one on its rows (the two one-token passes run their attention in one call).
    runs = [Run(tok.encode(TEXTS[3]), KvCache(cfg, capacity=64)), Run(story[-1:], _copy(told)),
            Run(first, KvCache(cfg, capacity=64)), Run(second[shared:], KvCache(cfg, capacity=64), None, 2, shared),
            Run(tok.encode(TEXTS[3])[-2:-1], _copy(boiled))]
    assert tr.graphs.runs_rows_together and sum(len(run.ids) == 1 for run in runs) >= ROWS_TOGETHER
    alone = []
    for k, run in enumerate(runs):
        kv = _copy(run.kv)
        if run.prefix_of is not None:
            kv = _copy(alone[run.prefix_of][2])
            kv.truncate(shared)
        rows, record = _collector()
        alone.append((tr.forward(run.ids, kv, ffn, record=record)[-1], rows, kv))
    collected = [_collector() for _ in runs]
    runs = [run._replace(record=record) for run, (_, record) in zip(runs, collected)]
    logits = forward_together(tr, runs, _ffn(model, kind))
    for (lone, lone_rows, lone_kv), run, got, (rows, _) in zip(alone, runs, logits, collected):
        np.testing.assert_array_equal(got, lone)
        assert len(rows) == len(lone_rows) == cfg.n_layers
        for (h, x), (h0, x0) in zip(rows, lone_rows):
            np.testing.assert_array_equal(h, h0)
            np.testing.assert_array_equal(x, x0)
        _assert_same_cache(run.kv, lone_kv)
    if kind == "patched":      # the override wrote: the overlay's own share was among the rows compared
        base = WalkFfn(model.ffn, WalkSettings(dense=True), model_checksum=model.checksum)
        assert not np.array_equal(_recorded(model, TEXTS[0], base)[0], alone[2][0])


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_one_token_layer_steps_in_one_call_equal_each_alone(request, fixture):
    """The row-batched layer graph gives each row what the layer graph gives it alone, bit for bit: its output,
    FFN input and new key and value, at positions of different lengths (Gemma 3: some past its sliding window)
    on a local and a global layer; the rows' earlier keys are left as they were."""
    model = request.getfixturevalue(fixture)
    cfg, graphs, rope = model.config, model.transformer.graphs, model.transformer.rope
    rng = np.random.default_rng(3)
    window = max((cfg.window_for(i) or 0) for i in range(cfg.n_layers))
    positions = np.array([3, 40, 17, window + 90 if window else 120, 64])
    layers = sorted({next((i for i in range(cfg.n_layers) if cfg.window_for(i)), 0),
                     next((i for i in range(cfg.n_layers) if not cfg.window_for(i)), cfg.n_layers - 1)})
    assert len(layers) == (2 if window else 1)
    B, C = len(positions), int(positions.max()) + 1
    for layer in layers:
        keys = rng.standard_normal((B, cfg.n_kv_heads, C, cfg.head_dim)).astype(np.float32)
        values = rng.standard_normal(keys.shape).astype(np.float32)
        h = rng.standard_normal((B, cfg.hidden)).astype(np.float32)
        f = rng.standard_normal((B, cfg.hidden)).astype(np.float32)
        cos, sin = rope.table(cfg.rope_base_for(layer), C)
        alone = []
        for b, position in enumerate(positions):
            k, v = keys[b].copy(), values[b].copy()
            out, x = graphs.run_layer(layer, h[b:b + 1], f[b:b + 1], k, v, int(position), cos, sin)
            alone.append((out, x, k, v))
        before = keys.copy()
        out, x = graphs.run_layer_rows(layer, h, f, keys, values, positions, cos, sin)
        for b, (lone_out, lone_x, k, v) in enumerate(alone):
            p = int(positions[b])
            np.testing.assert_array_equal(out[b:b + 1], lone_out)
            np.testing.assert_array_equal(x[b:b + 1], lone_x)
            np.testing.assert_array_equal(keys[b, :, :p + 1], k[:, :p + 1])
            np.testing.assert_array_equal(values[b, :, :p + 1], v[:, :p + 1])
            np.testing.assert_array_equal(keys[b, :, :p], before[b, :, :p])
            assert not np.array_equal(keys[b, :, p], before[b, :, p])     # the new key was written


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_passes_resumed_together_equal_each_resumed_alone(request, fixture):
    model = request.getfixturevalue(fixture)
    ffn = _ffn(model, "patched")
    layer = model.config.n_layers - 5
    plain = WalkFfn(model.ffn, WalkSettings(dense=True), model_checksum=model.checksum)
    resumed, alone, collected = [], [], []
    for k, text in enumerate(TEXTS):
        _, inputs, residuals, kv = _recorded(model, text, plain)
        T = 1 if k % 2 else 3          # the last position alone, or the last three
        twin = _copy(kv)
        rows, record = _collector()
        alone.append((model.transformer.resume(layer, residuals[layer][-T:], inputs[layer][-T:], twin, ffn,
                                               record=record)[-1], rows, twin))
        collected.append(_collector())
        resumed.append(Resumed(residuals[layer][-T:], inputs[layer][-T:], kv, collected[-1][1]))
    got = resume_together(model.transformer, layer, resumed, ffn)
    for (lone, lone_rows, twin), r, logits, (rows, _) in zip(alone, resumed, got, collected):
        np.testing.assert_array_equal(logits, lone)
        assert len(rows) == len(lone_rows) == model.config.n_layers - layer - 1
        for (h, x), (h0, x0) in zip(rows, lone_rows):
            np.testing.assert_array_equal(h, h0)
            np.testing.assert_array_equal(x, x0)
        _assert_same_cache(r.kv, twin)


def test_an_ffn_that_looks_rows_up_runs_each_pass_alone(smollm2):
    """A walk with a cache tier counts and stores per call: its passes are not merged, and still run."""
    n = smollm2.config.n_layers
    cached = WalkFfn(smollm2.ffn, WalkSettings(), model_checksum=smollm2.checksum, l1=CacheTier("L1", n))
    assert not runs_together(smollm2.transformer, cached)
    ids = smollm2.tokenizer.encode(TEXTS[0])
    kv = KvCache(smollm2.config, capacity=64)
    logits = forward_together(smollm2.transformer, [Run(ids, kv)], cached)
    plain = WalkFfn(smollm2.ffn, WalkSettings(), model_checksum=smollm2.checksum)
    assert int(np.argmax(logits[0])) == int(np.argmax(_recorded(smollm2, TEXTS[0], plain)[0]))
    assert kv.length == len(ids)
    assert forward_together(smollm2.transformer, [], plain) == []
    with pytest.raises(ValueError):
        forward_together(smollm2.transformer, [Run([], KvCache(smollm2.config))], plain)
    with pytest.raises(ValueError):
        forward_together(smollm2.transformer, [Run(ids, KvCache(smollm2.config), prefix_of=0, shared=2)], plain)
