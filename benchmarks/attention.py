"""`python -m benchmarks attention`: forward + backward of every jagged attention kernel against the padded one.

Per case (``--cases B:cap,...``; default on CUDA (64, 4,096), (128, 8,000), (128, 21,000), small ones on CPU), a
batch of B causal self-attentions with KuaiRand-like UIH lengths (lognormal, median 3,400, mean 5,000 before the
cap, as ``python -m benchmarks kernels`` draws them), ``--heads`` heads of ``--head-dim``, bf16 on CUDA (fp32 on CPU).
The kernels (kernels.impl.Impl), each over the packed tokens [N, heads, dim]:

    varlen      PyTorch's varlen FlashAttention over int32 device offsets (CUDA; needs no plan)
    flex        FlexAttention with the block mask built from the offsets (CUDA; needs a plan: built before the
                timing, as the loader builds it, see the plan row)
    torch       one fused SDPA per sample (the CPU path and the twin the others are checked against)
    padded      every sample padded to the batch's longest and one causal SDPA over [B, heads, L, dim] (fused
                kernels, no mask), padding and unpadding included: what the padded model runs
    *-det       the same kernel with ``torch.use_deterministic_algorithms(True)`` (the ``--deterministic`` mode)

Each is timed as the median of ``--reps`` forward+backward calls after ``--warmup`` (the first compiles
FlexAttention), between device synchronisations. ``tflops`` counts, for every kernel alike, only the pairs a
causal jagged computation needs (sum over samples of L(L+1)/2, per head) at 4 * head_dim flops per pair forward
and 2.5 times that backward (FlashAttention's accounting). ``max_rel_err``: the largest absolute difference of a
kernel's output from the padded one over the padded output's largest magnitude. ``repro``: whether two backward
passes of the same inputs gave the same dq, dk and dv bit for bit.

More rows: ``target`` (``--target-case B:cap:C``, default 128:21000:8), C candidates per sample attending over
their sample's UIH (cross attention, no causality); ``equal`` (``--equal B:L``, default 16:4096), equal lengths
against SDPA on [B, heads, L, dim] directly (what is left is a kernel's own efficiency); ``model``
(``--model-case``, CUDA): one forward+backward of the replay's softmax model (d=256, 2 layers, 4 heads, bf16
autocast) on one B x cap batch, varlen against flex (its plan built before the timing); and ``plan``, the host
cost of the softmax model's attention plan (pipelines.models.softmax.attention_plan) per batch at ``--plan-case``.
The targets printed at the end are the gates of BENCHMARKS.md's attention table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.kernels import uih_lengths
from kernels.attention import NEEDS_BLOCK_MASK, PackedOffsets, jagged_attention
from kernels.flex.block_mask import build_block_mask
from kernels.impl import Impl

GPU_CASES = "64:4096,128:8000,128:21000"
CPU_CASES = "4:256,8:512"
GPU_KERNELS = ("padded", "flex", "varlen", "flex-det", "varlen-det")
CPU_KERNELS = ("padded", "torch")
# The gates (BENCHMARKS.md): causal at the largest case, equal lengths, target attention, the model step.
CAUSAL_GATE = 7.0  # varlen over padded, causal B=128 cap 21,000
EQUAL_GATE = 0.65  # varlen's TFLOP/s over dense SDPA's
TARGET_GATE = 3.0  # varlen over flex, target attention
MODEL_GATE = 0.70  # varlen's model step over flex's


@dataclass
class Record:
    backend: str  # a kernel (varlen, flex, torch, padded, *-det) | sdpa (equal lengths) | plan (host build)
    case: str  # lognormal | target | equal | model | plan
    batch_size: int
    cap: int
    tokens: int
    fwd_bwd_ms: float
    speedup_vs_padded: Optional[
        float
    ]  # over this case's baseline: padded (lognormal, target), sdpa (equal), flex (model)
    tflops: Optional[float]
    max_rel_err: Optional[float]
    needs_plan: Optional[bool]
    repro: Optional[bool]
    device: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated B:cap (default {GPU_CASES} on CUDA, {CPU_CASES} on CPU; 'none' skips them)",
    )
    parser.add_argument(
        "--kernels",
        default=None,
        help=f"comma-separated (default {','.join(GPU_KERNELS)} on CUDA, {','.join(CPU_KERNELS)} on CPU)",
    )
    parser.add_argument(
        "--target-case",
        default=None,
        help="B:cap:C of the target attention case (default 128:21000:8 on CUDA, 4:64:3 on CPU; 'none' skips it)",
    )
    parser.add_argument(
        "--equal",
        default=None,
        help="B:L of the equal-lengths case against SDPA (default 16:4096 on CUDA, 4:256 on CPU; 'none' skips it)",
    )
    parser.add_argument("--model-case", default="128:21000", help="B:cap of the model step row (CUDA; 'none' skips it)")
    parser.add_argument(
        "--plan-case", default="128:21000", help="B:cap of the attention plan's host cost ('none' skips it)"
    )
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--uih-median", type=float, default=3400.0)
    parser.add_argument("--uih-mean", type=float, default=5000.0, help="mean UIH length before the cap")
    parser.add_argument("--reps", type=int, default=10, help="timed forward+backward calls per kernel")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (the first compiles FlexAttention)")
    parser.add_argument("--plan-reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the records (and the set-up) as JSON")


def _pairs(lengths: np.ndarray) -> float:
    return float(np.sum(lengths.astype(np.float64) * (lengths + 1) / 2))


def _tflops(lengths: np.ndarray, heads: int, head_dim: int, ms: float) -> float:
    return 3.5 * 4 * head_dim * heads * _pairs(lengths) / (ms * 1e-3) / 1e12


def _parse(spec: str, flag: str, arity: int = 2) -> list[tuple[int, ...]]:
    shape = ":".join("BLC"[:arity]) if arity != 2 else "B:cap"
    try:
        out = [tuple(int(x) for x in part.split(":")) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated {shape}, got {spec!r}") from None
    if not out or any(len(c) != arity or min(c) < 1 for c in out):
        raise ValueError(f"{flag} must be comma-separated {shape} of positive integers, got {spec!r}")
    return out


def _kernel(name: str) -> tuple[Impl, bool]:
    """A kernel name of ``--kernels`` -> its implementation and whether it runs in the deterministic mode."""
    base, det = (name[:-4], True) if name.endswith("-det") else (name, False)
    try:
        return Impl(base), det
    except ValueError:
        raise ValueError(
            f"unknown kernel {name!r} in --kernels; expected one of "
            f"{[i.value for i in Impl]}, each optionally with -det"
        ) from None


@contextlib.contextmanager
def _deterministic(enabled: bool):
    """Torch's deterministic algorithms for the block (restored after); the kernels timed here use no cuBLAS."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled or before)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _time_ms(device: torch.device, fn: Callable[[], None], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(rows_q: int, rows_kv: int, heads: int, head_dim: int, device, dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda n: torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()  # noqa: E731
    q, k, v = make(rows_q), make(rows_kv), make(rows_kv)
    grad = torch.randn(rows_q, heads, head_dim, device=device, dtype=dtype, generator=gen)
    return q, k, v, grad


