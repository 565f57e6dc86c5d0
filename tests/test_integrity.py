"""Nothing served that the model did not compute (issue 14): each defect reproduced against the real server, the
real SQLite and Redis stores and the real graph files, and shown fixed.

  * a hit needs the entry's own input: 3x and 1e20x residuals through the HTTP API poison nobody, also after a
    restart from L3, and nothing non-finite is stored or returned;
  * L3 values carry a checksum: flipped bytes are never served, and the bad value is deleted;
  * two processes sharing one SQLite L3 rebuild it once and go on sharing;
  * graph files are verified by their whole content: a same-size same-mtime corruption is rebuilt at load;
  * the small ones: patch values that overflow float32, nested JSON, NaN alpha, tiny temperatures, a negative
    seed, a non-ASCII bearer token.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from larql_desktop.api.server import INPUT_NORM_MARGIN, max_ffn_input_norm, start_server
from larql_desktop.engine.cache.l3 import SqliteL3
from larql_desktop.engine.cache.l3.codec import decode_entry, encode_entry, value_address, value_checksum
from larql_desktop.engine.cache.keys import feature_key, key_features, select_features
from larql_desktop.engine.cache.tiers import CacheEntry, DEFAULT_MAX_DISTANCE, HitRule, TierSettings
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.graphs.decoder import OnnxDecoder
from larql_desktop.engine.graphs.store import GraphStore, file_digest, make_model, release_read_pages
from larql_desktop.engine.loading import load_model
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.patches.insert import Fact
from larql_desktop.engine.model.overlay import PatchError, encode_vector, parse_patch
from greedy_runs import run_sequence
from polling import wait_for
from resident import resident_kb
from test_l3 import NS, _entry, open_store, redis_url  # noqa: F401  (fixtures)

TOKEN = "s3cret-token-for-tests-0123456789"
PROMPT = "Name a large animal that lives in the sea."


# ----------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def real_inputs(smollm2):
    """Real normed FFN inputs of SmolLM2, per layer: (T, d) for the prompt's positions."""
    captured = {}

    def recording(layer, x):
        captured[layer] = x.copy()
        return smollm2.ffn.dense(layer, x)
    smollm2.transformer.forward(smollm2.tokenizer.encode(PROMPT), KvCache(smollm2.config), recording)
    return captured


def _key(model, layer, x, top_k):
    scores = model.ffn.gate_scores(layer, x[None, :])[0]
    return feature_key(key_features(scores, select_features(scores, top_k), top_k))


def _uncached(model, layer, x):
    walk = LarqlEngine(model, l2=TierSettings(enabled=False)).request_walk()
    return walk(layer, x[None, :])[0]


def _poisonable(model, real_inputs, scale):
    """(layer, x) where scale * x selects the same features as x: the seed's key cannot tell them apart."""
    top_k = LarqlEngine(model).walk_settings.resolved(model.config.intermediate).top_k
    for layer, xs in real_inputs.items():
        x = xs[-1]
        if _key(model, layer, x, top_k) == _key(model, layer, np.float32(scale) * x, top_k):
            return layer, x
    pytest.fail(f"no layer where {scale}x selects the same features as x: the attack premise does not hold")


def _post(url, layer, x):
    with httpx.Client(base_url=url, timeout=60) as client:
        return client.post("/v1/walk-ffn", json={"layer": layer, "residual": np.asarray(x, np.float64).tolist()})


# ----------------------------------------------------------------------------------------------- hit rule
def test_hit_rule_serves_exact_and_half_precision_repeats_only():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(576).astype(np.float32)
    near, guard = HitRule(), HitRule("cosine", tau=0.99)
    assert near.closeness(x, x.copy()) == 0.0
    assert near.closeness(x, x.astype(np.float16).astype(np.float32)) is not None     # an fp16 L3 entry
    one_percent_off = x + 0.01 * np.linalg.norm(x) / np.sqrt(x.size) * rng.standard_normal(x.size)
    with np.errstate(over="ignore"):          # (1e20 x)^2 overflows float32: refused, not an error
        for foreign in (np.float32(3) * x, np.float32(1e20) * x, one_percent_off, np.full(x.size, np.nan),
                        np.zeros(x.size)):
            foreign = foreign.astype(np.float32)
            assert near.closeness(x, foreign) is None and near.closeness(foreign, x) is None
        # The cosine guard is angle and length: scale no longer fools it.
        assert guard.closeness(x, np.float32(1.01) * x) is not None
        assert guard.closeness(x, np.float32(3) * x) is None and guard.closeness(x, np.float32(1e20) * x) is None
    assert HitRule("feature_set").closeness(x, np.float32(3) * x) is not None           # the opt-in, unsafe
    assert WalkSettings().hit_rule == HitRule("near", DEFAULT_MAX_DISTANCE)
    assert WalkSettings(cosine_guard=0.9).hit_rule.mode == "cosine"
    assert WalkSettings(feature_set_hits=True).hit_rule.mode == "feature_set"


