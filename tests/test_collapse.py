"""The paraphrase-collapse lab: its definitions pinned, and `larql-desktop collapse` against numpy."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from larql_desktop.engine.cache.collapse import capture, compare_layer, prompt_ids, resolve_sizes
from larql_desktop.engine.cache.keys import default_top_k
from larql_desktop.engine.model.transformer import KvCache, NumpyDenseFfn, TransformerModel

MODEL_KEYS = {"smollm2": "smollm2", "gemma3": "gemma3-270m"}
PAIRS = [("How do I bake bread at home?", "What's a good way to make bread myself?"),   # paraphrase
         ("The weather is lovely today.", "List three prime numbers.")]                 # unrelated


class _Done(Exception):
    pass


class NumpyReference:
    """The model's numpy fp32 path (attention and dense FFN from dequantised GGUF weights), independent of the
    onnxruntime graphs the lab runs: every position's normed FFN input, per layer."""

    def __init__(self, model):
        self.model = model
        self.transformer = TransformerModel(model.gguf, model.config)   # no graphs attached: numpy forward
        self.ffn = NumpyDenseFfn(self.transformer)

    def ffn_inputs(self, ids: list[int]) -> list[np.ndarray]:
        rows = []
        last = self.model.config.n_layers - 1

        def recording(layer, x):
            rows.append(x.astype(np.float64))
            if layer == last:
                raise _Done     # the logits (a 262k-row matrix on Gemma) are not needed
            return self.ffn(layer, x)

        with pytest.raises(_Done):
            self.transformer.forward(ids, KvCache(self.model.config), recording)
        return rows

    def gate(self, layer: int) -> np.ndarray:
        return self.ffn.weights[layer][0].astype(np.float64)


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
    got = capture(model, prompt)
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
        assert np.linalg.norm(x - want) / np.linalg.norm(want) < 0.05
        assert np.linalg.norm(x - rows[layer][-2]) / np.linalg.norm(want) > 0.2   # not the position before
        scores = want @ ref.gate(layer).T
        assert np.corrcoef(got.scores[layer], scores)[0, 1] > 0.995


def _numpy_pair(ref: NumpyReference, a: str, b: str, k: int) -> tuple[list[float], list[float]]:
    xa = ref.ffn_inputs(prompt_ids(ref.model, a))
    xb = ref.ffn_inputs(prompt_ids(ref.model, b))
    cosines, overlaps = [], []
    for layer in range(ref.model.config.n_layers):
        va, vb = xa[layer][-1], xb[layer][-1]
        cosines.append(float(va @ vb / np.linalg.norm(va) / np.linalg.norm(vb)))
        g = ref.gate(layer)
        top_a = set(np.argsort(-np.abs(g @ va), kind="stable")[:k].tolist())
        top_b = set(np.argsort(-np.abs(g @ vb), kind="stable")[:k].tolist())
        overlaps.append(len(top_a & top_b) / k)
    return cosines, overlaps


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
    doc = json.loads(out.read_text())
    assert doc["top_k"] == k and doc["intermediate"] == F
    assert doc["random_overlap_baseline"] == pytest.approx(k / F)
    assert len(doc["layers"]) == n
    by_pair = {(p["a"], p["b"]): p for p in doc["pairs"]}
    assert len(by_pair) == 6                                 # every pair of the four prompts
    assert doc["layers"] == by_pair[(0, 1)]["layers"]
    for (a, b) in [(0, 1), (2, 3), (0, 2)]:
        cosines, overlaps = _numpy_pair(ref, prompts[a], prompts[b], k)
        got = by_pair[(a, b)]["layers"]
        for layer in range(n):
            assert abs(got[layer]["cosine"] - cosines[layer]) < 0.02, (a, b, layer)
            assert abs(got[layer]["overlap"] - overlaps[layer]) < 0.03, (a, b, layer)
    # The sweeps carry the random baseline K/F (k'/F) at every size.
    for point in by_pair[(0, 1)]["top_k_sweep"] + by_pair[(0, 1)]["key_width_sweep"]:
        assert point["baseline"] == pytest.approx(point["size"] / F)
        assert len(point["overlap"]) == n


def test_cli_refuses_one_prompt_and_bad_k():
    one = run_cli("collapse", "--model", "smollm2", "Only one prompt")
    assert one.returncode == 2 and "at least two prompts" in one.stderr
    bad = run_cli("collapse", "--model", "smollm2", "--top-k", "99999", "a", "b")
    assert bad.returncode == 2 and "K must be between" in bad.stderr