def _fwd_bwd(call: Callable[[], torch.Tensor], grad: torch.Tensor, tensors) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        for t in tensors:
            t.grad = None
        out = call()
        out.backward(grad)
        return out

    return run


def _repro(run: Callable[[], torch.Tensor], tensors) -> bool:
    """Two backward passes of the same inputs: the same gradients bit for bit."""
    run()
    first = [t.grad.clone() for t in tensors]
    run()
    return all(torch.equal(a, t.grad) for a, t in zip(first, tensors))


def _max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _kernel_rows(
    args,
    case: str,
    lengths: np.ndarray,
    kernels: list[str],
    call_for,
    against: Callable[[], torch.Tensor],
    grad,
    tensors,
    b: int,
    cap: int,
    tokens: int,
    device: torch.device,
) -> list[Record]:
    """Times every kernel of ``kernels`` on one case; ``call_for(impl)`` gives that kernel's forward. The first
    kernel is the baseline of the speedups."""
    with torch.no_grad():
        ref = against().float()
    records = []
    for name in kernels:
        impl, det = _kernel(name)
        forward = call_for(impl)
        run = _fwd_bwd(forward, grad, tensors)
        try:
            with _deterministic(det):
                with torch.no_grad():
                    err = _max_rel_err(forward().float(), ref)
                ms = _time_ms(device, run, args.reps, args.warmup)
                repro = _repro(run, tensors)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # one kernel's failure is a row, not the end of the run
            for t in tensors:
                t.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{case} {name} B={b} cap {cap}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
            continue
        base = records[0].fwd_bwd_ms if records else ms
        records.append(
            Record(
                name,
                case,
                b,
                cap,
                tokens,
                ms,
                base / ms,
                _tflops(lengths, args.heads, args.head_dim, ms) if case != "target" else None,
                err,
                impl in NEEDS_BLOCK_MASK,
                repro,
                str(device),
            )
        )
    return records


