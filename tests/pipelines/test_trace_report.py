"""`freescale trace`: the step split by phase and thread, on a hand-made trace whose answer is known."""

from __future__ import annotations

import gzip
import json

import pytest

from pipelines.commands.trace_report import report


def _x(name, cat, tid, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": ts, "dur": dur}


def _trace(tmp_path, compress=False):
    events = [
        _x("ProfilerStep#1", "user_annotation", 1, 0, 1000),
        _x("freescale/forward", "user_annotation", 1, 0, 600),
        _x("freescale/backward", "user_annotation", 1, 600, 300),
        _x("aten::linear", "cpu_op", 1, 0, 100),
        _x("aten::addmm", "cpu_op", 1, 50, 30),  # inside the one above: not top-level, not counted twice
        _x("aten::add", "cpu_op", 1, 200, 100),
        _x("AddmmBackward0", "cpu_op", 2, 600, 200),  # autograd's thread, in the backward
        _x("cudaLaunchKernel", "cuda_runtime", 3, 100, 60),  # another thread's CUDA call, in the forward
        _x("gemm", "kernel", 7, 0, 300),
        _x("gemm", "kernel", 7, 250, 250),  # overlaps the one before: the GPU was busy 500 us, not 550
        {"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "python"}},
    ]
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
    assert r["steps"] == 1 and r["training_thread"] == "1" and r["gpu_busy_ms"] == pytest.approx(0.5)
    forward, backward, other = r["phases"]["forward"], r["phases"]["backward"], r["phases"]["other"]
    assert forward["wall_ms"] == pytest.approx(0.6) and forward["between_ops_ms"] == pytest.approx(0.4)
    assert forward["threads"]["1"] == {"ops_ms": pytest.approx(0.2), "ops": 2, "cuda_runtime_ms": 0.0}
    assert forward["threads"]["3"]["cuda_runtime_ms"] == pytest.approx(0.06)
    assert backward["threads"] == {"2": {"ops_ms": pytest.approx(0.2), "ops": 1, "cuda_runtime_ms": 0.0}}
    assert backward["between_ops_ms"] == pytest.approx(0.3)  # the training thread only waits in backward()
    assert other["wall_ms"] == pytest.approx(0.1) and "data" not in r["phases"]


def test_not_a_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="notes.json: not a Chrome trace"):
        report(bad)
    empty = tmp_path / "empty.json"
    empty.write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="empty.json: no profiled steps"):
        report(empty)
