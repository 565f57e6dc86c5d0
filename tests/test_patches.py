"""INSERT patches on the real models: facts, patch files, and a cache that never serves stale outputs."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import SCENARIOS_DIR
from larql_desktop.engine.core import LarqlEngine, PatchAlreadyApplied
from larql_desktop.engine.cache.tiers import TierSettings
from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.patches.insert import Fact
from larql_desktop.engine.model.overlay import (PATCH_SET_KIND, Patch, PatchError, PatchOperation, PatchOverlay,
                                                encode_vector, patch_set_json)
from greedy_runs import run_sequence

FACTS = json.loads((SCENARIOS_DIR / "insert_facts.json").read_text())["facts"]


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("fact", FACTS, ids=[f["entity"] for f in FACTS])
def test_insert_makes_target_the_answer_and_leaves_control_alone(request, model_name, fact, capture_store):
    model = request.getfixturevalue(model_name)
    engine = LarqlEngine(model, capture_store=capture_store)
    ins = engine.inserter()
    token = ins.target_token(fact["target"])
    clean = engine.patches
    control_before = ins.continuation(fact["control"], clean)[1]
    result = engine.insert(Fact(fact["entity"], fact["relation"], fact["target"]))
    after = engine.patches
    p_after = ins.probability(fact["probe"], token, after)
    greedy_after = ins.continuation(fact["probe"], after, 1)[1]
    assert p_after >= 0.30 or greedy_after == [token], (result.layer, p_after)
    assert p_after > 10 * ins.probability(fact["probe"], token, clean)
    assert ins.continuation(fact["control"], after)[1] == control_before
    assert engine.patches.has_overrides_at(result.layer)


def test_removing_a_patch_restores_bit_identical_outputs(smollm2, capture_store):
    engine = LarqlEngine(smollm2, capture_store=capture_store)
    ids = smollm2.tokenizer.encode("The capital of Atlantis is")
    off = dict(l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))

    def logits():
        probe = LarqlEngine(smollm2, patches=engine.patches, **off).new_session()
        return run_sequence(smollm2, probe.ffn, ids, 4)[1]

    clean = logits()
    engine.insert(Fact("Atlantis", "capital-of", "Poseidon"))
    patched = logits()
    assert not np.array_equal(clean, patched)
    engine.remove_patch(engine.applied_patches[0].id)
    assert engine.applied_patches == () and engine.patches.overridden_layers == []
    assert np.array_equal(logits(), clean)


def test_patch_file_round_trip(smollm2, tmp_path, capture_store):
    engine = LarqlEngine(smollm2, capture_store=capture_store)
    result = engine.insert(Fact("Quillmoor", "language-of", "Elvish"))
    path = tmp_path / "fact.vlp.json"
    result.patch.save(path)
    loaded = engine.read_patch(path)
    assert [op.to_json() for op in loaded.operations] == [op.to_json() for op in result.patch.operations]
    # What was installed is in the file: every feature's layer, slot, target token and its place.
    doc = json.loads(path.read_text())
    tokens = engine.inserter().target_tokens("Elvish")
    assert [(o["layer"], o["feature"]) for o in doc["operations"]] == [(f.layer, f.feature) for f in result.features]
    assert all(o["target_token"] == tokens[o["token_index"]] and o["target"] == "Elvish" for o in doc["operations"])
    assert loaded.layers == result.layers
    fresh = LarqlEngine(smollm2)
    fresh.apply_patch(loaded)
    assert fresh.patches.epoch == engine.patches.epoch     # same content, same epoch


def _valid_doc(model) -> dict:
    d = model.config.hidden
    v = encode_vector(np.ones(d, np.float32))
    return {"version": 1, "base_model": model.name, "base_checksum": model.checksum, "created_at": "now",
            "description": "test", "operations": [
                {"op": "insert", "layer": 3, "feature": 5, "entity": "a", "relation": "b", "target": "c",
                 "gate": v, "up": v, "down": v, "gate_bias": -1.0, "target_token": 66, "token_index": 0},
                {"op": "update", "layer": 4, "feature": 6, "down": v},
                {"op": "delete", "layer": 3, "feature": 5}]}


def _broken(model, change):
    doc = _valid_doc(model)
    change(doc)
    return doc


BREAKAGES = {
    "wrong version": (lambda d: d.update(version=7), "unsupported patch version"),
    "another model": (lambda d: d.update(base_checksum="0" * 64), "made for another model"),
    "no operations": (lambda d: d.update(operations=[]), "non-empty list"),
    "unknown op": (lambda d: d["operations"][1].update(op="rename"), "unknown op"),
    "layer out of range": (lambda d: d["operations"][1].update(layer=999), "layer 999 is out of range"),
    "negative feature": (lambda d: d["operations"][1].update(feature=-1), "feature -1 is out of range"),
    "feature out of range": (lambda d: d["operations"][0].update(feature=10 ** 6), "out of range"),
    "short vector": (lambda d: d["operations"][1].update(down=encode_vector(np.ones(7, np.float32))),
                     "the model needs"),
    "bad base64": (lambda d: d["operations"][1].update(down="@@@not base64@@@"), "invalid base64"),
    "nan": (lambda d: d["operations"][1].update(down=encode_vector(np.full(576, np.nan, np.float32))),
            "NaN or infinity"),
    "insert without up": (lambda d: d["operations"][0].pop("up"), "needs gate, up and down"),
    "bool layer": (lambda d: d["operations"][1].update(layer=True), "out of range"),
    "bias not a number": (lambda d: d["operations"][0].update(gate_bias="high"), "gate_bias"),
    "target token out of range": (lambda d: d["operations"][0].update(target_token=10 ** 7),
                                  "target_token 10000000 is out of range"),
    "target token not a number": (lambda d: d["operations"][0].update(target_token="Pose"), "target_token"),
    "negative token index": (lambda d: d["operations"][0].update(token_index=-2), "token_index -2 is out of range"),
    "target token on an update": (lambda d: d["operations"][1].update(target_token=3), "only an insert"),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_malformed_patches_are_refused_whole(smollm2, tmp_path, name):
    change, message = BREAKAGES[name]
    engine = LarqlEngine(smollm2)
    engine.validate_patch(_valid_doc(smollm2))           # the unbroken document is fine
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_broken(smollm2, change)))
    with pytest.raises(PatchError, match=message):
        engine.read_patch(path)
    assert engine.applied_patches == ()


def test_unreadable_patch_files(smollm2, tmp_path):
    engine = LarqlEngine(smollm2)
    (tmp_path / "junk.json").write_text("{ this is not json")
    with pytest.raises(PatchError, match="not valid JSON"):
        engine.read_patch(tmp_path / "junk.json")
    with pytest.raises(PatchError, match="cannot read patch file"):
        engine.read_patch(tmp_path / "missing.json")


def test_cache_bypasses_exactly_the_patched_layers_and_matches_cache_off(smollm2, capture_store):
    # Two facts pinned to different layers: a multi-layer, multi-feature overlay.
    engine = LarqlEngine(smollm2, capture_store=capture_store)
    first_fact = engine.insert(Fact("Atlantis", "capital-of", "Poseidon"), layer=24)
    second_fact = engine.insert(Fact("Quillmoor", "language-of", "Elvish"), layer=20)
    layers = sorted(set(first_fact.layers) | set(second_fact.layers))
    assert 20 in layers and 24 in layers and engine.patches.overridden_layers == layers
    ids = smollm2.tokenizer.encode("The capital of Atlantis is")
    first, second = engine.new_session(), engine.new_session()
    tokens_1, logits_1 = run_sequence(smollm2, first.ffn, ids, 6)
    tokens_2, logits_2 = run_sequence(smollm2, second.ffn, ids, 6)
    off = LarqlEngine(smollm2, patches=engine.patches, l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))
    tokens_off, logits_off = run_sequence(smollm2, off.new_session().ffn, ids, 6)
    assert tokens_1 == tokens_2 == tokens_off
    assert np.array_equal(logits_1, logits_off) and np.array_equal(logits_2, logits_off)
    snap = engine.session_snapshot(second)
    patched = snap.bypasses["patched"]
    assert all(patched[layer] == 6 for layer in layers) and patched.sum() == 6 * len(layers)
    hits = snap.tiers["L2"].hits
    assert all(hits[layer] == 0 for layer in layers)
    assert all(hits[layer] == 6 for layer in range(smollm2.config.n_layers) if layer not in layers)
    # Removing both restores the base model's logits bit for bit.
    engine.remove_patch(engine.applied_patches[1].id)
    engine.remove_patch(engine.applied_patches[0].id)
    clean = LarqlEngine(smollm2, l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))
    restored = LarqlEngine(smollm2, patches=engine.patches, l1=TierSettings(enabled=False),
                           l2=TierSettings(enabled=False))
    assert np.array_equal(run_sequence(smollm2, restored.new_session().ffn, ids, 4)[1],
                          run_sequence(smollm2, clean.new_session().ffn, ids, 4)[1])


def test_patch_epochs_keep_states_apart_across_apply_remove_reapply(smollm2, capture_store):
    engine = LarqlEngine(smollm2, capture_store=capture_store)
    clean_epoch = engine.patches.epoch
    result = engine.insert(Fact("Zorbania", "currency-of", "Glimmer"))
    patched_epoch = engine.patches.epoch
    layer_epoch = engine.patches.layer_epoch(result.layer)
    engine.remove_patch(engine.applied_patches[0].id)
    assert engine.patches.epoch == clean_epoch != patched_epoch
    engine.apply_patch(result.patch)
    assert engine.patches.epoch == patched_epoch and engine.patches.layer_epoch(result.layer) == layer_epoch


# ---------------------------------------------------------------------------------- per-feature invalidation
PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "The largest planet is",
           "My favourite colour is", "The capital of Atlantis is"]


def _random_patch(model, rng) -> Patch:
    """Random overrides: inserted (gated) features that fire on some inputs and not others, plus plain ones,
    over several layers with several features on one layer (what a multi-token, multi-layer INSERT makes)."""
    cfg = model.config
    ops = []
    layers = rng.choice(cfg.n_layers, size=int(rng.integers(2, 4)), replace=False)
    for i in range(int(rng.integers(3, 7))):
        layer = int(layers[i % len(layers)] if i < 2 * len(layers) else rng.choice(layers))
        feature = int(rng.integers(cfg.intermediate))
        gate = rng.standard_normal(cfg.hidden).astype(np.float32)
        if rng.random() < 0.8:
            bias = float(rng.normal(-3.0, 4.0))    # fires on a fraction of inputs
            ops.append(PatchOperation("insert", layer, feature, gate, rng.standard_normal(cfg.hidden).astype(np.float32),
                                      rng.standard_normal(cfg.hidden).astype(np.float32) * 0.05, bias, "e", "r", "t",
                                      target_token=int(rng.integers(cfg.vocab_size)), token_index=i % 3))
        else:
            ops.append(PatchOperation("update", layer, feature,
                                      down=rng.standard_normal(cfg.hidden).astype(np.float32) * 0.05))
    return Patch(tuple(ops), model.name, model.checksum)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 31 - 1))
def test_per_feature_hits_always_equal_fresh_computation(smollm2, seed):
    rng = np.random.default_rng(seed)
    engine = LarqlEngine(smollm2, walk=WalkSettings(patch_mode="per_feature", verify_fraction=1.0))
    for _ in range(4):
        if engine.applied_patches and rng.random() < 0.35:
            engine.remove_patch(engine.applied_patches[int(rng.integers(len(engine.applied_patches)))].id)
        else:
            engine.apply_patch(_random_patch(smollm2, rng))
        prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
        ids = smollm2.tokenizer.encode(prompt)
        for _ in range(2):
            run_sequence(smollm2, engine.new_session().ffn, ids, 3)
    assert len(engine.patches.overridden_layers) >= 2 or not engine.applied_patches
    snap = engine.snapshot()
    assert snap.fidelity.checked == snap.hits > 0
    # Every served entry is exactly what the current weights and patches compute from the input that made
    # it: no patch state ever leaks into another. (A hit's input may still differ slightly from that one —
    # an upstream patch can nudge a residual without changing its feature set — which is the approximation
    # the seed's keys always carry, measured by mean/min cosine, not staleness.)
    assert snap.fidelity.max_stale_error == 0.0


def test_a_patch_set_file_holds_many_patches_listed_and_removed_one_by_one(smollm2, tmp_path):
    """Many facts in one file: saved in order with their names, loaded back as separate patches (applied in one
    change), each removable on its own, which restores the outputs of the set without it bit for bit."""
    rng = np.random.default_rng(7)
    made = [_random_patch(smollm2, rng).named(f"fact {i}") for i in range(3)]
    engine = LarqlEngine(smollm2)
    engine.apply_patches(made)
    path = tmp_path / "facts.json"
    assert engine.save_patches(path) == 3
    doc = json.loads(path.read_text())
    assert doc["kind"] == PATCH_SET_KIND and [e["name"] for e in doc["patches"]] == ["fact 0", "fact 1", "fact 2"]

    fresh = LarqlEngine(smollm2)
    loaded = fresh.read_patches(path)
    assert [p.id for p in loaded] == [p.id for p in made] and [p.name for p in loaded] == [p.name for p in made]
    fresh.apply_patches(loaded)
    assert fresh.patches.epoch == engine.patches.epoch
    assert [s.id for s in fresh.patch_summaries()] == [p.id for p in made]

    ids = smollm2.tokenizer.encode("The capital of Atlantis is")
    off = dict(l1=TierSettings(enabled=False), l2=TierSettings(enabled=False))

    def logits(patches):
        return run_sequence(smollm2, LarqlEngine(smollm2, patches=patches, **off).new_session().ffn, ids, 3)[1]

    without_middle = LarqlEngine(smollm2)
    without_middle.apply_patches([made[0], made[2]])
    fresh.remove_patch(loaded[1].id)
    assert [p.id for p in fresh.applied_patches] == [made[0].id, made[2].id]
    assert fresh.patches.epoch == without_middle.patches.epoch
    assert np.array_equal(logits(fresh.patches), logits(without_middle.patches))
    assert not np.array_equal(logits(fresh.patches), logits(engine.patches))   # the removed one mattered

    # Saving a chosen few writes those only; a file of one patch is read as before.
    assert fresh.save_patches(tmp_path / "one.json", [made[2].id]) == 1
    assert [p.id for p in fresh.read_patches(tmp_path / "one.json")] == [made[2].id]
    made[0].save(tmp_path / "single.json")
    assert [(p.id, p.name) for p in fresh.read_patches(tmp_path / "single.json")] == [(made[0].id, "single")]
    # Unnamed patches of a set file are named after the file; nothing applied, nothing to save.
    unnamed = tmp_path / "unnamed.json"
    unnamed.write_text(json.dumps(patch_set_json([p.named("") for p in made[:2]])))
    assert [p.name for p in fresh.read_patches(unnamed)] == ["unnamed 1", "unnamed 2"]
    with pytest.raises(PatchError, match="no patch to save"):
        LarqlEngine(smollm2).save_patches(tmp_path / "none.json")
    assert not (tmp_path / "none.json").exists()


def test_a_bad_patch_set_is_refused_whole_and_changes_nothing(smollm2, tmp_path):
    rng = np.random.default_rng(11)
    made = [_random_patch(smollm2, rng) for _ in range(3)]
    engine = LarqlEngine(smollm2)
    engine.apply_patch(made[0])
    before = (engine.applied_patches, engine.patches.epoch)
    cases = {
        "another model": (lambda d: d["patches"][1]["patch"].update(base_checksum="0" * 64), "patch 2: made for another model"),
        "twice the same": (lambda d: d["patches"].append(d["patches"][0]), "patch 4: the same patch as patch 1"),
        "no patches": (lambda d: d.update(patches=[]), "non-empty list"),
        "not an object": (lambda d: d["patches"].insert(1, "fact"), "patch 2: expected an object"),
        "a name not text": (lambda d: d["patches"][2].update(name=5), "patch 3: 'name' must be a string"),
        "a later version": (lambda d: d.update(version=9), "unsupported patch set version 9"),
    }
    for name, (change, message) in cases.items():
        doc = patch_set_json(made)
        change(doc)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(PatchError, match=message):
            engine.read_patches(path)
        assert (engine.applied_patches, engine.patches.epoch) == before, name
    # A set holding an applied patch: none of it is applied.
    with pytest.raises(PatchAlreadyApplied, match="already applied"):
        engine.apply_patches(made)
    assert (engine.applied_patches, engine.patches.epoch) == before


def _insert_pair(layer: int, slots: tuple[int, int], gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                 fact: tuple[str, str, str]) -> tuple[PatchOperation, PatchOperation]:
    """A step pair as INSERT writes one (keys.step_pair): the second feature one unit later, subtracting."""
    entity, relation, target = fact
    return tuple(PatchOperation("insert", layer, slot, gate, up, sign * down, bias, entity=entity, relation=relation,
                                target=target, token_index=0)
                 for slot, sign, bias in ((slots[0], 1.0, 0.0), (slots[1], -1.0, -1.0)))


def test_where_two_facts_keys_fire_the_stronger_fact_holds_alone(smollm2):
    """Facts installed together compete where their keys fire at one position: the fact whose key scores highest
    writes there, exactly as if it were the only fact; where one key fires alone, that fact writes as alone; a
    plain override holds everywhere. (An earlier fact's key never saw later facts' questions: it reaches past its
    own entity, more weakly than the later fact's own key, and must give way rather than write its target over.)"""
    engine = LarqlEngine(smollm2)
    cfg, base = smollm2.config, engine.inserter().base
    layer, d = 20, cfg.hidden
    rng = np.random.default_rng(7)
    a_dir, b_dir = (v / np.linalg.norm(v) for v in rng.standard_normal((2, d)).astype(np.float32))
    up = (rng.standard_normal(d) / np.sqrt(d)).astype(np.float32)
    down_a, down_b = (rng.standard_normal((2, d)) * 4).astype(np.float32)
    fact_a, fact_b = ("Tarnhollow", "capital-of", "Gildmere"), ("Orinth", "capital-of", "Velm")
    patch_a = Patch(_insert_pair(layer, (3, 4), a_dir, up, down_a, fact_a), smollm2.name, smollm2.checksum)
    patch_b = Patch(_insert_pair(layer, (5, 6), b_dir, up, down_b, fact_b), smollm2.name, smollm2.checksum)
    plain = Patch((PatchOperation("update", layer, 9, down=down_b),), smollm2.name, smollm2.checksum)
    # Rows: A's key alone, both with A stronger, both with B stronger, neither (scores along each key's gate).
    along = np.array([[3.0, -2.0], [5.0, 2.0], [2.0, 6.0], [-1.0, -3.0]], np.float32)
    x = (along @ np.stack([a_dir, b_dir]) + 0.01 * rng.standard_normal((4, d))).astype(np.float32)

    def ffn_out(*patches: Patch) -> np.ndarray:
        overlay = PatchOverlay.build(patches, base)
        return WalkFfn(smollm2.ffn, WalkSettings(dense=True), model_checksum=smollm2.checksum, patches=overlay)(layer, x)

    both = PatchOverlay.build((patch_a, patch_b, plain), base).layer(layer)
    holds = both.holding(x @ both.gate.T + both.gate_bias)
    column = {int(f): i for i, f in enumerate(both.features)}
    a_holds, b_holds = holds[:, column[3]], holds[:, column[5]]
    assert a_holds.tolist() == [True, True, False, False]
    assert b_holds.tolist() == [False, False, True, False]
    assert holds[:, column[9]].all()
    together, only_a, only_b = ffn_out(patch_a, patch_b, plain), ffn_out(patch_a, plain), ffn_out(patch_b, plain)
    np.testing.assert_array_equal(together[[0, 1, 3]], only_a[[0, 1, 3]])
    np.testing.assert_array_equal(together[2], only_b[2])
    assert not np.array_equal(only_a[2], only_b[2])      # the rows tell the facts apart
    # One fact's features are one group, whichever patch holds them: a fact split over two patches (as an
    # insert's trial writes are) does not compete with itself.
    halves = [Patch((op,), smollm2.name, smollm2.checksum) for op in patch_a.operations]
    np.testing.assert_array_equal(ffn_out(*halves), ffn_out(patch_a))
