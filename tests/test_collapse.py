"""The paraphrase-collapse lab: its definitions pinned, and `larql-desktop collapse` against numpy."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from larql_desktop.engine.analysis.collapse import (COMPUTATION, Fp32Forward, capture, compare_layer, prompt_ids,
                                                 resolve_sizes)
from larql_desktop.engine.cache.keys import default_top_k
from larql_desktop.engine.formats.quants import dequantize
from larql_desktop.engine.model.transformer import ACTIVATIONS, KvCache, TransformerModel

MODEL_KEYS = {"smollm2": "smollm2", "gemma3": "gemma3-270m"}
# Pairs the lab's earlier check (on the onnxruntime graphs) never saw.
PAIRS = [("How many legs does a spider have?", "What is the number of legs on a spider?"),   # paraphrase
         ("Describe the smell of rain.", "Convert five miles to kilometres.")]              # unrelated


class _Done(Exception):
    pass


class NumpyReference:
    """An independent computation of what the lab measures: TransformerModel's numpy attention (no graphs) with
    the dense FFN written out here in float64 from the dequantised GGUF weights, so the residual stream runs in
    float64 from the first FFN on (the lab's Fp32Forward runs fp32 through NumpyDenseFfn); gate scores,
    cosines and top-K sets are computed below with numpy's own argsort, not the lab's helpers. Every
    position's normed FFN input, per layer."""

    def __init__(self, model):
        self.model = model
        self.transformer = TransformerModel(model.gguf, model.config)   # no graphs attached: numpy forward
        t = model.gguf.tensors
        self.act = ACTIVATIONS[model.config.activation]
        self.weights = [tuple(dequantize(t[f"blk.{i}.{n}.weight"]) for n in ("ffn_gate", "ffn_up", "ffn_down"))
                        for i in range(model.config.n_layers)]

    def ffn_inputs(self, ids: list[int]) -> list[np.ndarray]:
        rows = []
        last = self.model.config.n_layers - 1

        def recording(layer, x):
            x = x.astype(np.float64)
            rows.append(x)
            if layer == last:
                raise _Done("past the last layer")     # the logits (a 262k-row matrix on Gemma) are not needed
            gate, up, down = self.weights[layer]
            return (self.act(x @ gate.T) * (x @ up.T)) @ down.T

        with pytest.raises(_Done, match="past the last layer"):
            self.transformer.forward(ids, KvCache(self.model.config), recording)
        return rows

    def gate(self, layer: int) -> np.ndarray:
        return self.weights[layer][0].astype(np.float64)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def reference(request):
    return NumpyReference(request.getfixturevalue(request.param)), request.param


def test_definitions_on_a_small_case():
    # 8 features, K = 3 by |score|: a large negative score is selected, sign does not matter.
    sa = np.array([5.0, -4.0, 3.0, 0.1, 0.2, 0.3, 0.0, 2.5])
    sb = np.array([5.0, -4.0, 0.1, 3.0, 0.2, 0.3, 0.0, -2.0])
    xa, xb = np.array([1.0, 0.0, 1.0]), np.array([1.0, 1.0, 0.0])
    full = compare_layer(7, xa, xb, sa, sb, top_k=3, key_width=3)
    assert full.layer == 7
    assert full.overlap == pytest.approx(2 / 3)            # {0, 1, 2} vs {0, 1, 3}
    assert full.cosine == pytest.approx(0.5)
    assert not full.keys_equal
    narrow = compare_layer(7, xa, xb, sa, sb, top_k=3, key_width=2)   # the two strongest agree
    assert narrow.keys_equal and narrow.key_overlap == 1.0
    # K defaults to the seed's 79% of the intermediate size; k' to K; bad sizes are refused.
    assert resolve_sizes(1536, None, None) == (default_top_k(1536), default_top_k(1536)) == (1213, 1213)
    with pytest.raises(ValueError, match="key width"):
        resolve_sizes(1536, 100, 101)
    with pytest.raises(ValueError, match="K must be"):
        resolve_sizes(1536, 0, None)


def test_position_template_and_norm_are_pinned(reference):
    ref, name = reference
    model = ref.model
    prompt = "Name a colour."
    got = capture(Fp32Forward(model), prompt)
    ids = list(got.token_ids)
    if name == "smollm2":       # chat model: the template with its generation prompt, last token ends it
        assert model.is_chat
        assert model.tokenizer.decode(ids).endswith("assistant\n")
        assert len(ids) > len(model.tokenizer.encode(prompt))
    else:                       # base model: the plain text
        assert not model.is_chat
        assert ids == model.tokenizer.encode(prompt)
    assert ids == prompt_ids(model, prompt)
    rows = ref.ffn_inputs(ids)
    for layer in (0, model.config.n_layers // 2, model.config.n_layers - 1):
        x = got.inputs[layer].astype(np.float64)
        want = rows[layer][-1]                      # the last prompt position of the *normed* FFN input
        assert np.linalg.norm(x - want) / np.linalg.norm(want) < 1e-3   # fp32 against float64
        assert np.linalg.norm(x - rows[layer][-2]) / np.linalg.norm(want) > 0.2   # not the position before
        scores = want @ ref.gate(layer).T
        assert np.linalg.norm(got.scores[layer] - scores) / np.linalg.norm(scores) < 1e-3


def _numpy_last_positions(ref: NumpyReference, prompt: str, k: int) -> list[tuple[np.ndarray, set[int]]]:
    """Per layer: the float64 normed FFN input at the last prompt position and its top-K features by |score|."""
    rows = ref.ffn_inputs(prompt_ids(ref.model, prompt))
    out = []
    for layer, x in enumerate(rows):
        v = x[-1]
        out.append((v, set(np.argsort(-np.abs(ref.gate(layer) @ v), kind="stable")[:k].tolist())))
    return out


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "larql_desktop", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ), stdin=subprocess.DEVNULL)