def bench_case(args, b: int, cap: int, device: torch.device, dtype, kernels: list[str]) -> list[Record]:
    rng = np.random.default_rng(args.seed + b * 100_003 + cap)
    lengths = uih_lengths(rng, b, args.uih_median, args.uih_mean, cap)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    n = int(offsets[-1])
    q, k, v, grad = _inputs(n, n, args.heads, args.head_dim, device, dtype, args.seed)
    packed = PackedOffsets.from_host(offsets, device if device.type == "cuda" else None)
    mask = build_block_mask(offsets, causal=True).to(device) if device.type == "cuda" else None

    def call_for(impl):
        return lambda: jagged_attention(
            q, k, v, packed, causal=True, impl=impl, block_mask=mask if impl is Impl.FLEX else None
        )

    padded = call_for(Impl.PADDED)
    return _kernel_rows(args, "lognormal", lengths, kernels, call_for, padded, grad, (q, k, v), b, cap, n, device)


def bench_target(args, b: int, cap: int, c: int, device: torch.device, dtype, kernels: list[str]) -> list[Record]:
    """``c`` candidates per sample, each attending over its sample's UIH (the softmax model's target attention)."""
    rng = np.random.default_rng(args.seed + 11)
    lengths = uih_lengths(rng, b, args.uih_median, args.uih_mean, cap)
    kv_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    q_offsets = torch.arange(b + 1, dtype=torch.int64) * c
    n = int(kv_offsets[-1])
    q, k, v, grad = _inputs(b * c, n, args.heads, args.head_dim, device, dtype, args.seed)
    on = device if device.type == "cuda" else None
    qp, kp = PackedOffsets.from_host(q_offsets, on), PackedOffsets.from_host(kv_offsets, on)
    mask = build_block_mask(q_offsets, kv_offsets, causal=False).to(device) if device.type == "cuda" else None

    def call_for(impl):
        return lambda: jagged_attention(
            q, k, v, qp, kp, causal=False, impl=impl, block_mask=mask if impl is Impl.FLEX else None
        )

    records = _kernel_rows(
        args, "target", lengths, kernels, call_for, call_for(Impl.PADDED), grad, (q, k, v), b, cap, n, device
    )
    return records


def bench_equal(args, b: int, length: int, device: torch.device, dtype, kernels: list[str]) -> list[Record]:
    lengths = np.full(b, length, dtype=np.int64)
    offsets = torch.arange(b + 1, dtype=torch.int64) * length
    n = b * length
    q, k, v, grad = _inputs(n, n, args.heads, args.head_dim, device, dtype, args.seed)
    packed = PackedOffsets.from_host(offsets, device if device.type == "cuda" else None)
    mask = build_block_mask(offsets, causal=True).to(device) if device.type == "cuda" else None
    as_batch = lambda t: t.view(b, length, args.heads, args.head_dim).transpose(1, 2)  # noqa: E731
    sdpa = lambda: (
        F.scaled_dot_product_attention(as_batch(q), as_batch(k), as_batch(v), is_causal=True)  # noqa: E731
        .transpose(1, 2)
        .reshape(n, args.heads, args.head_dim)
    )
    sdpa_ms = _time_ms(device, _fwd_bwd(sdpa, grad, (q, k, v)), args.reps, args.warmup)
    records = [
        Record(
            "sdpa",
            "equal",
            b,
            length,
            n,
            sdpa_ms,
            1.0,
            _tflops(lengths, args.heads, args.head_dim, sdpa_ms),
            0.0,
            False,
            None,
            str(device),
        )
    ]

    def call_for(impl):
        return lambda: jagged_attention(
            q, k, v, packed, causal=True, impl=impl, block_mask=mask if impl is Impl.FLEX else None
        )

    for r in _kernel_rows(
        args,
        "equal",
        lengths,
        [x for x in kernels if x != "padded"],
        call_for,
        sdpa,
        grad,
        (q, k, v),
        b,
        length,
        n,
        device,
    ):
        r.speedup_vs_padded = sdpa_ms / r.fwd_bwd_ms
        records.append(r)
    return records


