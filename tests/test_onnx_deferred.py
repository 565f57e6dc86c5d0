"""`onnx` only builds graphs: a process that loads a model whose graphs are exported, and decodes with it, never
imports it (11 MB of resident memory and ~0.1 s of every start). The graphs made at every load are kept
serialised instead; they are what `onnx` builds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from onnx import TensorProto, helper

from larql_desktop.engine.graphs import onnx_deferred
from larql_desktop.engine.graphs.store import make_model


def test_the_kept_graphs_are_the_ones_onnx_builds():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    start = make_model([helper.make_node("Identity", ["x"], ["y"])], [], [x], [y], "start")
    softmax = make_model([helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)], [],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N"])],
                         [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N"])], "softmax")
    assert onnx_deferred.START_MODEL == start.SerializeToString()
    assert onnx_deferred.SOFTMAX_MODEL == softmax.SerializeToString()
    assert onnx_deferred.FLOAT == TensorProto.FLOAT
    # The deferred names read through to the package.
    assert onnx_deferred.TensorProto.INT64 == TensorProto.INT64
    assert onnx_deferred.helper.make_node is helper.make_node


_WORKLOAD = """
import json, sys
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.graphs.store import share_thread_pool
from larql_desktop.engine.loading import load_model
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.paths import AppPaths
from larql_desktop.engine.cache.walk import WalkSettings

share_thread_pool(2)
model = load_model("smollm2", AppPaths.from_environment().ensure(), threads=2)
replies = {}
for name, walk in (("walk", WalkSettings()), ("dense", WalkSettings(dense=True))):
    session = LarqlEngine(model, walk=walk).new_session()
    steps = list(session.reply("Name a colour.", SamplingSettings(max_tokens=4)))
    # The token view's alternatives: the softmax graph's probabilities.
    replies[name] = [sum(a.probability for a in step.alternatives) for step in steps]
print(json.dumps({"onnx": "onnx" in sys.modules, "replies": replies}))
"""


def _run_workload() -> dict:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _WORKLOAD], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_load_and_replies_on_exported_graphs_do_not_import_onnx(smollm2):
    _run_workload()                # exports whatever graph these replies use and this test session has not
    second = _run_workload()
    assert second["onnx"] is False
    for name, sums in second["replies"].items():
        # Each step's top alternatives: probabilities from the kept softmax graph, at most 1 together.
        assert 1 <= len(sums) <= 4 and all(0.0 < s <= 1.0 + 1e-5 for s in sums), (name, sums)
