"""The local HTTP API on loopback, driven by real HTTP clients: cache hits across clients, statistics, refusals,
patches, restarts served by L3, the OpenAPI description, and a short bounded load test."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid

import httpx
import numpy as np
import pytest

from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.cache.l3 import SqliteL3
from larql_desktop.engine.model.overlay import encode_vector
from larql_desktop.tools.loadtest import run_load
from larql_desktop.api.server import start_server
from test_l3 import redis_url  # noqa: F401  (fixture: a redis-server of the test's own)

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture
def served(smollm2, tmp_path, capture_store):
    engine = LarqlEngine(smollm2, l3=SqliteL3(tmp_path / "l3.sqlite3"), capture_store=capture_store)
    handle = start_server(engine, "127.0.0.1", 0)
    yield engine, handle
    handle.stop()
    engine.l3.close()


def _residual(model, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(model.config.hidden).astype(np.float32)


def _state(engine) -> tuple:
    snap = engine.snapshot()
    return (snap.calls, int(snap.tiers["L2"].entries.sum()), int(snap.tiers["L3"].entries.sum()),
            engine.patches.epoch)


def test_a_second_clients_identical_request_is_an_l2_hit(served, smollm2):
    engine, handle = served
    body = {"layer": 7, "residual": _residual(smollm2).tolist(), "full_output": True}
    with httpx.Client(base_url=handle.url) as first:
        a = first.post("/v1/walk-ffn", json=body)
    with httpx.Client(base_url=handle.url) as second:
        b = second.post("/v1/walk-ffn", json=body)
        stats = second.get("/v1/cache-stats").json()
    assert a.status_code == b.status_code == 200
    a, b = a.json(), b.json()
    assert (a["cache"], a["hit"], a["tier"]) == ("miss", False, None)
    assert (b["cache"], b["hit"], b["tier"]) == ("hit", True, "L2")
    assert np.array_equal(np.float32(a["output"]), np.float32(b["output"])) and len(a["output"]) == smollm2.config.hidden
    # The same computation in process, uncached, gives the very same bits.
    fresh = LarqlEngine(smollm2).request_walk()
    fresh.l2 = None
    assert np.array_equal(fresh(7, _residual(smollm2)[None, :])[0], np.float32(a["output"]))
    l2, l3 = stats["tiers"]["L2"], stats["tiers"]["L3"]
    assert l2["per_layer"]["hits"][7] == 1 and l2["per_layer"]["misses"][7] == 1 and l2["hits"] == 1
    assert l3["per_layer"]["misses"][7] == 1 and l3["entries"] == 1 and l3["enabled"]
    assert stats["calls"] == 2 and stats["latency_us"]["hit"]["count"] == 1
    assert stats["fidelity"]["mean_cosine"] is None        # NaN (nothing checked) is sent as null


def test_features_only_and_multi_position_requests(served, smollm2):
    engine, handle = served
    x = _residual(smollm2, 1)
    with httpx.Client(base_url=handle.url) as http:
        r = http.post("/v1/walk-ffn", json={"layer": 2, "residual": x.tolist(), "top_k": 8, "full_output": False})
        doc = r.json()
        assert r.status_code == 200 and doc["cache"] == "none" and doc["output"] is None
        scores = smollm2.ffn.gate_scores(2, x[None, :])[0]
        assert set(doc["features"]) == set(np.argsort(-np.abs(scores))[:8].tolist())
        assert np.allclose(doc["scores"], scores[doc["features"]])
        r = http.post("/v1/walk-ffn", json={"layer": 2, "residual": [x.tolist(), x.tolist()]})
        assert r.json()["cache"] == "bypass" and r.json()["bypass_reason"] == "prefill"
        assert len(r.json()["output"]) == 2
        r = http.post("/v1/walk-ffn", json={"layer": 2, "residual": x.tolist(), "top_k": smollm2.config.intermediate})
        assert r.json()["cache"] == "dense" and r.json()["bypass_reason"] == "full_k"


def test_features_only_sees_insert_overrides(served, smollm2):
    """The gate KNN the API reports is the walk's: an inserted feature that fires on this input is listed
    with its patched score; one that stays silent leaves its slot's base feature in place."""
    engine, handle = served
    x = _residual(smollm2, 2)
    d, top_k = smollm2.config.hidden, 8
    base = smollm2.ffn.gate_scores(2, x[None, :])[0]
    quiet = int(np.argsort(np.abs(base))[0])               # a slot the base ranking never picks
    silent = int(np.argsort(-np.abs(base))[0])              # the base ranking's strongest feature
    unit = x / np.linalg.norm(x)
    vec = encode_vector(np.ones(d, np.float32))
    doc = {"version": 1, "base_model": smollm2.name, "base_checksum": smollm2.checksum, "operations": [
        {"op": "insert", "layer": 2, "feature": quiet, "entity": "e", "relation": "r", "target": "t",
         "gate": encode_vector(unit * 1000), "up": vec, "down": vec, "gate_bias": -1.0},
        {"op": "insert", "layer": 2, "feature": silent, "entity": "e", "relation": "r", "target": "t",
         "gate": encode_vector(-unit), "up": vec, "down": vec, "gate_bias": -1.0}]}
    with httpx.Client(base_url=handle.url) as http:
        assert http.post("/v1/patches", json=doc).status_code == 201
        r = http.post("/v1/walk-ffn", json={"layer": 2, "residual": x.tolist(), "top_k": top_k, "full_output": False})
    features, scores = r.json()["features"], r.json()["scores"]
    patched = float(x @ (unit * 1000) - 1.0)
    assert features[0] == quiet and np.isclose(scores[0], patched, rtol=1e-4)   # fires, strongest
    assert silent in features and np.isclose(scores[features.index(silent)], base[silent], rtol=1e-5)
    assert len(features) == top_k + 1                       # the override joins; no base feature leaves