def bench_model(args, b: int, cap: int, device: torch.device) -> list[Record]:
    """One forward+backward of the replay's softmax model on one batch, varlen against flex (plan built ahead)."""
    from benchmarks.replay import REPLAY_MODEL_PRESETS
    from fsdata.synthetic import SyntheticConfig, SyntheticSource
    from pipelines.metrics import binary_cross_entropy_sum
    from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

    source = SyntheticSource(SyntheticConfig.from_preset("kuairand-1k", num_samples=b, seed=args.seed, uih_cap=cap))
    batch = source.read(0, 0, b).to(device)
    records = []
    # The kernel rows before toggled autocast and the deterministic flag, each a recompile of FlexAttention; past
    # dynamo's recompile limit it would run eagerly (the N^2 scores). A training process sets them once.
    torch._dynamo.reset()
    for impl in ("flex", "varlen"):
        torch.manual_seed(args.seed)
        sizes = {**REPLAY_MODEL_PRESETS["replay"], "max_uih": cap}
        model = SoftmaxModel(
            SoftmaxConfig(num_labels=batch.num_labels, dense_dim=batch.dense.shape[1], attention_impl=impl, **sizes)
        ).to(device)
        plan = (
            model.plan_function()(batch.host_offsets("uih_offsets"), batch.host_offsets("candidate_offsets")).to(device)
            if model.needs_plan(device)
            else None
        )

        def run(model=model, plan=plan):
            model.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = binary_cross_entropy_sum(model(batch, plan).float(), batch.candidate_labels)
            loss.backward()

        ms = _time_ms(device, run, args.reps, args.warmup)
        base = records[0].fwd_bwd_ms if records else ms
        records.append(
            Record(
                impl,
                "model",
                b,
                cap,
                int(batch.uih_offsets[-1]),
                ms,
                base / ms,
                None,
                None,
                model.needs_plan(device),
                None,
                str(device),
            )
        )
        del model
        torch.cuda.empty_cache()
    return records


def bench_plan(args, b: int, cap: int) -> Record:
    from pipelines.models.softmax import attention_plan

    rng = np.random.default_rng(args.seed + 7)
    lengths = uih_lengths(rng, b, args.uih_median, args.uih_mean, cap)
    uih_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    candidate_offsets = torch.arange(b + 1, dtype=torch.int64) * 8
    times = []
    for _ in range(args.plan_reps + 1):
        start = time.perf_counter()
        attention_plan(uih_offsets, candidate_offsets, max_uih=cap)
        times.append((time.perf_counter() - start) * 1e3)
    return Record(
        "plan", "plan", b, cap, int(uih_offsets[-1]), statistics.median(times[1:]), None, None, None, None, None, "host"
    )


HEADER = (
    f"{'case':>9} {'kernel':>10} {'B':>4} {'cap':>6} {'tokens':>8} {'fwd+bwd ms':>11} {'speedup':>8} "
    f"{'TFLOP/s':>8} {'max rel err':>11} {'plan':>5} {'repro':>5}"
)


def _row(r: Record) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    yes = lambda x: "-" if x is None else ("yes" if x else "no")  # noqa: E731
    return (
        f"{r.case:>9} {r.backend:>10} {r.batch_size:>4} {r.cap:>6} {r.tokens:>8} {r.fwd_bwd_ms:>11.2f} "
        f"{f(r.speedup_vs_padded, '>8.2f')} {f(r.tflops, '>8.1f')} {f(r.max_rel_err, '>11.2e')} "
        f"{yes(r.needs_plan):>5} {yes(r.repro):>5}"
    )


