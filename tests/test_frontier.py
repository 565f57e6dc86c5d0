"""The frontier: key width x guard tau against fidelity, beside the nearest-neighbour bound, on the real models."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.session import ChatSession
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.tools.measure import CacheOffReference, MeasurementStopped, NearestNeighbourFfn, run_frontier

PROMPT = "Name a large animal."


def test_the_bound_serves_an_exact_repeat_and_reproduces_it(smollm2):
    cfg = smollm2.config
    walk = WalkSettings().resolved(cfg.intermediate)
    oracle = NearestNeighbourFfn(WalkFfn(smollm2.ffn, walk, model_checksum=smollm2.checksum),
                                 cfg.n_layers, tau=0.9999)
    settings = SamplingSettings(max_tokens=6)
    first = [s.token_id for s in ChatSession(smollm2, oracle).reply(PROMPT, settings)]
    after_first = (oracle.lookups, oracle.hits)
    second = [s.token_id for s in ChatSession(smollm2, oracle).reply(PROMPT, settings)]
    assert first == second == CacheOffReference(smollm2, walk, settings).tokens(PROMPT)
    lookups = oracle.lookups - after_first[0]
    assert lookups == (len(second) - 1) * cfg.n_layers           # decode steps only: prefill neither serves nor stores
    assert oracle.hits - after_first[1] == lookups                # the repeat's every input is stored already
    assert min(oracle.cosines) > 0.9999


def test_run_frontier_on_a_repeat_puts_the_bound_above_each_design(smollm2):
    points, bounds = run_frontier(smollm2, [PROMPT, PROMPT], widths=[None, 8], taus=[None, 0.999], max_tokens=6)
    K = WalkSettings().resolved(smollm2.config.intermediate).top_k
    assert [(p.key_width, p.tau) for p in points] == [(K, None), (K, 0.999), (8, None), (8, 0.999)]
    assert [b.tau for b in bounds] == [0.999] and bounds[0].is_bound
    exact = points[0]
    # The second run of the prompt finds every decode input of the first in L2 under exact keys.
    assert exact.hit_rate >= 0.45 and exact.agreement == 1.0 and exact.identical == 2
    assert exact.mean_cosine == pytest.approx(1.0, abs=1e-5)
    for p in points:
        assert p.lookups > 0 and 0.0 <= p.hit_rate <= 1.0 and p.generations == 2
        if p.tau == 0.999:
            assert bounds[0].hit_rate >= p.hit_rate - 1e-9
    # Without a guard the default rule serves only the entry's own input: k'=8 then hits no more than exact
    # keys (less when colliding inputs overwrite each other's one-entry bucket), while the seed's rule (any
    # entry under the key) serves other inputs' outputs too.
    assert points[2].hit_rate <= exact.hit_rate + 1e-9 and points[2].tau_label == "exact"
    seed, _ = run_frontier(smollm2, [PROMPT], widths=[1], taus=[None], walk=WalkSettings(feature_set_hits=True),
                           max_tokens=6)
    assert seed[0].tau_label == "seed" and seed[0].hit_rate > 0.3
    with pytest.raises(ValueError, match="key width"):
        run_frontier(smollm2, [PROMPT], widths=[10 ** 6], taus=[None])
    with pytest.raises(ValueError, match="non-empty prompts"):
        run_frontier(smollm2, ["  "], widths=[None], taus=[None])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "larql_desktop", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ), stdin=subprocess.DEVNULL)


def test_run_frontier_stops_at_the_next_generation_when_asked(smollm2):
    checks = []

    def should_stop() -> bool:       # the first generation runs; asked before the second, it stops
        checks.append(True)
        return len(checks) > 1

    finished = []
    with pytest.raises(MeasurementStopped, match="frontier was stopped"):
        run_frontier(smollm2, ["Name a colour.", "Name a fruit."], [None], [None, 0.999], max_tokens=2,
                     log=finished.append, should_stop=should_stop)
    assert len(checks) == 2 and finished == []       # no design was completed after the stop


def test_frontier_cli_table_and_json_on_gemma3(gemma3, tmp_path):
    out = tmp_path / "frontier.json"
    result = run_cli("frontier", "--model", "gemma3-270m", "--widths", "K,4", "--taus", "off,0.995",
                     "--max-tokens", "4", "--json", str(out), "The sky is", "The sky is")
    assert result.returncode == 0, result.stderr
    assert "NN bound (any key)" in result.stdout and "key k'=4" in result.stdout
    doc = json.loads(out.read_text())
    assert len(doc["designs"]) == 4 and [b["tau"] for b in doc["bounds"]] == [0.995]
    assert doc["top_k"] == int(gemma3.config.intermediate * 8092 / 10240)
    for design in doc["designs"]:
        assert 0.0 <= design["hit_rate"] <= 1.0 and design["generations"] == 2


def test_frontier_cli_refuses_bad_lists():
    bad = run_cli("frontier", "--model", "smollm2", "--widths", "K,x", "hello")
    assert bad.returncode == 2 and "--widths: 'x' is not a number" in bad.stderr