def _bad_requests(model):
    d, n = model.config.hidden, model.config.n_layers
    ok = [0.5] * d
    j = {"content-type": "application/json"}
    return [
        ("short vector", json.dumps({"layer": 1, "residual": ok[:-1]}), j, 422, "hidden size"),
        ("long vector", json.dumps({"layer": 1, "residual": ok + [1.0]}), j, 422, "hidden size"),
        ("NaN", json.dumps({"layer": 1, "residual": [float("nan")] + ok[1:]}), j, 422, "NaN"),
        ("Infinity", json.dumps({"layer": 1, "residual": [float("inf")] + ok[1:]}), j, 422, "NaN or infinity"),
        ("float32 overflow", json.dumps({"layer": 1, "residual": [1e39] + ok[1:]}), j, 422, "beyond float32"),
        ("unknown layer", json.dumps({"layer": n, "residual": ok}), j, 422, f"layer {n} is out of range"),
        ("negative layer", json.dumps({"layer": -1, "residual": ok}), j, 422, "out of range"),
        ("bool layer", json.dumps({"layer": True, "residual": ok}), j, 422, "layer"),
        ("string values", json.dumps({"layer": 1, "residual": ["1"] * d}), j, 422, "residual"),
        ("top_k zero", json.dumps({"layer": 1, "residual": ok, "top_k": 0}), j, 422, "top_k"),
        ("top_k too big", json.dumps({"layer": 1, "residual": ok, "top_k": 10 ** 6}), j, 422, "top_k"),
        ("missing residual", json.dumps({"layer": 1}), j, 422, "residual"),
        ("unknown field", json.dumps({"layer": 1, "residual": ok, "mode": "x"}), j, 422, "mode"),
        ("empty residual", json.dumps({"layer": 1, "residual": []}), j, 422, "hidden size"),
        ("ragged positions", json.dumps({"layer": 1, "residual": [ok, ok[:3]]}), j, 422, "residual[1]"),
        ("bad JSON", '{"layer": 1, "residual": [', j, 400, "not valid JSON"),
        ("not an object", "[1, 2, 3]", j, 422, "body"),
        ("text/plain", json.dumps({"layer": 1, "residual": ok}), {"content-type": "text/plain"}, 415, "JSON"),
        ("no content type", json.dumps({"layer": 1, "residual": ok}), {}, 415, "JSON"),
    ]