def test_the_bound_is_measured_on_real_inputs(smollm2, real_inputs):
    """The figures behind DEFAULT_MAX_DISTANCE on this prompt: fp16 rounding stays below it, and distinct inputs
    that share a (width-1) key are well above it."""
    xs = np.concatenate(list(real_inputs.values()))
    half = xs.astype(np.float16).astype(np.float32)
    fp16 = np.linalg.norm(half - xs, axis=1) / np.linalg.norm(xs, axis=1)
    assert fp16.max() < DEFAULT_MAX_DISTANCE / 2
    closest = np.inf
    for layer, layer_xs in real_inputs.items():
        scores = smollm2.ffn.gate_scores(layer, layer_xs)
        groups = {}
        for x, s in zip(layer_xs, scores):
            groups.setdefault(int(np.argmax(np.abs(s))), []).append(x)
        for group in groups.values():
            for i in range(len(group)):
                for j in range(i):
                    closest = min(closest, float(np.linalg.norm(group[i] - group[j]) / np.linalg.norm(group[i])))
    assert closest > 5 * DEFAULT_MAX_DISTANCE
    # An input the model makes is within the norm the API accepts, with the margin to spare.
    limits = max_ffn_input_norm(smollm2) / INPUT_NORM_MARGIN
    for layer, layer_xs in real_inputs.items():
        assert np.linalg.norm(layer_xs, axis=1).max() <= limits[layer] * 1.0001


# ----------------------------------------------------------------------------------------------- poisoning
@pytest.mark.parametrize("walk", [WalkSettings(), WalkSettings(cosine_guard=0.999), WalkSettings(feature_set_hits=True)],
                         ids=["default", "cosine-guard", "engine-feature-set"])
def test_scaled_residuals_poison_no_client_also_after_a_restart(smollm2, real_inputs, tmp_path, walk):
    layer, x = _poisonable(smollm2, real_inputs, 3.0)
    truth, truth_3x = _uncached(smollm2, layer, x), _uncached(smollm2, layer, np.float32(3) * x)
    assert np.abs(truth - truth_3x).max() > 3 * np.abs(truth).max()     # what the seed's key would serve
    path = tmp_path / "l3.sqlite3"

    def serve():
        engine = LarqlEngine(smollm2, walk=walk, l3=SqliteL3(path))
        return engine, start_server(engine, "127.0.0.1", 0)

    engine, handle = serve()
    try:
        attacker = _post(handle.url, layer, np.float32(3) * x)
        assert attacker.status_code == 200 and attacker.json()["cache"] == "miss"
        assert np.array_equal(np.float32(attacker.json()["output"]), truth_3x)
        huge = _post(handle.url, layer, np.float32(1e20) * x)
        assert huge.status_code == 422 and "norm" in huge.json()["detail"]
        assert int(engine.snapshot().tiers["L3"].entries.sum()) == 1          # the 3x entry, nothing else
    finally:
        handle.stop()
        engine.l3.close()

    # A restart: L2 is empty, L3 holds the attacker's entry under x's key.
    engine, handle = serve()
    try:
        victim = _post(handle.url, layer, x)
        assert victim.status_code == 200 and victim.json()["cache"] == "miss"
        assert np.array_equal(np.float32(victim.json()["output"]), truth)
        again = _post(handle.url, layer, x)                    # the victim's own entry does hit
        assert again.json()["cache"] == "hit" and np.array_equal(np.float32(again.json()["output"]), truth)
        assert _post(handle.url, layer, np.float32(3) * x).json()["cache"] == "miss"
    finally:
        handle.stop()
        engine.l3.close()


