"""The command line, run as a user runs it: a subprocess on the real models."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REFERENCE_FILE, SCENARIOS_DIR


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "larql_desktop", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ), stdin=subprocess.DEVNULL)


def test_chat_prints_reply_and_decode_speed():
    result = run_cli("chat", "Name three primary colors.", "--max-tokens", "24")   # see test_engine: no near-tie
    assert result.returncode == 0, result.stderr
    assert "red" in result.stdout.lower() and "blue" in result.stdout.lower()
    assert "tok/s" in result.stderr


def test_chat_walk_reports_cache_use():
    result = run_cli("chat", "--ffn", "walk", "--max-tokens", "6", "Hello")
    assert result.returncode == 0, result.stderr
    assert "decode lookups" in result.stderr


@pytest.mark.parametrize("args, message", [
    (("chat", "--model", "/nonexistent/model.gguf", "hi"), "no such GGUF file"),
    (("chat", "--model", "mistral-7b", "hi"), "unknown model"),
    (("chat", "   "), "empty"),
    (("chat", "--temperature", "-3", "hi"), "temperature"),
    (("--threads", "0", "chat", "hi"), "threads"),
    (("verify-reference", "/nonexistent.json"), "cannot read reference file"),
])
def test_bad_input_gets_a_clear_error(args, message):
    result = run_cli(*args)
    assert result.returncode != 0
    assert message in result.stderr


def test_verify_reference_last_line(tmp_path):
    # One prompt per model keeps this quick; the full file is checked in test_engine.
    doc = json.loads(REFERENCE_FILE.read_text())
    for entry in doc["models"].values():
        entry["prompts"] = entry["prompts"][:1]
    small = tmp_path / "ref.json"
    small.write_text(json.dumps(doc))
    result = run_cli("verify-reference", str(small))
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("agreement: ") and "clear positions; tokenizer: " in last
    assert last.endswith("identical")
    pct = float(last.split("agreement: ")[1].split("%")[0])
    assert pct >= 95.0   # one prompt: a single near-tie moves it ~1.5 points; test_engine checks >= 99% on all


def test_bench_ffn_cache_runs_all_modes():
    result = run_cli("bench-ffn-cache", "--iters", "20", "--layer", "3")
    assert result.returncode == 0, result.stderr
    for mode in ("baseline", "cold cache", "warm cache", "rotating", "dense FFN"):
        assert mode in result.stdout
    assert run_cli("bench-ffn-cache", "--layer", "99").returncode != 0


def test_hitrates_table_and_json(tmp_path):
    full = json.loads((SCENARIOS_DIR / "hitrate_scenarios.json").read_text())
    small = {"scenarios": {}}
    for name, sets in full["scenarios"].items():
        small["scenarios"][name] = {kind: prompts[:2] for kind, prompts in sets.items()}
    path = tmp_path / "scenarios.json"
    path.write_text(json.dumps(small))
    out = tmp_path / "rates.json"
    result = run_cli("hitrates", "--scenarios", str(path), "--max-tokens", "8", "--json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert {"repeated", "paraphrase", "common_factual", "novel"} <= set(doc)
    assert doc["repeated"]["l1_hit_rate"] == 1.0              # an exact repeat hits every decode lookup
    assert doc["common_factual"]["l2_lookups"] > 0
    assert "repeated" in result.stdout and "seed L1" in result.stdout


def test_hitrates_refuses_a_malformed_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"scenarios": {"mystery": {}}}')
    result = run_cli("hitrates", "--scenarios", str(bad))
    assert result.returncode != 0 and "unknown scenario" in result.stderr


def test_app_without_a_display_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    result = subprocess.run([sys.executable, "-m", "larql_desktop"], capture_output=True, text=True, timeout=120,
                            env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert "no display" in result.stderr and "--self-test" in result.stderr


def test_insert_save_validate_apply_and_chat_with_the_patch(tmp_path):
    patch_file = tmp_path / "atlantis.vlp.json"
    result = run_cli("insert", "--entity", "Atlantis", "--relation", "capital-of", "--target", "Poseidon",
                     "--paraphrase", "The capital city of Atlantis is", "--paraphrase", "Atlantis is ruled from",
                     "--probe", "The capital of Atlantis is", "--ffn", "dense", "--save", str(patch_file),
                     "--show-probes")
    assert result.returncode == 0, result.stderr
    assert "probe after: 'The capital of Atlantis is Poseidon" in result.stdout
    probes = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert [row[0] for row in probes] == ["canonical", "paraphrase", "paraphrase", "chat"]
    assert probes[0][4:7] == ["no", "->", "yes"] and float(probes[0][3]) > float(probes[0][1])
    assert "control unchanged: yes" in result.stdout
    assert "[100.0%] Inserted" in result.stderr          # progress reaches the end
    doc = json.loads(patch_file.read_text())
    assert all(op["target"] == "Poseidon" and "target_token" in op for op in doc["operations"])

    validate = run_cli("patch", "validate", str(patch_file))
    assert validate.returncode == 0 and validate.stdout.startswith("valid: "), validate.stderr

    apply = run_cli("patch", "apply", str(patch_file), "--probe", "The capital of Atlantis is", "--ffn", "dense")
    assert apply.returncode == 0, apply.stderr
    lines = apply.stdout.splitlines()
    before = [line for line in lines if line.startswith("probe before: ")]
    after = [line for line in lines if line.startswith("probe after: ")]
    assert len(before) == len(after) == 1
    assert after[0].startswith("probe after: 'The capital of Atlantis is Poseidon")
    assert "Poseidon" not in before[0]

    chat = run_cli("chat", "--patch", str(patch_file), "--max-tokens", "24", "What is the capital of Atlantis?")
    assert chat.returncode == 0, chat.stderr
    assert "Poseidon" in chat.stdout
    plain = run_cli("chat", "--max-tokens", "24", "What is the capital of Atlantis?")
    assert "Poseidon" not in plain.stdout


def test_chat_refuses_a_bad_patch_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1}')
    result = run_cli("chat", "--patch", str(bad), "hi")
    assert result.returncode == 2 and "base_checksum" in result.stderr


def test_insert_eval_refuses_a_malformed_facts_file(tmp_path):
    bad = tmp_path / "facts.json"
    bad.write_text(json.dumps({"facts": [{"entity": "A"}]}))
    result = run_cli("insert-eval", "--facts", str(bad))
    assert result.returncode == 2 and "'relation' must be a non-empty string" in result.stderr