def test_malformed_requests_get_a_4xx_with_a_reason_and_change_nothing(served, smollm2):
    engine, handle = served
    before = _state(engine)
    with httpx.Client(base_url=handle.url) as http:
        for name, content, headers, status, reason in _bad_requests(smollm2):
            r = http.post("/v1/walk-ffn", content=content.encode(), headers=headers)
            assert r.status_code == status, (name, r.text)
            assert reason.lower() in r.json()["detail"].lower(), (name, r.json())
        bad_patch = {"version": 1, "base_checksum": "0" * 64, "operations": [{"op": "delete", "layer": 1,
                                                                            "feature": 1}]}
        for doc, reason in ((bad_patch, "another model"), ({"version": 9}, "version"), ([], "dictionary")):
            r = http.post("/v1/patches", json=doc)
            assert r.status_code == 422 and reason in r.json()["detail"], r.text
        assert http.delete("/v1/patches/0").status_code == 404
        assert "no applied patch" in http.delete("/v1/patches/x").json()["detail"]
        for doc, reason in (({"entity": "", "relation": "r", "target": "t"}, "entity"),
                            ({"entity": "e", "relation": "r", "target": "t", "layer": 99}, "out of range"),
                            ({"entity": "e", "relation": "r", "target": "t", "alpha": 0}, "alpha"),
                            ({"entity": "e", "relation": "r"}, "target"),
                            ({"entity": "e", "relation": "r", "target": "t", "paraphrases": "one"}, "paraphrases"),
                            ({"entity": "e", "relation": "r", "target": "t", "paraphrases": [""]}, "paraphrases")):
            r = http.post("/v1/insert", json=doc)
            assert r.status_code == 422 and reason in r.json()["detail"], r.text
        assert http.get("/v1/nothing").status_code == 404
    assert _state(engine) == before


