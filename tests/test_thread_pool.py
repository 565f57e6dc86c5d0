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
from polling import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread ids from /proc (Linux)")


def _scheduled(tid: int) -> int:
    """How often the thread was scheduled off a CPU (it ran, then blocked or was preempted) plus its CPU clock
    ticks: grows whenever the thread runs at all, however little CPU a busy machine gives its niceness."""
    status = dict(line.split(":", 1) for line in open(f"/proc/self/task/{tid}/status").read().splitlines() if ":" in line)
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(status["voluntary_ctxt_switches"]) + int(status["nonvoluntary_ctxt_switches"])
            + int(fields[11]) + int(fields[12]))


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
    before = _scheduled(workers[0])
    x = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    for _ in range(80):
        out, = session.run(None, {"a": x})
    np.testing.assert_allclose(out, x @ x, rtol=1e-3, atol=1e-2)
    # It ran (a count, not a duration: at its niceness it may get little of a busy machine, but never nothing);
    # once it blocks again after the last run it has been switched out at least once.
    assert wait_for(lambda: _scheduled(workers[0]) > before, within=30)


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
