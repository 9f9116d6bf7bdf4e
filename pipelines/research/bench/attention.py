"""`freescale bench attention`: forward + backward of the jagged attention against the padded one.

Per case (``--cases B:cap,...``; default on CUDA (64, 4,096), (128, 8,000), (128, 21,000), small ones on CPU), a
batch of B causal self-attentions with KuaiRand-like UIH lengths (lognormal, median 3,400, mean 5,000 before the
cap, as ``freescale bench kernels`` draws them), ``--heads`` heads of ``--head-dim``, bf16 on CUDA (fp32 on CPU):

    jagged   kernels.attention over the packed tokens [N, heads, dim]: FlexAttention with the block mask built from
             the offsets (built before the timing: the loader builds it, see the plan row) on CUDA; one fused SDPA
             per sample on CPU
    padded   every sample padded to the batch's longest and one causal SDPA over [B, heads, L, dim] (fused
             kernels, no mask), padding and unpadding included: what the padded model runs

Each is timed as the median of ``--reps`` forward+backward calls after ``--warmup`` (the first compiles
FlexAttention), between device synchronisations. ``tflops`` counts, for both paths alike, only the pairs a causal
jagged computation needs (sum over samples of L(L+1)/2, per head) at 4 * head_dim flops per pair forward and 2.5
times that backward (FlashAttention's accounting). ``max_rel_err``: the largest absolute difference of the jagged
output from the padded one over the padded output's largest magnitude.

Two more rows: ``equal`` (``--equal B:L``, default 16:4096), a batch of equal lengths, jagged against SDPA on
[B, heads, L, dim] directly (no padding to waste: what is left is FlexAttention's own efficiency; the target is
70% of SDPA's TFLOP/s); and ``plan``, the host cost of the reference model's attention plan
(pipelines.model.attention_plan: the UIH encoder's causal block mask and the target attention's) per batch at
``--plan-case`` (default 128:21000, 8 candidates per sample), median of ``--plan-reps`` builds on this host.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kernels.attention import AttentionImpl, jagged_attention
from kernels.flex.block_mask import build_block_mask
from pipelines.research.bench.kernels import uih_lengths

GPU_CASES = "64:4096,128:8000,128:21000"
CPU_CASES = "4:256,8:512"


@dataclass
class Record:
    backend: str  # jagged | padded | sdpa (equal lengths) | plan (host build of the attention plan)
    case: str  # lognormal | equal | plan
    batch_size: int
    cap: int
    tokens: int
    fwd_bwd_ms: float
    speedup_vs_padded: Optional[float]
    tflops: Optional[float]
    max_rel_err: Optional[float]
    device: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--cases", default=None, help=f"comma-separated B:cap (default {GPU_CASES} on CUDA, {CPU_CASES} on CPU)")
    parser.add_argument("--equal", default=None, help="B:L of the equal-lengths case against SDPA (default 16:4096 on CUDA, 4:256 on CPU; 'none' skips it)")
    parser.add_argument("--plan-case", default="128:21000", help="B:cap of the attention plan's host cost ('none' skips it)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--uih-median", type=float, default=3400.0)
    parser.add_argument("--uih-mean", type=float, default=5000.0, help="mean UIH length before the cap")
    parser.add_argument("--reps", type=int, default=10, help="timed forward+backward calls per backend")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (the first compiles FlexAttention)")
    parser.add_argument("--plan-reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the records (and the set-up) as JSON")


def _pairs(lengths: np.ndarray) -> float:
    return float(np.sum(lengths.astype(np.float64) * (lengths + 1) / 2))


def _tflops(lengths: np.ndarray, heads: int, head_dim: int, ms: float) -> float:
    return 3.5 * 4 * head_dim * heads * _pairs(lengths) / (ms * 1e-3) / 1e12


def _parse(spec: str, flag: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in part.split(":")) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"bench attention: {flag} must be comma-separated B:cap pairs, got {spec!r}") from None
    if not out or any(len(c) != 2 or min(c) < 1 for c in out):
        raise ValueError(f"bench attention: {flag} must be comma-separated B:cap pairs of positive integers, got {spec!r}")
    return out


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


def _inputs(n: int, heads: int, head_dim: int, device, dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda: torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()  # noqa: E731
    q, k, v = make(), make(), make()
    grad = torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=gen)
    return q, k, v, grad


def _fwd_bwd(call: Callable[[], torch.Tensor], grad: torch.Tensor, tensors) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        for t in tensors:
            t.grad = None
        out = call()
        out.backward(grad)
        return out
    return run


def _max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def bench_case(args, b: int, cap: int, device: torch.device, dtype) -> list[Record]:
    rng = np.random.default_rng(args.seed + b * 100_003 + cap)
    lengths = uih_lengths(rng, b, args.uih_median, args.uih_mean, cap)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    n = int(offsets[-1])
    q, k, v, grad = _inputs(n, args.heads, args.head_dim, device, dtype, args.seed)
    mask = build_block_mask(offsets, causal=True).to(device) if device.type == "cuda" else None
    jagged = _fwd_bwd(lambda: jagged_attention(q, k, v, offsets, causal=True, block_mask=mask), grad, (q, k, v))
    padded = _fwd_bwd(lambda: jagged_attention(q, k, v, offsets, causal=True, impl=AttentionImpl.PADDED), grad, (q, k, v))
    with torch.no_grad():
        ref = jagged_attention(q, k, v, offsets, causal=True, impl=AttentionImpl.PADDED).float()
        got = jagged_attention(q, k, v, offsets, causal=True, block_mask=mask).float()
        err = _max_rel_err(got, ref)
    padded_ms = _time_ms(device, padded, args.reps, args.warmup)
    jagged_ms = _time_ms(device, jagged, args.reps, args.warmup)
    rec = lambda backend, ms, speedup, e: Record(backend, "lognormal", b, cap, n, ms, speedup,  # noqa: E731
                                                 _tflops(lengths, args.heads, args.head_dim, ms), e, str(device))
    return [rec("padded", padded_ms, 1.0, 0.0), rec("jagged", jagged_ms, padded_ms / jagged_ms, err)]


def bench_equal(args, b: int, length: int, device: torch.device, dtype) -> list[Record]:
    lengths = np.full(b, length, dtype=np.int64)
    offsets = torch.arange(b + 1, dtype=torch.int64) * length
    n = b * length
    q, k, v, grad = _inputs(n, args.heads, args.head_dim, device, dtype, args.seed)
    mask = build_block_mask(offsets, causal=True).to(device) if device.type == "cuda" else None
    jagged = _fwd_bwd(lambda: jagged_attention(q, k, v, offsets, causal=True, block_mask=mask), grad, (q, k, v))
    as_batch = lambda t: t.view(b, length, args.heads, args.head_dim).transpose(1, 2)  # noqa: E731
    sdpa_forward = lambda: (F.scaled_dot_product_attention(as_batch(q), as_batch(k), as_batch(v), is_causal=True)  # noqa: E731
                            .transpose(1, 2).reshape(n, args.heads, args.head_dim))
    sdpa = _fwd_bwd(sdpa_forward, grad, (q, k, v))
    with torch.no_grad():
        ref = sdpa_forward().float()
        got = jagged_attention(q, k, v, offsets, causal=True, block_mask=mask).float()
        err = _max_rel_err(got, ref)
    sdpa_ms = _time_ms(device, sdpa, args.reps, args.warmup)
    jagged_ms = _time_ms(device, jagged, args.reps, args.warmup)
    rec = lambda backend, ms, speedup, e: Record(backend, "equal", b, length, n, ms, speedup,  # noqa: E731
                                                 _tflops(lengths, args.heads, args.head_dim, ms), e, str(device))
    return [rec("sdpa", sdpa_ms, 1.0, 0.0), rec("jagged", jagged_ms, sdpa_ms / jagged_ms, err)]


def bench_plan(args, b: int, cap: int) -> Record:
    from pipelines.model import attention_plan

    rng = np.random.default_rng(args.seed + 7)
    lengths = uih_lengths(rng, b, args.uih_median, args.uih_mean, cap)
    uih_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    candidate_offsets = torch.arange(b + 1, dtype=torch.int64) * 8
    times = []
    for _ in range(args.plan_reps + 1):
        start = time.perf_counter()
        attention_plan(uih_offsets, candidate_offsets, max_uih=cap)
        times.append((time.perf_counter() - start) * 1e3)
    return Record("plan", "plan", b, cap, int(uih_offsets[-1]), statistics.median(times[1:]), None, None, None, "host")


HEADER = f"{'case':>9} {'backend':>7} {'B':>4} {'cap':>6} {'tokens':>8} {'fwd+bwd ms':>11} {'speedup':>8} {'TFLOP/s':>8} {'max rel err':>11}"


def _row(r: Record) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    return (f"{r.case:>9} {r.backend:>7} {r.batch_size:>4} {r.cap:>6} {r.tokens:>8} {r.fwd_bwd_ms:>11.2f} "
            f"{f(r.speedup_vs_padded, '>8.2f')} {f(r.tflops, '>8.1f')} {f(r.max_rel_err, '>11.2e')}")


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench attention: --device cuda but CUDA is not available")
    if args.reps < 1 or args.warmup < 0 or args.plan_reps < 1:
        raise ValueError("bench attention: --reps and --plan-reps must be >= 1, --warmup >= 0")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cases = _parse(args.cases or (GPU_CASES if cuda else CPU_CASES), "--cases")
    equal_spec = args.equal or ("16:4096" if cuda else "4:256")
    records: list[Record] = []
    print(HEADER, flush=True)
    for b, cap in cases:
        for r in bench_case(args, b, cap, device, dtype):
            records.append(r)
            print(_row(r), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if equal_spec != "none":
        (b, length), = _parse(equal_spec, "--equal")
        for r in bench_equal(args, b, length, device, dtype):
            records.append(r)
            print(_row(r), flush=True)
        ratio = records[-1].tflops / records[-2].tflops
        print(f"equal lengths: jagged reaches {ratio:.0%} of SDPA's TFLOP/s (target >= 70%)")
    if args.plan_case != "none":
        (b, cap), = _parse(args.plan_case, "--plan-case")
        r = bench_plan(args, b, cap)
        records.append(r)
        print(f"attention plan (UIH causal + target block masks) at B={b}, cap {cap} ({r.tokens} tokens): "
              f"{r.fwd_bwd_ms:.1f} ms per batch on the host ({torch.get_num_threads()} torch threads)")
    if args.json:
        env = {"torch": torch.__version__, "python": platform.python_version(),
               "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor(),
               "dtype": str(dtype).replace("torch.", ""), "torch_threads": torch.get_num_threads()}
        setup = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        with open(args.json, "w") as fh:
            json.dump({"setup": setup, "env": env, "records": [asdict(r) for r in records]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="freescale bench attention")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
