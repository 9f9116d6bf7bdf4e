"""`freescale trace`: the step split by phase and thread, on a hand-made trace whose answer is known."""

from __future__ import annotations

import gzip
import json

import pytest

from pipelines.cli.trace_report import report


def _x(name, cat, tid, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": ts, "dur": dur}


def _step(o):
    """One profiled step starting at ``o`` us; every step of the trace is the same, so per-step figures are
    those of one."""
    return [
        _x("ProfilerStep#1", "user_annotation", 1, o, 1000),
        _x("freescale/data", "user_annotation", 1, o, 50),
        _x("freescale/forward", "user_annotation", 1, o + 100, 500),  # 50-100: in no phase, so "other"
        _x("freescale/backward", "user_annotation", 1, o + 600, 300),
        _x("aten::linear", "cpu_op", 1, o + 100, 100),
        _x("aten::addmm", "cpu_op", 1, o + 150, 30),  # inside the one above: not top-level, not counted twice
        _x("aten::add", "cpu_op", 1, o + 300, 100),
        _x("AddmmBackward0", "cpu_op", 2, o + 600, 200),  # autograd's thread, in the backward
        _x("cudaLaunchKernel", "cuda_runtime", 3, o + 200, 60),  # another thread's CUDA call, in the forward
        _x("aten::copy_", "cpu_op", 4, o + 550, 100),  # across forward and backward: time split, counted once
        _x("gemm", "kernel", 7, o, 300),
        _x("gemm", "kernel", 7, o + 250, 250),  # overlaps the one before: the GPU was busy 500 us, not 550
    ]


def _trace(tmp_path, compress=False):
    events = (
        _step(0)
        + _step(2000)
        + [
            _x("cudaMalloc", "cuda_runtime", 3, 5000, 900),  # outside every profiled step: not per step
            {"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "python"}},
        ]
    )
    path = tmp_path / ("t.json.gz" if compress else "t.json")
    text = json.dumps({"traceEvents": events})
    if compress:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("compress", [False, True])
def test_phases_threads_and_gpu_time(tmp_path, compress):
    r = report(_trace(tmp_path, compress))
    assert r["steps"] == 2 and r["step_ms"] == [1.0, 1.0] and r["training_thread"] == "1"
    assert r["gpu_busy_ms"] == pytest.approx(0.5)
    p = r["phases"]
    assert p["data"] == {"wall_ms": pytest.approx(0.05), "between_ops_ms": pytest.approx(0.05), "threads": {}}
    forward, backward = p["forward"], p["backward"]
    assert forward["wall_ms"] == pytest.approx(0.5) and forward["between_ops_ms"] == pytest.approx(0.3)
    assert forward["threads"]["1"] == {"ops_ms": pytest.approx(0.2), "ops": 2, "cuda_runtime_ms": 0.0}
    assert forward["threads"]["3"]["cuda_runtime_ms"] == pytest.approx(0.06)
    assert forward["threads"]["4"] == {"ops_ms": pytest.approx(0.05), "ops": 1, "cuda_runtime_ms": 0.0}
    assert backward["threads"]["2"] == {"ops_ms": pytest.approx(0.2), "ops": 1, "cuda_runtime_ms": 0.0}
    assert backward["threads"]["4"] == {"ops_ms": pytest.approx(0.05), "ops": 0, "cuda_runtime_ms": 0.0}
    assert backward["between_ops_ms"] == pytest.approx(0.3)  # the training thread only waits in backward()
    assert p["other"]["wall_ms"] == pytest.approx(0.15) and "dense_allreduce" not in p
    assert r["cuda_runtime_top"]["3"] == {"cudaLaunchKernel": pytest.approx(0.06)}


def test_not_a_trace_is_a_clear_error(tmp_path):
    for name, text, match in [
        ("notes.json", '{"hello": 1}', "notes.json: not a Chrome trace"),
        ("array.json", "[1, 2]", "array.json: not a Chrome trace"),
        ("empty.json", '{"traceEvents": []}', "empty.json: no profiled steps"),
    ]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            report(tmp_path / name)