def _gates(records: list[Record]) -> list[str]:
    """The targets, each from this run's records where both sides ran."""
    find = lambda case, backend, cap=None: next(
        (
            r
            for r in records
            if r.case == case
            and r.backend == backend  # noqa: E731
            and (cap is None or r.cap == cap)
        ),
        None,
    )
    lines = []
    largest = max((r.cap for r in records if r.case == "lognormal"), default=None)
    pad, var = find("lognormal", "padded", largest), find("lognormal", "varlen", largest)
    if pad and var:
        ratio = pad.fwd_bwd_ms / var.fwd_bwd_ms
        lines.append(
            f"causal B={var.batch_size} cap {var.cap}: varlen {ratio:.1f}x faster than padded (gate >= "
            f"{CAUSAL_GATE:.0f}x)"
        )
    sdpa, var = find("equal", "sdpa"), find("equal", "varlen")
    if sdpa and var:
        lines.append(
            f"equal lengths: varlen reaches {var.tflops / sdpa.tflops:.0%} of SDPA's TFLOP/s (gate >= {EQUAL_GATE:.0%})"
        )
    flex, var = find("target", "flex"), find("target", "varlen")
    if flex and var:
        lines.append(
            f"target attention: varlen {flex.fwd_bwd_ms / var.fwd_bwd_ms:.1f}x faster than flex (gate >= "
            f"{TARGET_GATE:.0f}x)"
        )
    flex, var = find("model", "flex"), find("model", "varlen")
    if flex and var:
        lines.append(
            f"model step: varlen takes {var.fwd_bwd_ms / flex.fwd_bwd_ms:.2f}x of flex's (gate <= {MODEL_GATE:.2f}x)"
        )
    return lines


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available")
    if args.reps < 1 or args.warmup < 0 or args.plan_reps < 1:
        raise ValueError("--reps and --plan-reps must be >= 1, --warmup >= 0")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    kernels = args.kernels.split(",") if args.kernels else list(GPU_KERNELS if cuda else CPU_KERNELS)
    for name in kernels:
        _kernel(name)
    cases_spec = args.cases or (GPU_CASES if cuda else CPU_CASES)
    cases = [] if cases_spec == "none" else _parse(cases_spec, "--cases")
    target_spec = args.target_case or ("128:21000:8" if cuda else "4:64:3")
    equal_spec = args.equal or ("16:4096" if cuda else "4:256")
    records: list[Record] = []

    def emit(rows: list[Record]) -> None:
        for r in rows:
            records.append(r)
            print(_row(r), flush=True)
        if cuda:
            torch.cuda.empty_cache()

    print(HEADER, flush=True)
    for b, cap in cases:
        emit(bench_case(args, b, cap, device, dtype, kernels))
    if target_spec != "none":
        ((b, cap, c),) = _parse(target_spec, "--target-case", arity=3)
        emit(bench_target(args, b, cap, c, device, dtype, kernels))
    if equal_spec != "none":
        ((b, length),) = _parse(equal_spec, "--equal")
        emit(bench_equal(args, b, length, device, dtype, kernels))
    if cuda and args.model_case != "none":
        ((b, cap),) = _parse(args.model_case, "--model-case")
        emit(bench_model(args, b, cap, device))
    if args.plan_case != "none":
        ((b, cap),) = _parse(args.plan_case, "--plan-case")
        r = bench_plan(args, b, cap)
        records.append(r)
        print(
            f"attention plan (UIH causal + target block masks; flex only) at B={b}, cap {cap} ({r.tokens} tokens): "
            f"{r.fwd_bwd_ms:.1f} ms per batch on the host ({torch.get_num_threads()} torch threads)"
        )
    for line in _gates(records):
        print(line)
    if args.json:
        env = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor(),
            "dtype": str(dtype).replace("torch.", ""),
            "torch_threads": torch.get_num_threads(),
        }
        setup = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        with open(args.json, "w") as fh:
            json.dump({"setup": setup, "env": env, "records": [asdict(r) for r in records]}, fh, indent=1)
    return 0
