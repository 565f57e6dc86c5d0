"""onnxruntime's shared pool (issue 17): its worker threads run at a lower priority, so their spinning between
kernels yields a core to the app's GUI thread and the engine thread's Python instead of competing with them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from larql_desktop.engine.graphs import store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread ids from /proc (Linux)")


def _cpu_seconds(tid: int) -> float:
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_pool_worker_is_known_runs_lowered_and_computes():
    workers = store.shared_pool_workers()     # conftest shared a pool of 2 threads: the caller and one worker
    assert len(workers) == 1
    assert all(os.path.isdir(f"/proc/self/task/{tid}") for tid in workers)
    assert [os.getpriority(os.PRIO_PROCESS, tid) for tid in workers] == [store.POOL_WORKER_NICE]
    assert os.getpriority(os.PRIO_PROCESS, 0) < store.POOL_WORKER_NICE   # the calling threads keep theirs
    # The thread found is the pool's: a session on the shared pool gives it work.
    a = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [512, 512])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [512, 512])
    model = store.make_model([helper.make_node("MatMul", ["a", "a"], ["y"])], [], [a], [y], "mm")
    session = ort.InferenceSession(model.SerializeToString(), store.session_options(2), providers=store.PROVIDERS)
    before = _cpu_seconds(workers[0])
    x = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    for _ in range(80):
        out, = session.run(None, {"a": x})
    np.testing.assert_allclose(out, x @ x, rtol=1e-3, atol=1e-2)
    # More than idling costs (at its niceness it may get little of a busy machine, but never nothing).
    assert _cpu_seconds(workers[0]) > before


def test_pool_sizes_and_niceness_in_a_fresh_process():
    code = textwrap.dedent("""
        import os, json
        from larql_desktop.engine.graphs import store
        first = store.share_thread_pool(3, worker_nice=5)
        workers = store.shared_pool_workers()
        print(json.dumps({"first": first, "again": store.share_thread_pool(3), "other": store.share_thread_pool(2),
                          "nice": [os.getpriority(os.PRIO_PROCESS, t) for t in workers]}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc == {"first": True, "again": True, "other": False, "nice": [5, 5]}