def test_non_finite_outputs_are_never_stored_or_served(smollm2, real_inputs, tmp_path):
    layer, x = _poisonable(smollm2, real_inputs, 1e20)
    engine = LarqlEngine(smollm2, walk=WalkSettings(feature_set_hits=True), l3=SqliteL3(tmp_path / "l3.sqlite3"))
    session_walk = engine.new_session().ffn           # the app's walk (L1, L2, L3), with the unsafe opt-in on
    with np.errstate(all="ignore"):
        overflowed = session_walk(layer, np.float32(1e20) * x[None, :])
    assert not np.isfinite(overflowed).all()
    snap = engine.snapshot()
    assert snap.tiers["L2"].entries.sum() == 0 and snap.tiers["L3"].entries.sum() == 0
    assert np.array_equal(session_walk(layer, x[None, :])[0], _uncached(smollm2, layer, x))
    # Nor does the L3 take one from any writer.
    assert not engine.l3.put(layer, NS, 1, CacheEntry(np.full(4, np.inf, np.float32), np.ones(4, np.float32)))
    engine.l3.close()


# ----------------------------------------------------------------------------------------------- L3 values
def _flip_inside_values(store, backend, n):
    """Flip one byte in the vectors of each of n stored values, beneath the store (the file or the server)."""
    if backend == "sqlite":
        store.close()
        with sqlite3.connect(store.path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        raw = bytearray(store.path.read_bytes())
        flipped = 0
        for k in range(n):
            blob = encode_entry(_entry(k, d=256), "float32", value_address(_ns_id(), 0, k))
            at = raw.find(blob[40:72])
            assert at > 0, "the value's bytes are where SQLite keeps them"
            raw[at + 7] ^= 0x10
            flipped += 1
        store.path.write_bytes(bytes(raw))
        return flipped
    client = store.client
    for k in range(n):
        name = store._key(0, _ns_id(), k)
        byte = client.getrange(name, 50, 50)
        client.setrange(name, 50, bytes([byte[0] ^ 0x10]))
    return n


def _ns_id():
    from larql_desktop.engine.cache.l3 import namespace_id

    return namespace_id(NS)


def test_flipped_bytes_inside_l3_values_are_never_served_and_are_deleted(open_store):
    store = open_store()
    n = 200
    for k in range(n):
        assert store.put(0, NS, k, _entry(k, d=256))
    assert _flip_inside_values(store, open_store.backend, n) == n
    reader = open_store()
    served = [reader.get(0, NS, k) for k in range(n)]
    assert all(e is None for e in served)
    assert reader.errors.get("bad value") == n and "corrupt" not in reader.errors
    assert int(reader.occupancy(1)[1][0]) == 0                    # every bad value was deleted
    assert reader.put(0, NS, 5, _entry(5, d=256)) and reader.get(0, NS, 5) is not None


def test_a_value_copied_to_another_key_does_not_verify():
    blob = encode_entry(_entry(1), "float32", value_address(7, 3, 42))
    assert decode_entry(blob, value_address(7, 3, 42)) is not None
    assert decode_entry(blob, value_address(7, 3, 43)) is None and decode_entry(blob, value_address(7, 4, 42)) is None


# ----------------------------------------------------------------------------------------------- two processes
_OTHER_PROCESS = """
import sys, numpy as np
from larql_desktop.engine.cache.l3 import SqliteL3
from larql_desktop.engine.cache.tiers import CacheEntry
NS = ('checksum', 100, 100, 'clean')
def entry(k):
    return CacheEntry(np.full(256, k, np.float32), np.ones(256, np.float32))
store = SqliteL3(sys.argv[1])
print(sum(store.get(k % 10, NS, k) is not None for k in range(300)), flush=True)   # the healthy store
sys.stdin.readline()                                    # meanwhile: corrupted, and rebuilt by the test process
print(sum(store.get(0, NS, k) is not None for k in range(1000, 1100)), flush=True)
print(sum(store.put(0, NS, k, entry(k)) for k in range(2000, 2100)), flush=True)
print(sum(store.get(k % 10, NS, k) is not None for k in range(300)), sorted(store.errors.items()), flush=True)
store.close()
"""


def test_two_processes_rebuild_a_corrupt_store_once_and_go_on_sharing(tmp_path):
    path = tmp_path / "l3.sqlite3"
    seeding = SqliteL3(path)
    for k in range(300):
        seeding.put(k % 10, NS, k, _entry(k, d=256))
    seeding.close()
    other = subprocess.Popen([sys.executable, "-c", _OTHER_PROCESS, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert other.stdout.readline().strip() == "300"
        garbage = np.random.default_rng(0).bytes(path.stat().st_size - 3 * 4096)
        with open(path, "r+b") as fh:              # the disk damages pages under both processes
            fh.seek(3 * 4096)
            fh.write(garbage)
        here = SqliteL3(path)                       # this process finds it corrupt and rebuilds it
        assert here.errors == {"corrupt": 1}
        for k in range(1000, 1100):
            assert here.put(0, NS, k, _entry(k, d=256))
        assert here.flush(30)                       # written behind: in the file before the other one looks
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "100"          # it reads this process's entries...
        assert other.stdout.readline().strip() == "100"          # ...writes its own...
        last = other.stdout.readline().strip()
        assert other.wait(60) == 0
    finally:
        if other.poll() is None:
            other.kill()
    assert last.startswith("0 ") and "'corrupt'" not in last and "replaced" in last
    # ...which this one reads, once it looks for other processes' inserts (within SqliteL3.REFRESH_EVERY)
    assert wait_for(lambda: here.get(0, NS, 2000) is not None, within=10)
    assert sum(here.get(0, NS, k) is not None for k in range(2000, 2100)) == 100
    # Only the damaged file was moved aside, once: the rebuilt store stayed in place.
    assert (tmp_path / "l3.sqlite3.corrupt").read_bytes()[3 * 4096:] == garbage
    assert {p.name for p in tmp_path.glob("*.corrupt*")} <= {"l3.sqlite3.corrupt", "l3.sqlite3.corrupt-wal",
                                                             "l3.sqlite3.corrupt-shm"}
    # (SQLite itself leaves a moved file's -wal and -shm alone when the other process closes its old connection:
    # it checks whether its database file has moved before it checkpoints and deletes them by name.)
    assert here.errors == {"corrupt": 1}
    here.close()


# ----------------------------------------------------------------------------------------------- graph files
def _corrupt_in_place(path, offset_fraction=0.5, n=64):
    """Flip bytes in the middle of a file, then put its size and modification time back."""
    stat = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(int(stat.st_size * offset_fraction))
        chunk = bytearray(fh.read(n))
        fh.seek(int(stat.st_size * offset_fraction))
        fh.write(bytes(b ^ 0x5A for b in chunk))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


@pytest.fixture
def own_graphs(app_paths, tmp_path):
    """App paths whose exported graphs are this test's own (the models are the shared ones)."""
    return dataclasses.replace(app_paths, cache=tmp_path / "cache").ensure()


def test_a_same_size_same_mtime_graph_corruption_is_rebuilt_and_serves_nothing_wrong(own_graphs, tmp_path):
    model = load_model("smollm2", own_graphs, threads=2, preload="layers")
    ids = model.encode_prompt([{"role": "user", "content": PROMPT}])
    off = LarqlEngine(model, l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))
    truth_tokens, truth_logits = run_sequence(model, off.new_session().ffn, ids, 6)
    first = LarqlEngine(model, l3=SqliteL3(tmp_path / "l3.sqlite3"))
    run_sequence(model, first.new_session().ffn, ids, 6)
    first.l3.close()
    numerics = model.ffn.numerics
    target = model.ffn.directory / "layer05.walk.onnx"
    good = file_digest(target)
    _corrupt_in_place(target)
    del model, off, first

    again = load_model("smollm2", own_graphs, threads=2, preload="layers")
    assert again.ffn.rebuilt == ["layer05.walk.onnx"] and file_digest(target) == good
    assert again.ffn.numerics == numerics        # the same content again, so the same namespace
    for l3 in (None, SqliteL3(tmp_path / "l3.sqlite3")):
        engine = LarqlEngine(again, l3=l3)
        tokens, logits = run_sequence(again, engine.new_session().ffn, ids, 6)
        assert tokens == truth_tokens and np.array_equal(logits, truth_logits)
        if l3 is not None:
            assert engine.snapshot().tiers["L3"].hits.sum() == 6 * again.config.n_layers
            l3.close()


def test_the_namespace_carries_the_graphs_content_digest(tmp_path):
    from onnx import TensorProto, helper

    def build(kind):
        return lambda: make_model([helper.make_node(kind, ["x"], ["y"])], [],
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], "tiny")

    store = GraphStore(tmp_path, "manifest.json", 1)
    store.ensure("a.onnx", build("Relu"))
    store.save()
    relu = store.digest(["a.onnx"])
    reopened = GraphStore(tmp_path, "manifest.json", 1)
    assert reopened.is_valid("a.onnx") and reopened.digest(["a.onnx"]) == relu
    other = GraphStore(tmp_path / "other", "manifest.json", 1)
    other.ensure("a.onnx", build("Neg"))
    assert other.digest(["a.onnx"]) != relu


def test_a_corrupted_decoder_graph_gives_the_same_reply(own_graphs, monkeypatch, capsys):
    from larql_desktop.cli import main

    monkeypatch.setenv("LARQL_DESKTOP_CACHE_DIR", str(own_graphs.cache))
    argv = ["chat", "--model", "smollm2", "--max-tokens", "8", "What colour is the sky?"]
    assert main(argv) == 0
    truth = capsys.readouterr().out
    assert truth.strip()
    directory = next((own_graphs.onnx_dir).iterdir())
    weights = next(directory.glob("decoder.optimized-ort*.onnx.data"))
    _corrupt_in_place(weights, 0.3, 4096)
    assert main(argv) == 0
    assert capsys.readouterr().out == truth
    manifest = json.loads((directory / "decoder.manifest.json").read_text())
    assert manifest["files"][weights.name]["xxh3"] == file_digest(weights)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("damage", ["nan", "late nan", "inf", "one -inf", "all -inf"])
def test_non_finite_logits_are_an_error_not_an_empty_reply(temperature, damage):
    """NaN, infinity and an all -inf row are refused wherever they sit, greedy or sampled."""
    from larql_desktop.engine.model.generation import Sampler

    logits = np.zeros(10, np.float32)
    if damage == "nan":
        logits[3] = np.nan
    elif damage == "late nan":
        logits[:9] = 5.0
        logits[9] = np.nan
    elif damage == "inf":
        logits[7] = np.inf
    elif damage == "one -inf":
        logits[2] = -np.inf
    else:
        logits[:] = -np.inf
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        Sampler(SamplingSettings(temperature=temperature))(logits)


# ----------------------------------------------------------------------------------------------- small ones
def _patch_doc(model, **op):
    d = model.config.hidden
    base = {"op": "insert", "layer": 3, "feature": 7, "gate": encode_vector(np.ones(d)), "up": encode_vector(np.ones(d)),
            "down": encode_vector(np.ones(d)), "entity": "a", "relation": "b", "target": "c"}
    return {"version": 1, "base_model": model.name, "base_checksum": model.checksum, "operations": [{**base, **op}]}


def test_patch_values_that_overflow_float32_are_refused(smollm2):
    cfg = smollm2.config
    shape = dict(n_layers=cfg.n_layers, intermediate=cfg.intermediate, hidden=cfg.hidden, checksum=smollm2.checksum)
    parse_patch(_patch_doc(smollm2, gate_bias=-3.5), **shape)
    for bias, says in ((1e300, "32-bit"), (-1e39, "32-bit"), (10 ** 400, "32-bit"), (float("nan"), "32-bit"),
                       (2e6, "exceeds")):
        with pytest.raises(PatchError, match=says):
            parse_patch(_patch_doc(smollm2, gate_bias=bias), **shape)
    with pytest.raises(PatchError, match="exceeds the limit"):
        parse_patch(_patch_doc(smollm2, down=encode_vector(np.full(cfg.hidden, 1e30))), **shape)


def test_deeply_nested_json_is_a_clean_error(tmp_path, served_plain, capsys):
    nested = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "nested.vlp"
    path.write_text(nested)
    with pytest.raises(PatchError, match="nested too deeply"):
        read_json(path, "patch file", PatchError)
    from larql_desktop.cli import main

    assert main(["patch", "validate", str(path)]) == 2
    assert "nested too deeply" in capsys.readouterr().err
    r = httpx.post(f"{served_plain.url}/v1/patches", content=nested, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["detail"]


@pytest.fixture
def served_plain(smollm2):
    engine = LarqlEngine(smollm2)
    handle = start_server(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


def test_nan_alpha_is_refused_as_nan(served_plain):
    r = httpx.post(f"{served_plain.url}/v1/insert", content='{"entity": "a", "relation": "b", "target": "c", '
                   '"alpha": NaN}', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "finite" in r.json()["detail"] and "100" not in r.json()["detail"]


def test_nan_alpha_is_refused_as_nan_by_the_engine(smollm2):
    with pytest.raises(ValueError, match="finite"):
        LarqlEngine(smollm2).insert(Fact("a", "b", "c"), alpha=float("nan"))


def test_a_tiny_temperature_and_a_negative_seed_are_refused_with_their_names(capsys):
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings(temperature=1e-310)
    with pytest.raises(ValueError, match="seed"):
        SamplingSettings(seed=-1)
    SamplingSettings(temperature=0.5, seed=0)
    from larql_desktop.cli import main

    with pytest.raises(SystemExit, match="^2$"):             # argparse's usage error
        main(["chat", "--seed", "-1", "hello"])
    assert "--seed" in capsys.readouterr().err


def test_a_non_ascii_bearer_token_works(smollm2):
    token = "jeton-secret-été-0123456789"
    engine = LarqlEngine(smollm2)
    handle = start_server(engine, "127.0.0.1", 0, token=token)
    try:
        good = httpx.get(f"{handle.url}/v1/health", headers={"Authorization": f"Bearer {token}".encode("utf-8")})
        bad = httpx.get(f"{handle.url}/v1/health", headers={"Authorization": f"Bearer {token[:-1]}x".encode("utf-8")})
        assert good.status_code == 200 and bad.status_code == 401
    finally:
        handle.stop()


# ----------------------------------------------------------------------------------------------- what it checks
def test_the_checks_per_hit_and_per_load_pass_on_good_data(smollm2, gemma3, real_inputs):
    """The input check of a hit, the checksum of an L3 value and the hashing of every graph file a load does,
    on good data: each passes, and each covers what it should (what they cost is a timing fact, printed by
    `bench`, never asserted by a test on a shared machine)."""
    x = real_inputs[5][-1]
    assert HitRule().closeness(x, x) == 0.0                   # the same input: served, at distance nothing
    entry = CacheEntry(_uncached(smollm2, 5, x), x)
    address = value_address(1, 5, 42)
    blob = encode_entry(entry, "float32", address)
    header, stored, vectors = blob[:8], int.from_bytes(blob[8:16], "little"), memoryview(blob)[16:]
    assert value_checksum(address, header, vectors) == stored
    assert np.isfinite(np.frombuffer(vectors, np.float32)).all()
    decoded = decode_entry(blob, address)
    assert np.array_equal(decoded.output, entry.output) and np.array_equal(decoded.residual, entry.residual)
    assert decode_entry(blob, value_address(1, 5, 43)) is None   # the checksum covers the address too
    for model in (smollm2, gemma3):
        manifests = list(model.ffn.directory.glob("*manifest.json"))
        assert manifests
        for manifest in manifests:
            fmt = json.loads(manifest.read_text())["format"]
            store = GraphStore(model.ffn.directory, manifest.name, fmt)
            assert store._manifest and all(store.is_valid(name) for name in store._manifest)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and releases pages through /proc and madvise")
def test_the_decoders_weight_file_pages_are_released_once_prepacked_and_read_back_the_same(smollm2, app_paths):
    """onnxruntime maps the optimised decoder's weights file and reads it to prepack its weights: a load drops
    the pages it read (they would stay resident beside the prepacked copies). A page read again comes back from
    the file: a decode after another release computes the same logits, bit for bit."""
    # A load of its own: the session fixture's first load may have run on the graph as exported (making the
    # optimised copy), which maps no weights file.
    decoder = OnnxDecoder(smollm2.gguf, smollm2.config, smollm2.checksum, app_paths.onnx_dir)
    decoder.load_sessions()
    data = next(decoder.directory.glob("decoder.optimized-ort*.onnx.data"))
    assert data.stat().st_size > 50 * 2 ** 20 and resident_kb(data) == 0          # of a 100 MB file
    ids = np.array(smollm2.encode_prompt([{"role": "user", "content": PROMPT}]), np.int64)

    def dense_logits() -> np.ndarray:
        return decoder.run(smollm2.transformer.embed(ids), 0, KvCache(smollm2.config), smollm2.transformer.rope)

    before = dense_logits()
    assert release_read_pages(data) > 0 and resident_kb(data) == 0
    assert np.array_equal(dense_logits(), before)
    assert np.argmax(before[-1]) == np.argmax(smollm2.transformer.decoder.run(
        smollm2.transformer.embed(ids), 0, KvCache(smollm2.config), smollm2.transformer.rope)[-1])
