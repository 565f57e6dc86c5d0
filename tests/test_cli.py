"""The command line, run as a user runs it: a subprocess on the real models."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REFERENCE_FILE, SCENARIOS_DIR
from larql_desktop import __version__
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.generation import SamplingSettings
from model_files import gguf_path


def run_cli(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "larql_desktop", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def engine_reply(model, prompt: str, settings: SamplingSettings, walk: WalkSettings = WalkSettings(dense=True)) -> str:
    """The reply the engine gives in process: what the command line must print (the same host's kernels, so
    the same tokens; no wording is assumed)."""
    engine = LarqlEngine(model, walk=walk)
    return "".join(step.text for step in engine.new_session().reply(prompt, settings))


def test_chat_prints_reply_and_decode_speed(smollm2):
    result = run_cli("chat", "Name three primary colors.", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    reply = engine_reply(smollm2, "Name three primary colors.", SamplingSettings(max_tokens=24))
    assert reply.strip() and result.stdout == reply + "\n"
    assert "tok/s" in result.stderr and "decode: " in result.stderr


def test_version_and_self_test():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout == f"larql-desktop {__version__}\n", version.stderr
    check = run_cli("--self-test", env={"QT_QPA_PLATFORM": "offscreen"})
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip().splitlines()[-1] == "self-test passed"
    assert "platform and pyqtgraph work" in check.stdout


def test_chat_sampling_options_are_seeded_and_match_the_engine(smollm2):
    """--temperature/--top-p/--seed sample; --top-k is the walk's K: the same seed prints the same reply, and
    the engine in process, given the same settings, says the same."""
    top_k = smollm2.config.intermediate // 2
    args = ("chat", "--temperature", "0.9", "--top-p", "0.95", "--seed", "11", "--ffn", "walk",
            "--top-k", str(top_k), "--max-tokens", "12", "Tell me a story.")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.strip() and first.stdout == second.stdout
    assert "decode lookups" in first.stderr
    settings = SamplingSettings(max_tokens=12, temperature=0.9, top_p=0.95, seed=11)
    assert first.stdout == engine_reply(smollm2, "Tell me a story.", settings, WalkSettings(top_k=top_k)) + "\n"


def _resave_gguf(src: Path, dst: Path, name: str) -> None:
    """A copy of `src` written by llama.cpp's own gguf package, with another general.name: the same weights in
    a file the app has never seen (another checksum, so its graphs are exported afresh)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = name if field.name == "general.name" else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    if "general.name" not in reader.fields:
        writer.add_name(name)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()


def test_model_path_to_another_gguf_loads_chats_and_exports_its_graphs(smollm2, tmp_path):
    resaved = tmp_path / "resaved-smol.gguf"
    _resave_gguf(gguf_path("smollm2"), resaved, "resaved-smol")
    assert resaved.read_bytes() != gguf_path("smollm2").read_bytes()
    home = tmp_path / "home"                       # its own home: the session's exported graphs stay untouched
    prompt = "Name three primary colors."
    result = run_cli("chat", "--model", str(resaved), "--max-tokens", "12", prompt, env={"LARQL_DESKTOP_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert "loaded resaved-smol " in result.stderr
    # The same weights: the same reply as the packaged model's, token for token.
    assert result.stdout == engine_reply(smollm2, prompt, SamplingSettings(max_tokens=12)) + "\n"
    graphs = {p.name for p in home.rglob("*.onnx")}
    n = smollm2.config.n_layers
    assert {f"layer{i:02d}.walk.onnx" for i in range(n)} <= graphs and {f"layer{i:02d}.gate.onnx" for i in range(n)} <= graphs
    assert smollm2.checksum not in {p.parent.name for p in home.rglob("*.onnx")}


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


def test_bench_batch_prints_each_decoders_speed_by_rows():
    result = run_cli("bench-batch", "--rows", "1,3", "--steps", "2", "--context", "16")
    assert result.returncode == 0, result.stderr
    table = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] in ("dense", "walked"):
            table[parts[0], int(parts[1])] = (float(parts[2]), float(parts[3]), float(parts[4].rstrip("x")))
    assert sorted(table) == [("dense", 1), ("dense", 3), ("walked", 1), ("walked", 3)]
    for (decoder, rows), (ms, rate, vs_one) in table.items():
        assert ms > 0 and abs(rate - rows * 1000 / ms) <= 0.06 * rate + 0.1     # printed rounded
        one_ms = table[decoder, 1][0]
        assert abs(vs_one - (rows / ms) / (1 / one_ms)) <= 0.02 + 0.02 * vs_one
    assert table["walked", 1][2] == 1.0
    for bad in (("--rows", "0"), ("--rows", "two"), ("--context", "0")):
        failed = run_cli("bench-batch", *bad, "--steps", "1")
        assert failed.returncode != 0 and "error" in failed.stderr and "Traceback" not in failed.stderr


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
    # The chat question is asked fresh and once more after an earlier same-relation turn (the conversation row).
    assert [row[0] for row in probes] == ["canonical", "paraphrase", "paraphrase", "chat", "conversation"]
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
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() and "Poseidon" not in plain.stdout


def test_insert_at_a_chosen_layer_and_alpha(smollm2, tmp_path):
    layer = smollm2.config.n_layers // 3
    patch_file = tmp_path / "pinned.vlp.json"
    result = run_cli("insert", "--entity", "Atlantis", "--relation", "capital-of", "--target", "Poseidon",
                     "--probe", "The capital of Atlantis is", "--ffn", "dense", "--layer", str(layer),
                     "--alpha", "0.25", "--save", str(patch_file))
    assert result.returncode == 0, result.stderr
    inserted = next(line for line in result.stdout.splitlines() if line.startswith("inserted "))
    assert f": layer {layer} feature " in inserted          # the pinned layer is installed first
    doc = json.loads(patch_file.read_text())
    assert layer in {op["layer"] for op in doc["operations"]}
    beyond = run_cli("insert", "--entity", "A", "--relation", "r", "--target", "t", "--probe", "p",
                     "--layer", str(smollm2.config.n_layers))
    assert beyond.returncode == 2 and f"layer must be within 0..{smollm2.config.n_layers - 1}" in beyond.stderr


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