def test_body_cap_token_and_host_checks(smollm2, tmp_path):
    engine = LarqlEngine(smollm2)
    with pytest.raises(ValueError, match="needs a token"):
        start_server(engine, "0.0.0.0", 0)                 # refused before anything is bound
    handle = start_server(engine, "127.0.0.1", 0, token=TOKEN, max_body=4096)
    try:
        body = {"layer": 0, "residual": [0.25] * smollm2.config.hidden}
        with httpx.Client(base_url=handle.url) as http:
            assert http.get("/v1/health").status_code == 401
            r = http.get("/v1/health", headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            auth = {"authorization": f"Bearer {TOKEN}"}
            assert http.get("/v1/health", headers=auth).json() == {"status": "ok"}
            r = http.post("/v1/walk-ffn", json=body, headers=auth)          # ~3.5 KB: under the cap
            assert r.status_code == 200
            big = {"layer": 0, "residual": [0.123456789] * smollm2.config.hidden}
            r = http.post("/v1/walk-ffn", json=big, headers=auth)
            assert r.status_code == 413 and "exceeds 4096" in r.json()["detail"]

            def chunks():                                  # no Content-Length: counted while received
                for _ in range(10):
                    yield b" " * 1000
            r = http.post("/v1/walk-ffn", content=chunks(), headers={**auth, "content-type": "application/json"})
            assert r.status_code == 413
            r = http.get("/v1/health", headers={**auth, "host": "attacker.example"})
            assert r.status_code == 400 and "loopback" in r.json()["detail"]
        assert engine.snapshot().calls == 1              # only the request under the cap ran
    finally:
        handle.stop()


def test_openapi_description_is_served_and_valid(served):
    from openapi_spec_validator import validate

    _, handle = served
    doc = httpx.get(f"{handle.url}/openapi.json").json()
    validate(doc)
    assert {"/v1/walk-ffn", "/v1/cache-stats", "/v1/patches", "/v1/patches/{patch_id}", "/v1/insert"} <= set(doc["paths"])
    assert set(doc["paths"]["/v1/patches"]) == {"get", "post"} and "delete" in doc["paths"]["/v1/patches/{patch_id}"]
    request = doc["components"]["schemas"]["WalkFfnRequest"]
    assert set(request["properties"]) == {"layer", "residual", "top_k", "full_output"}
    assert set(request["required"]) == {"layer", "residual"}
    assert "422" in doc["paths"]["/v1/walk-ffn"]["post"]["responses"]


def test_patch_routes_apply_list_and_remove(served, smollm2):
    engine, handle = served
    d = smollm2.config.hidden
    v = encode_vector(np.full(d, 0.01, np.float32))
    doc = {"version": 1, "base_model": smollm2.name, "base_checksum": smollm2.checksum, "created_at": "now",
           "description": "via http", "operations": [{"op": "update", "layer": 4, "feature": 6, "down": v}]}
    x = _residual(smollm2, 2).tolist()
    with httpx.Client(base_url=handle.url) as http:
        assert http.get("/v1/patches").json() == {"epoch": "clean", "patches": []}
        clean = http.post("/v1/walk-ffn", json={"layer": 4, "residual": x}).json()
        r = http.post("/v1/patches", json=doc)
        assert r.status_code == 201
        listed = r.json()
        assert listed["epoch"] != "clean" and listed["patches"][0]["layers"] == [4]
        assert listed["patches"][0]["description"] == "via http" and http.get("/v1/patches").json() == listed
        patched = http.post("/v1/walk-ffn", json={"layer": 4, "residual": x}).json()
        assert (patched["cache"], patched["bypass_reason"]) == ("bypass", "patched")
        assert patched["output"] != clean["output"]                 # the override applies
        other = http.post("/v1/walk-ffn", json={"layer": 5, "residual": x}).json()
        assert other["cache"] == "miss"                             # other layers keep their cache
        assert http.post("/v1/patches", json=doc).status_code == 409      # the same content twice: one id
        assert http.delete("/v1/patches/0").status_code == 404            # by id, never by position
        r = http.delete(f"/v1/patches/{listed['patches'][0]['id']}")
        assert r.status_code == 200 and r.json() == {"epoch": "clean", "patches": []}
        again = http.post("/v1/walk-ffn", json={"layer": 4, "residual": x}).json()
        assert again["cache"] == "hit" and again["output"] == clean["output"]


def test_the_patch_route_applies_a_patch_set_whole_or_not_at_all(served, smollm2):
    """A patch set file's JSON posted once: its patches listed one by one (in order, with their names), each
    removable by its id; a set with a bad patch or one already applied changes nothing."""
    engine, handle = served
    v = encode_vector(np.full(smollm2.config.hidden, 0.01, np.float32))

    def patch(layer: int, name: str) -> dict:
        return {"name": name, "patch": {"version": 1, "base_model": smollm2.name, "base_checksum": smollm2.checksum,
                                        "operations": [{"op": "update", "layer": layer, "feature": 6, "down": v}]}}
    facts = {"kind": "larql-patch-set", "version": 1, "patches": [patch(2, "a"), patch(7, "b"), patch(9, "c")]}
    with httpx.Client(base_url=handle.url) as http:
        r = http.post("/v1/patches", json=facts)
        assert r.status_code == 201
        listed = r.json()["patches"]
        assert [(p["name"], p["layers"]) for p in listed] == [("a", [2]), ("b", [7]), ("c", [9])]
        state = http.get("/v1/patches").json()
        again = http.post("/v1/patches", json={**facts, "patches": [patch(11, "d"), patch(7, "b")]})
        assert again.status_code == 409 and http.get("/v1/patches").json() == state      # "b" is applied: no "d"
        broken = {**facts, "patches": [patch(12, "e"), {"name": "f", "patch": {"version": 1}}]}
        r = http.post("/v1/patches", json=broken)
        assert r.status_code == 422 and "patch 2" in r.json()["detail"] and http.get("/v1/patches").json() == state
        r = http.delete(f"/v1/patches/{listed[1]['id']}")
        assert r.status_code == 200 and [p["name"] for p in r.json()["patches"]] == ["a", "c"]
    assert [p.name for p in engine.applied_patches] == ["a", "c"]


def test_insert_route_installs_a_fact_and_answers_with_its_probe_table(served):
    engine, handle = served
    paraphrase = "Atlantis has its capital at"
    with httpx.Client(base_url=handle.url, timeout=600) as http:
        r = http.post("/v1/insert", json={"entity": "Atlantis", "relation": "capital-of", "target": "Poseidon",
                                          "paraphrases": [paraphrase]})
        assert r.status_code == 200, r.text
        doc = r.json()
        # The reported layer is the first feature's; a multi-token or multi-layer insert lists more.
        assert doc["layer"] in doc["patches"]["patches"][0]["layers"] and 0 < doc["probability"] <= 1
    assert engine.patches.has_overrides_at(doc["layer"])
    assert "1 paraphrase(s) given" in doc["patches"]["patches"][0]["description"]
    # The probe table the patch editor shows, from the same service: the user's paraphrase replaces the
    # generated ones, and the chat question is read through the chat template.
    rows = doc["probes"]
    assert [(p["kind"], p["prompt"]) for p in rows] == [
        ("canonical", "The capital of Atlantis is"), ("paraphrase", paraphrase),
        ("chat", "What is the capital of Atlantis?"),
        ("conversation", "What is the capital of Atlantis?")]   # the same question after an earlier turn
    assert rows[2]["rendered"].endswith("assistant\n") and "<|im_start|>user" in rows[2]["rendered"]
    assert all(0 <= p["p_before"] <= 1 and 0 <= p["p_after"] <= 1 for p in rows)
    canonical = rows[0]
    assert canonical["answers_after"] and not canonical["answers_before"]
    assert canonical["after"].lstrip().startswith("Poseidon") and canonical["after"] != canonical["before"]
    assert canonical["p_after"] > 10 * canonical["p_before"]


def test_insert_route_with_a_layer_and_alpha_installs_there(served, smollm2):
    """A pinned layer is the first one tried and is installed even where another would separate better."""
    engine, handle = served
    layer = smollm2.config.n_layers // 3
    with httpx.Client(base_url=handle.url, timeout=600) as http:
        r = http.post("/v1/insert", json={"entity": "Atlantis", "relation": "capital-of", "target": "Poseidon",
                                          "layer": layer, "alpha": 0.25, "probes": False})
        assert r.status_code == 200, r.text
        doc = r.json()
        listed = http.get("/v1/patches").json()
    assert doc["layer"] == layer and doc["probes"] == [] and 0 < doc["probability"] <= 1
    assert 0 <= doc["feature"] < smollm2.config.intermediate
    assert listed == doc["patches"] and layer in listed["patches"][0]["layers"]
    assert engine.patches.has_overrides_at(layer)
    assert (layer, doc["feature"]) in {(op.layer, op.feature) for op in engine.applied_patches[0].operations}


def test_restart_serves_the_repeated_request_from_l3_bit_identically(smollm2, tmp_path):
    path = tmp_path / "l3.sqlite3"
    body = {"layer": 11, "residual": _residual(smollm2, 3).tolist()}
    outputs = []
    for run in range(2):           # a restart: new engine, new store object, new server
        engine = LarqlEngine(smollm2, l3=SqliteL3(path))
        handle = start_server(engine, "127.0.0.1", 0)
        try:
            doc = httpx.post(f"{handle.url}/v1/walk-ffn", json=body).json()
        finally:
            handle.stop()
            engine.l3.close()
        assert (doc["cache"], doc["tier"]) == (("miss", None) if run == 0 else ("hit", "L3"))
        outputs.append(np.float32(doc["output"]))
    assert np.array_equal(outputs[0], outputs[1])


def test_short_load_test_loses_no_counts(served, smollm2):
    engine, handle = served
    before = engine.snapshot()
    result = run_load(handle.url, smollm2.config.hidden, smollm2.config.n_layers, clients=4, seconds=2.5,
                      pool=24, prefill_every=7)
    after = engine.snapshot()
    summary = result.summary()
    print(f"\nshort load test: {summary}")
    assert result.errors == 0 and result.requests > 20
    assert sum(result.outcomes.values()) == result.requests
    assert set(result.outcomes) <= {"hit", "miss", "bypass"} and result.outcomes.get("hit", 0) > 0
    lat = {k: after.latency[k].count - before.latency[k].count for k in after.latency}
    assert after.calls - before.calls == result.requests
    assert lat["hit"] + lat["miss"] + lat["bypass"] + lat["dense"] == result.requests
    assert {k: v for k, v in lat.items() if v} == result.outcomes
    l2 = {k: int(getattr(after.tiers["L2"], k).sum() - getattr(before.tiers["L2"], k).sum()) for k in ("hits", "misses")}
    assert l2["hits"] + l2["misses"] == after.lookups - before.lookups == lat["hit"] + lat["miss"]
    assert l2["hits"] + (result.tiers.get("L3", 0)) == lat["hit"] == result.outcomes["hit"]
    bypass = int(sum(v.sum() for v in after.bypasses.values()) - sum(v.sum() for v in before.bypasses.values()))
    assert bypass == result.outcomes.get("bypass", 0)


@contextlib.contextmanager
def _serve_command(*args, env_extra=None):
    """`larql-desktop serve` as a user starts it (port 0: a free one): yields its base URL; stopped by SIGINT,
    through its cleanup (the L3 queue is written), which must exit with status 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LARQL_DESKTOP_API_TOKEN", None)
    env.update(env_extra or {})
    proc = subprocess.Popen([sys.executable, "-m", "larql_desktop", "serve", "--model", "smollm2", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(60) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()


def test_serve_command_runs_and_stops(app_paths, tmp_path, smollm2):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "larql_desktop", "serve", "--model", "smollm2", "--port", "0",
           "--l3", f"sqlite:{tmp_path / 'l3.sqlite3'}"]
    r = subprocess.run([*cmd[:3], "serve", "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "token" in r.stderr
    # Started as a shell without job control starts a background job, with SIGINT ignored: SIGINT still
    # stops it, and so does SIGTERM, each through its cleanup (exit status 0).
    for stop in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            line = proc.stdout.readline()
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
            assert httpx.get(f"{match.group(1)}/v1/model").json()["hidden"] == smollm2.config.hidden
        finally:
            proc.send_signal(stop)
            try:
                assert proc.wait(30) == 0, stop
            finally:
                if proc.poll() is None:
                    proc.kill()
    assert (tmp_path / "l3.sqlite3").exists()


def test_serve_command_with_a_token_refuses_requests_without_it(smollm2):
    with _serve_command("--token", TOKEN, "--l3", "off") as url:
        assert httpx.get(f"{url}/v1/health").status_code == 401
        wrong = httpx.get(f"{url}/v1/health", headers={"authorization": "Bearer not-it"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        auth = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/v1/health", headers=auth).json() == {"status": "ok"}
        doc = httpx.get(f"{url}/v1/model", headers=auth).json()
        assert (doc["hidden"], doc["n_layers"], doc["l3"]) == (smollm2.config.hidden, smollm2.config.n_layers, None)
    # The same token from the environment.
    with _serve_command("--l3", "off", env_extra={"LARQL_DESKTOP_API_TOKEN": TOKEN}) as url:
        assert httpx.get(f"{url}/v1/health").status_code == 401
        assert httpx.get(f"{url}/v1/health", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_serve_command_shares_a_redis_l3_in_fp16_under_its_size_cap(redis_url, smollm2):
    """`serve --l3 redis://... --l3-fp16 --l3-max-mb N`: the store is Redis with those settings, and a second
    server process (a restart) answers the first one's request from it, with the fp16 rounding of its output."""
    spec = f"{redis_url}#serve-{uuid.uuid4().hex}"           # a key prefix of this test's own
    layer = smollm2.config.n_layers // 2
    body = {"layer": layer, "residual": _residual(smollm2, 4).tolist()}
    outputs = []
    for run in range(2):
        with _serve_command("--l3", spec, "--l3-fp16", "--l3-max-mb", "3") as url:
            l3 = httpx.get(f"{url}/v1/model").json()["l3"]
            assert (l3["backend"], l3["dtype"], l3["max_bytes"], l3["enabled"]) == ("redis", "float16", 3 << 20, True)
            doc = httpx.post(f"{url}/v1/walk-ffn", json=body, timeout=120).json()
        assert (doc["cache"], doc["tier"]) == (("miss", None) if run == 0 else ("hit", "L3"))
        outputs.append(np.float32(doc["output"]))
    assert len(outputs[0]) == smollm2.config.hidden
    assert np.array_equal(outputs[1], outputs[0].astype(np.float16).astype(np.float32))
    assert not np.array_equal(outputs[1], outputs[0])        # it was stored as fp16, not as float32
