"""benchmarks.gpu_trace on a hand-made chrome trace: the spans without a kernel, the host operators around the
launch of the kernel that ended each, and those the host spent the span in."""

from benchmarks.gpu_trace import activity, describe_gap


def _kernel(name, ts, dur, correlation):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7, "correlation": correlation}}


def _launch(ts, correlation, tid=1):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
            "args": {"correlation": correlation}}  # fmt: skip


def _op(name, ts, dur, tid=1):
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}


def test_idle_gaps_are_the_spans_without_a_kernel_with_the_host_ops_that_launched_the_next():
    events = [
        _kernel("a", 0, 100, 1),
        _kernel("b", 50, 100, 2),  # overlaps a: no gap until 150
        _kernel("c", 400, 10, 3),  # 250 us idle
        _kernel("d", 420, 10, 4),  # 10 us idle
        _launch(5, 1),
        _launch(10, 2),
        _launch(380, 3),
        _launch(415, 4),
        _op("step", 0, 500),
        _op("aten::copy_", 200, 190),  # the host copied before it launched c
        _op("my_kernel_op", 379, 5),
        _op("elsewhere", 370, 20, tid=2),  # another thread: not the launch's
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 160, "dur": 5, "args": {"stream": 7}},
    ]
    act = activity(events)
    assert [k["name"] for k in act.kernels] == ["a", "b", "c", "d"] and len(act.memcpys) == 1
    gaps = act.idle_gaps(top=1)
    assert gaps[0].pop("busy") == ["aten::copy_ 0.19 ms", "step 0.50 ms"]  # through half the 230 us before c's launch
    assert gaps == [{"ms": 0.25, "kernel": "c", "host": ["step", "aten::copy_", "my_kernel_op"]}]
    assert [g["kernel"] for g in act.idle_gaps(top=5)] == ["c", "d"]
    assert act.idle_ms() == 0.26


def test_a_kernel_whose_launch_is_not_in_the_trace_has_no_host_ops():
    act = activity([_kernel("a", 0, 10, 1), _kernel("b", 30, 10, 2)])
    assert act.idle_gaps() == [{"ms": 0.02, "kernel": "b", "host": [], "busy": []}]


def test_a_gap_reads_as_one_line_with_the_outer_and_inner_host_ops():
    ops = ["step", "forward", "layer", "attention", "launch", "copy"]
    line = describe_gap({"ms": 1.5, "kernel": "k", "host": ops})
    assert line == " 1.500 ms idle before k; host: step > forward > ... > attention > launch > copy"
    assert describe_gap({"ms": 0.25, "kernel": "k", "host": []}).endswith("host: ")
    busy = describe_gap({"ms": 0.25, "kernel": "k", "host": [], "busy": ["aten::copy_ 0.19 ms"]})
    assert busy.endswith("host: ; host busy in: aten::copy_ 0.19 ms")
