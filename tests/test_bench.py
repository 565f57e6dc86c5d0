"""`larql-desktop bench`: run briefly as a user runs it (a subprocess, without llama.cpp) so it cannot rot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from larql_desktop.tools.bench import (APP_MODE, CPU_FEATURES, LARQL_MODES, LLAMA_MODE, format_report,
                                      machine_description, targets)

PER_MODE = ("prompt_tokens", "prefill_tok_s", "decode_tok_s", "ttft_submit_s", "ttft_process_s", "load_seconds",
            "peak_rss_mb", "rss_after_load_mb")


def run_cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "larql_desktop", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ), stdin=subprocess.DEVNULL)


def test_bench_writes_positive_figures_for_every_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--model", "smollm2", "--tokens", "4", "--runs", "2", "--prompt", "Say hi.",
                     "--no-llama-cpp", "--json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["model"] == "smollm2" and doc["threads"] == 2 and doc["tokens"] == 4 and doc["runs"] == 2
    assert doc["prompt_tokens"] > 0 and 0 < doc["top_k"] < doc["intermediate"]
    assert set(doc["modes"]) == set(LARQL_MODES)          # llama.cpp skipped on request
    for name, mode in doc["modes"].items():
        for key in PER_MODE:
            assert mode[key] > 0, (name, key, mode[key])
        assert mode["prompt_tokens"] == doc["prompt_tokens"]
        if name == APP_MODE:   # a chat stops at a stop token: at most the tokens asked for
            assert len(mode["runs"]) == 2 and all(1 <= r["decode_steps"] <= 3 for r in mode["runs"])
            assert 2 <= len(mode["tokens"]) <= 4
            continue
        assert len(mode["runs"]) == 2 and all(r["decode_steps"] == 3 for r in mode["runs"])
        assert len(mode["tokens"]) == 4
        # From process start includes the load; from submission does not.
        assert mode["ttft_process_s"] > mode["load_seconds"] > 0
        assert mode["peak_rss_mb"] >= mode["rss_after_load_mb"]
        assert "vs_llama_cpp" not in mode
    # The same greedy generation repeated: the warm runs are served by the cache, the cold ones never are.
    assert doc["modes"]["warm"]["cache"]["hit_rate"] == 1.0
    # Warm against dense in one process too, each warm run beside a dense one.
    paired_dense = doc["modes"]["warm"]["paired_dense"]
    assert len(paired_dense["warm_over_dense"]) == 2 and paired_dense["warm_over_dense_median"] > 0
    assert "warm vs dense, each warm run beside a dense one" in result.stdout
    assert doc["modes"]["cold"]["cache"]["hits"] == 0 and doc["modes"]["cold"]["cache"]["lookups"] > 0
    assert doc["modes"]["sparse"]["cache"]["lookups"] == 0
    assert doc["modes"]["warm"]["tokens"] == doc["modes"]["cold"]["tokens"] == doc["modes"]["sparse"]["tokens"]
    assert doc["modes"]["dense"]["greedy_agreement_vs_dense"] == 1.0
    # The real window (offscreen) decodes what the engine decodes, from cold caches each run, through its L3.
    app = doc["modes"][APP_MODE]
    assert app["identical_runs"]
    assert app["tokens"] == doc["modes"]["cold"]["tokens"][:len(app["tokens"])]
    assert app["cache"]["hits"] == 0 and app["cache"]["lookups"] > 0 and app["l3_status"]["errors"] == {}
    assert app["engine_decode_tok_s"] > 0 and app["cpu_ms_per_token"]["gui"] > 0
    assert "app_decode_within_10pct_of_cold" in doc["targets"]
    assert len(app["paired_cold"]["app_over_cold"]) == 2 and app["paired_cold"]["app_over_cold_median"] > 0
    assert len(app["engine_decode_tok_s_runs"]) == 2 and len(app["paired_cold"]["app_over_cold_l3"]) == 2
    # The untimed first round (one-time costs) is reported apart, and the GUI's CPU while a reply decodes.
    assert app["first_reply"]["decode_tok_s"] > 0 and app["first_reply"]["paired_cold_l3_decode_tok_s"] > 0
    assert 0 < app["cpu_ms_per_token"]["gui-decoding"]
    assert "app vs headless cold" in result.stdout
    # The whole-model graph and the per-layer graphs are the same computation.
    assert doc["modes"]["layered"]["tokens"] == doc["modes"]["dense"]["tokens"]
    assert "warm_decode_faster_than_dense" in doc["targets"]
    assert "warm_decode_faster_than_layered_dense" in doc["targets"]
    assert "decode tok/s" in result.stdout and "llama.cpp: not run" in result.stdout
    # Which machine: its CPU and the vector extensions that decide dense decode against llama.cpp.
    assert doc["machine"]["cpus"] == os.cpu_count() and doc["machine"]["cpu"]
    if sys.platform.startswith("linux"):
        assert set(doc["machine"]["cpu_features"]) <= set(CPU_FEATURES)
    assert f"machine: {doc['machine']['cpu']}, {os.cpu_count()} CPUs; vector extensions: " in result.stdout


def _cpuinfo(model: str, flags: str) -> str:
    return "".join(f"processor\t: {i}\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n\n" for i in range(2))


def test_machine_description_names_the_cpu_and_its_vector_extensions(tmp_path):
    xeon = tmp_path / "xeon"
    xeon.write_text(_cpuinfo("Intel(R) Xeon(R) Platinum 8480+", "fpu sse2 avx2 fma avx512f avx512bw avx512_vnni "
                                                                "avx512_bf16 amx_bf16 amx_tile amx_int8"))
    machine = machine_description(xeon)
    assert machine["cpu"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert machine["cpu_features"] == ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"]
    epyc = tmp_path / "epyc"
    epyc.write_text(_cpuinfo("AMD EPYC", "fpu sse2 avx avx2 fma"))
    assert machine_description(epyc)["cpu_features"] == ["avx2"]
    assert machine_description(tmp_path / "missing")["cpu_features"] is None   # not Linux: not known
    assert machine_description(xeon)["cpus"] == os.cpu_count()


@pytest.mark.parametrize("args, message", [
    (("--tokens", "1"), "--tokens must be at least 2"),
    (("--modes", "dense,turbo"), "unknown mode"),
    (("--runs", "0"), "--runs must be at least 1"),
])
def test_bench_refuses_bad_settings(args, message):
    result = run_cli("bench", "--no-llama-cpp", *args)
    assert result.returncode == 2
    assert message in result.stderr


def _mode(decode, prefill, ttft, start, rss):
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "ttft_submit_s": ttft, "ttft_process_s": start,
            "peak_rss_mb": rss, "load_seconds": 1.0, "tokens": [1, 2]}


def test_targets_and_ratio_table_with_llama_cpp_figures():
    # Synthetic figures: how the report reads a run that included llama.cpp.
    doc = {"model": "smollm2", "arch": "llama", "threads": 2, "runs": 3, "tokens": 8, "prompt_tokens": 20,
           "top_k": 1213, "intermediate": 1536,
           "modes": {"dense": _mode(90.0, 500.0, 0.2, 2.0, 300.0), "warm": _mode(120.0, 400.0, 0.3, 2.5, 320.0),
                     LLAMA_MODE: _mode(100.0, 1000.0, 0.1, 1.0, 200.0)}}
    for name, m in doc["modes"].items():
        if name != LLAMA_MODE:
            ref = doc["modes"][LLAMA_MODE]
            m["vs_llama_cpp"] = {"decode": m["decode_tok_s"] / ref["decode_tok_s"], "prefill": 0.5,
                                 "ttft_submit": 2.0, "ttft_process": 2.0, "peak_rss": 1.5}
    doc["targets"] = targets(doc)
    assert doc["targets"] == {"dense_decode_ge_0.75x_llama_cpp": True, "dense_peak_rss_le_1.3x_llama_cpp": False,
                              "warm_decode_faster_than_dense": True, "dense_ttft_submit_le_1.5s": True,
                              "dense_ttft_process_le_1.5s": False, "warm_decode_ge_1.2x_dense": True}
    # Issue 17's: the app against headless cold, the walk with the cache off against layered dense.
    app_doc = {"modes": {"cold": _mode(100.0, 500.0, 0.2, 2.0, 300.0), "app": _mode(89.0, 400.0, 0.3, 2.5, 320.0),
                         "sparse": _mode(80.0, 400.0, 0.3, 2.5, 320.0),
                         "layered": _mode(100.0, 400.0, 0.3, 2.5, 320.0)}}
    assert targets(app_doc) == {"app_decode_within_10pct_of_cold": False, "walk_cache_off_ge_0.8x_layered": True}
    # With the app's paired neighbours, the one with the app's own settings (its L3 too) decides.
    app_doc["modes"]["app"]["paired_cold"] = {"app_over_cold_median": 0.85, "app_over_cold_l3_median": 0.93}
    assert targets(app_doc)["app_decode_within_10pct_of_cold"] is True
    app_doc["modes"]["app"]["paired_cold"] = {"app_over_cold_median": 0.95, "app_over_cold_l3_median": 0.88}
    assert targets(app_doc)["app_decode_within_10pct_of_cold"] is False
    # With the warm mode's paired dense neighbours, their ratio decides rather than the two modes' rows.
    doc["modes"]["warm"]["paired_dense"] = {"warm_over_dense": [1.1, 1.15], "warm_over_dense_median": 1.125}
    assert targets(doc)["warm_decode_ge_1.2x_dense"] is False
    # Gemma 3 270M's dense target is 0.95x llama.cpp: the same 0.9x misses it.
    gemma = dict(doc, model="gemma3-270m", arch="gemma3")
    assert targets(gemma)["dense_decode_ge_0.95x_llama_cpp"] is False
    assert "dense_decode_ge_0.75x_llama_cpp" not in targets(gemma)
    doc["machine"] = {"cpu": "AMD EPYC", "cpus": 2, "cpu_features": []}
    text = "\n".join(format_report(doc))
    assert "machine: AMD EPYC, 2 CPUs; vector extensions: none of avx2, avx512f" in text
    assert "warm vs dense, each warm run beside a dense one in its process: 1.12x median (1.10, 1.15)" in text
    assert "ratios vs llama.cpp" in text and " 0.90x" in text
    assert "target dense_ttft_process_le_1.5s: NOT met" in text