def test_cli_matches_independent_numpy(reference, tmp_path):
    ref, name = reference
    out = tmp_path / "collapse.json"
    prompts = [PAIRS[0][0], PAIRS[0][1], PAIRS[1][0], PAIRS[1][1]]
    result = run_cli("collapse", "--model", MODEL_KEYS[name], "--json", str(out), *prompts)
    assert result.returncode == 0, result.stderr
    n = ref.model.config.n_layers
    F = ref.model.config.intermediate
    k = int(F * 8092 / 10240)
    table = [line for line in result.stdout.splitlines() if line[:5].strip().isdigit()]
    assert len(table) == n
    assert COMPUTATION in result.stdout.splitlines()[0]
    doc = json.loads(out.read_text())
    assert doc["computation"] == COMPUTATION == "numpy fp32 (dequantised GGUF weights)"
    assert doc["top_k"] == k and doc["intermediate"] == F
    assert doc["random_overlap_baseline"] == pytest.approx(k / F)
    assert doc["token_ids"] == [prompt_ids(ref.model, p) for p in prompts]
    assert doc["prompt_tokens"] == [len(ids) for ids in doc["token_ids"]]
    assert len(doc["layers"]) == n
    by_pair = {(p["a"], p["b"]): p for p in doc["pairs"]}
    assert len(by_pair) == 6                                 # every pair of the four prompts
    assert doc["layers"] == by_pair[(0, 1)]["layers"]
    numpy = [_numpy_last_positions(ref, p, k) for p in prompts]
    for (a, b), pair in by_pair.items():                     # paraphrase (0, 1), unrelated (2, 3) and the rest
        for layer, got in enumerate(pair["layers"]):
            (va, top_a), (vb, top_b) = numpy[a][layer], numpy[b][layer]
            want_cosine = float(va @ vb / np.linalg.norm(va) / np.linalg.norm(vb))
            assert abs(got["cosine"] - want_cosine) < 0.02, (a, b, layer)
            assert abs(got["overlap"] - len(top_a & top_b) / k) < 0.03, (a, b, layer)
    # The sweeps carry the random baseline K/F (k'/F) at every size.
    for point in by_pair[(0, 1)]["top_k_sweep"] + by_pair[(0, 1)]["key_width_sweep"]:
        assert point["baseline"] == pytest.approx(point["size"] / F)
        assert len(point["overlap"]) == n


def test_cli_refuses_one_prompt_and_bad_k():
    one = run_cli("collapse", "--model", "smollm2", "Only one prompt")
    assert one.returncode == 2 and "at least two prompts" in one.stderr
    bad = run_cli("collapse", "--model", "smollm2", "--top-k", "99999", "a", "b")
    assert bad.returncode == 2 and "K must be between" in bad.stderr


def test_progress_follows_each_prompt_and_a_stop_between_prompts_reports_nothing(smollm2):
    from larql_desktop.engine.analysis.collapse import CollapseCancelled, collapse

    forward = Fp32Forward(smollm2)
    prompts = ["Name a colour.", "Name a fruit.", "Name a river."]
    seen = []
    report = collapse(smollm2, prompts, forward=forward, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert report.computation == COMPUTATION and len(report.pairs) == 3
    assert report.token_ids == tuple(tuple(prompt_ids(smollm2, p)) for p in prompts)
    # Asked to stop once the first prompt is in: the second never runs and no report comes back.
    seen.clear()
    with pytest.raises(CollapseCancelled, match="collapse lab was stopped"):
        collapse(smollm2, prompts, forward=forward, should_stop=lambda: len(seen) >= 1,
                 progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3)]
    # Bad input is refused before any pass.
    with pytest.raises(ValueError, match="non-empty"):
        collapse(smollm2, ["fine", "  "], forward=forward, progress=lambda done, total: seen.append(done))
    assert seen == [(1, 3)]
