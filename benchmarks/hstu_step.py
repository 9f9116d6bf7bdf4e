"""`python -m benchmarks hstu-step`: one training step of the HSTU model (pipelines.models.hstu) on one device, in
TFLOP/s and MFU.

The step is what the job's step does around the model, without the loader: forward, BCE loss, backward,
optimizer step (Adam, fused on CUDA, on the dense parameters), gradients cleared. The item table is a local
``nn.Embedding`` of ``--num-items`` rows (default 100,000) that the job would shard across ranks. ``--table-update``:
``rows`` (the default) updates it as the job's sharded table is updated, the looked-up rows only, by fsembed's
row-wise (lazy) Adam from the lookup's sparse gradient; ``dense`` by torch's fused Adam over the whole table with
the dense parameters (at width 1024 about 0.1 G parameters read and written every step, a memory-bound pass no
recommender makes over its tables). The FLOP count leaves both out.

Precision (``--precision``): ``autocast`` (the default on CUDA) is how the job trains (pipelines.api.numerics):
fp32 master weights and Adam states, the forward and the loss under bf16 autocast (matmuls and the attention in
bf16, norms and the loss in fp32). ``bf16``: the parameters themselves in bf16 and Adam on them (no master copy).
``fp32``: the default on CPU.

Lengths (``--lengths``), one batch per kind drawn once from ``--seed`` and timed again and again:

    zipf   each sample's UIH length drawn from Zipf(``--zipf-alpha``, default 1.2), P(k) ~ k^-alpha for k >= 1,
           clipped to [1, max_uih]: the jagged lengths of NVIDIA recsys-examples' HSTU training benchmark (numpy's
           zipf, clipped at their max sequence length 4,096, batch 32 per GPU). Heavy-tailed: about one sample in
           six sits at the cap, half are shorter than 20 events, and the few full-length samples hold most tokens
           and nearly all the attention work.
    full   every sample at max_uih (their non-jagged setting).

Each sample also has ``--candidates`` (default 1-8, uniform) candidates with 1-3 content ids each, the sequence's
targets, scored as the job scores them (recsys-examples' benchmark sets no candidates and labels every history
token). Their model interleaves an item and an action token per event (two tokens); this one adds the action
embedding to its item's token (one), so at the same lengths it runs half their tokens. The FLOPs below count the
tokens this model runs.

Positions: ``--rab on`` adds the learned relative attention bias inside the attention (work per score);
``--position-embeddings`` adds learned recency and age embeddings to the input tokens (a gather per token).
recsys-examples' configuration is rab off with input embeddings: their HSTU config leaves the relative bias off
and none of their attention kernels takes one.

FLOPs (:func:`step_flops`), counted analytically per step, forward + backward:

    per layer   linears   (2 N d 4 H Dh  +  2 N H Dh d) x 3                     (uvqk and output projections)
                attention 2 H Dh sum(L_i^2) x 3.5                                 (generative-recommenders' count)

with N the packed tokens (kept UIH + candidates), L_i each sample's, d the width, H heads of Dh. The attention
term is two matmuls over the causal half of each sample (recsys-examples' and generative-recommenders' count; the
candidates, which do not see each other, make the true count smaller by under C_i^2 per sample). The output
projection is the whole matmul (recsys-examples' count has 2 N H d for it, without Dh). Left out: the head MLP (two
small matmuls per candidate, not per token), the embedding lookups, norms, SiLU and Adam.

Timing: CUDA events around each step, median of ``--reps`` after ``--warmup`` (the first steps autotune the Triton
attention and warm the allocator). Each step then waits for the device, so host work the device waits on (launches,
the batch's packing) counts in it; ``b2b``: the same ``--reps`` steps launched back to back, as a training loop runs
them, where the host's work for a step overlaps the device's for the one before, unless the step syncs;
``--gaps N`` traces two steps back to back and prints where the device waited on the host and what the host was busy
in then, and the innermost Python frames of one step's synchronizing CUDA calls; on CUDA each row also
counts the caching allocator's cudaMalloc, cudaFree and retries per b2b step (a cudaFree waits for the device). The
attention alone: its forward + backward at the step's shapes and inputs (q, k, v of one layer, the model's rab
weights, targets and timestamps), timed the same way and multiplied by the layers; its share of the step is an
estimate (it runs alone, without the step's other kernels around it).

MFU: TFLOP/s over ``--peak-tflops`` (default 989, the H200's and H100 SXM's dense bf16 tensor-core peak). The gates
(CUDA rows): rab off >= 340 TFLOP/s (NVIDIA recsys-examples' best per GPU on this configuration, fixed lengths; aim
400), rab on >= 200 (aim 300), each also read on the back-to-back steps; with ``--breakdown``, the glue (neither
matmul, attention nor optimizer) <= 15% of the step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import platform
import statistics
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch

from benchmarks.gpu_trace import describe_gap, trace
from benchmarks.timing import call_times_ms, kernel_and_range_times_ms
from fsdata.batch import Batch, lengths_to_offsets
from fsembed import optim as fsembed_optim
from kernels.hstu import hstu_attention
from kernels.triton import triton_hstu_attention as hstu_kernels
from pipelines.api.numerics import autocast
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.hstu import HSTU_PRESETS, RESIDUALS, HSTUConfig, HSTUModel
from pipelines.models.softmax import truncate

LENGTHS = ("zipf", "full")
PRECISIONS = ("autocast", "bf16", "fp32")
PEAK_TFLOPS = 989.0  # H200 / H100 SXM dense bf16 tensor cores
#: (gate, aim) TFLOP/s of a step by its rab: recsys-examples reaches 340.3 per GPU at fixed lengths without rab.
GATES_TFLOPS = {False: (340.0, 400.0), True: (200.0, 300.0)}
GLUE_GATE = 0.15
CONTENT_IDS = (1, 3)  # content ids per candidate, inclusive
TABLE_UPDATES = ("rows", "dense")
#: The profiler range around the item table's row update: kernel_breakdown counts its kernels as the optimizer's.
TABLE_UPDATE_RANGE = "hstu_step.table_update"


@dataclass
class Record:
    preset: str
    lengths: str
    rab: bool
    position_embeddings: bool
    compiled: bool
    precision: str
    batch: int
    tokens: int
    max_len: int
    candidates: int
    step_ms: Optional[float]
    attention_ms: Optional[float]
    attention_share: Optional[float]
    linear_tflop: float
    attention_tflop: float
    tflop: float
    tflops: Optional[float]
    mfu: Optional[float]
    step_ms_reps: list[float]
    seq_lengths: list[int]  # each sample's packed tokens (kept UIH + candidates), what the FLOPs count
    first_step_s: Optional[float] = None  # the first step's wall time: torch.compile's and the autotuner's work
    # A step's mean over --reps steps launched without waiting for the device between them, as a training loop runs
    back_to_back_ms: Optional[float] = None
    breakdown_ms: Optional[dict[str, float]] = None  # per step, kernel time by PARTS (--breakdown)
    other_kernels_ms: Optional[dict[str, float]] = None  # per step, the costliest kernels of "other" by name
    idle_gaps: Optional[list[dict]] = None  # --gaps: the longest spans without a kernel over 2 steps back to back
    # --gaps: one step's synchronizing CUDA calls by their innermost Python frames (host_syncs)
    host_syncs: Optional[dict[str, int]] = None
    # Per step over the b2b steps (CUDA): the caching allocator's cudaMalloc and cudaFree calls and its retries
    # (a retry frees cached blocks first); each cudaFree waits for the device, which then idles until the host
    # catches up: what steady-state steps should show as 0.
    allocator: Optional[dict[str, float]] = None
    skipped: Optional[str] = None
    table_update: str = "rows"  # --table-update
    residual: str = "fp32"  # --residual

    @property
    def back_to_back_tflops(self) -> Optional[float]:
        return None if self.back_to_back_ms is None else self.tflop * 1e3 / self.back_to_back_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset", default=None, help=f"one of {', '.join(HSTU_PRESETS)} (default hstu-large on CUDA, hstu on CPU)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-items", type=int, default=100_000, help="rows of the local item table")
    parser.add_argument("--lengths", default="zipf", help=f"comma list of {', '.join(LENGTHS)}")
    parser.add_argument("--zipf-alpha", type=float, default=1.2)
    parser.add_argument("--candidates", default="1-8", help="candidates per sample, LO-HI (uniform) or N")
    parser.add_argument("--rab", default="on,off", help="comma list of on, off: the config's rab")
    parser.add_argument(
        "--position-embeddings",
        action="store_true",
        help="every row with the config's input position embeddings (with --rab off: recsys-examples' configuration)",
    )
    parser.add_argument(
        "--compile", default=None, help="comma list of on, off: the layers under torch.compile (default on,off on CUDA)"
    )
    parser.add_argument(
        "--table-update",
        choices=TABLE_UPDATES,
        default="rows",
        help="the item table's update: its looked-up rows (fsembed's row-wise Adam, as the job) or dense Adam",
    )
    parser.add_argument("--breakdown", action="store_true", help="profile each row's steps: kernel time by part")
    parser.add_argument(
        "--gaps",
        type=int,
        default=0,
        metavar="N",
        help="trace 2 steps back to back (CUDA): the N longest spans without a kernel and the host's ops then",
    )
    parser.add_argument(
        "--residual",
        choices=RESIDUALS,
        default="fp32",
        help="under autocast, the residual stream between the layers (HSTUConfig.fp32_residual)",
    )
    parser.add_argument("--precision", choices=PRECISIONS, default=None, help="default autocast on CUDA, fp32 on CPU")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths, ids and the model's weights")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the device's dense peak, for MFU")
    parser.add_argument("--json", default=None, metavar="PATH")


# ---------------------------------------------------------------- the batch
def parse_candidates(text: str) -> tuple[int, int]:
    """``"LO-HI"`` or ``"N"`` -> (lo, hi), inclusive."""
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (-1, -1)
    except ValueError:
        lo, hi = -1, -1
    if not 0 <= lo <= hi or hi < 1:
        raise ValueError(f"--candidates: expected LO-HI or N with 0 <= LO <= HI and HI >= 1, got {text!r}")
    return lo, hi


def uih_lengths(kind: str, batch: int, cap: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """[batch] UIH lengths: ``zipf`` (numpy's Zipf(alpha), clipped to [1, cap]) or ``full`` (all ``cap``)."""
    if kind == "full":
        return np.full(batch, cap, dtype=np.int64)
    if alpha <= 1.0:
        raise ValueError(f"--zipf-alpha must be > 1, got {alpha}")
    return np.clip(rng.zipf(alpha, batch), 1, cap).astype(np.int64)


def synthetic_batch(
    lengths: np.ndarray, num_candidates: np.ndarray, config: HSTUConfig, rng: np.random.Generator
) -> Batch:
    """A host batch with the given UIH lengths and candidates per sample: uniform ids, action types and labels,
    increasing timestamps (gaps of about an hour), 1-3 content ids per candidate."""
    b, events, cands = len(lengths), int(lengths.sum()), int(num_candidates.sum())
    content = rng.integers(CONTENT_IDS[0], CONTENT_IDS[1] + 1, cands)
    gaps = rng.exponential(3600.0, events).astype(np.int64) + 1
    t = torch.from_numpy
    return Batch(
        sample_ids=torch.arange(b, dtype=torch.int64),
        user_ids=torch.arange(b, dtype=torch.int64),
        uih_offsets=lengths_to_offsets(t(lengths)),
        uih_item_ids=t(rng.integers(0, config.num_items, events)),
        candidate_offsets=lengths_to_offsets(t(num_candidates.astype(np.int64))),
        candidate_labels=t(rng.integers(0, 2, (cands, config.num_labels)).astype(np.float32)),
        content_offsets=lengths_to_offsets(t(content)),
        content_ids=t(rng.integers(0, config.num_items, int(content.sum()))),
        dense=t(rng.random((b, config.dense_dim), dtype=np.float32)),
        uih_action_types=t(rng.integers(0, config.num_actions, events)),
        uih_timestamps=t(1_700_000_000 + np.cumsum(gaps)),  # increasing across the batch, so within each sample
    )


def sequence_lengths(batch: Batch, max_uih: int) -> np.ndarray:
    """Each sample's packed sequence as the model runs it: its kept UIH (the most recent ``max_uih``) plus its
    candidates."""
    uih = batch.host_offsets("uih_offsets").diff().clamp(max=max_uih)
    return (uih + batch.host_offsets("candidate_offsets").diff()).numpy()


# ---------------------------------------------------------------- FLOPs
def step_flops(lengths: np.ndarray, dim: int, num_layers: int, num_heads: int, head_dim: int) -> dict[str, float]:
    """FLOPs of one training step (forward + backward) of the HSTU layers on sequences of ``lengths`` tokens each.

    Per layer: the uvqk projection (d -> 4 H Dh) and the output projection (H Dh -> d), 2 FLOPs per multiply-add,
    forward x 3 (backward: the input's and the weight's gradients); the attention 2 H Dh sum(L_i^2) forward, two
    matmuls (q k^T, A v) over the causal half, x 3.5 for forward + backward (generative-recommenders' count: the
    backward recomputes q k^T). Returns ``linear``, ``attention`` and ``total``; the head MLP, embeddings, norms and
    elementwise ops are excluded (the module docstring says why)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    tokens, hidden = float(lengths.sum()), num_heads * head_dim
    linear = 3.0 * (2.0 * tokens * dim * 4 * hidden + 2.0 * tokens * hidden * dim) * num_layers
    attention = 3.5 * 2.0 * hidden * float(np.sum(lengths**2)) * num_layers
    return dict(linear=linear, attention=attention, total=linear + attention)


def build_step(
    model: HSTUModel, batch: Batch, precision: str, device: torch.device, table_update: str = "rows"
) -> Callable[[], None]:
    """The training step on ``batch``: forward and loss (under bf16 autocast for ``autocast``), backward, Adam
    (fused on CUDA), gradients cleared; the item table updated by ``table_update`` (module docstring)."""
    table = model.item_embedding
    rows = table_update == "rows"
    table.sparse = rows  # the lookup's gradient: its rows and ids, as a sharded table's backward hands them over
    dense = [p for p in model.parameters() if not (rows and p is table.weight)]
    optimizer = torch.optim.Adam(dense, lr=1e-3, fused=device.type == "cuda")
    row_adam = fsembed_optim.Adam(lr=1e-3)
    state = row_adam.init_state(table.weight) if rows else {}  # the job's table keeps its state beside its rows
    dtype = torch.bfloat16 if precision == "autocast" else None  # bf16 and fp32: the parameters' own dtype

    def step() -> None:
        with autocast(dtype, device):
            loss = binary_cross_entropy_sum(model(batch).float(), batch.candidate_labels)
        loss.backward()
        optimizer.step()
        if rows and table.weight.grad is not None:  # None: the batch looked nothing up
            grad, table.weight.grad = table.weight.grad, None
            with torch.no_grad(), torch.profiler.record_function(TABLE_UPDATE_RANGE):
                row_adam.apply(table.weight, state, grad._indices()[0], grad._values())
        optimizer.zero_grad(set_to_none=True)

    return step


def time_attention(model: HSTUModel, batch: Batch, precision: str, device: torch.device, reps: int, warmup: int):
    """Median ms of one layer's attention forward + backward at the step's shapes: q, k, v [N, H, Dh] in the
    step's compute dtype, the first layer's rab weights, the candidates as targets, the batch's timestamps."""
    c, layer = model.config, model.layers[0]
    seq = model._pack(batch, truncate(batch, c.max_uih))  # the packing the forward builds, same offsets and times
    n = int(seq.offsets.host[-1])
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(7)
    q, k, v, grad = (torch.randn(n, c.num_heads, c.head_dim, device=device, dtype=dtype) * 0.1 for _ in "qkvg")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    weights = [
        w.detach().float().clone().requires_grad_() if w is not None else None
        for w in (layer.position_weights, layer.time_weights)
    ]
    timed = seq.timestamps is not None and weights[1] is not None
    leaves = [t for t in (q, k, v, *weights) if t is not None]

    def run() -> None:
        for t in leaves:
            t.grad = None
        out = hstu_attention(
            q,
            k,
            v,
            seq.attention,
            alpha=1.0 / math.sqrt(c.head_dim),
            seq_norm=c.max_uih + c.max_candidates if c.seq_norm == "max" else None,
            window=c.window,
            position_weights=weights[0],
            time_weights=weights[1] if timed else None,
            deterministic=c.deterministic,
        )
        out.backward(grad)

    return statistics.median(call_times_ms(device, run, reps, warmup))


# ---------------------------------------------------------------- where a step's time goes
#: The parts of a step's kernel time: the HSTU attention's kernels (every Triton kernel of its module: the three
#: passes, the dQ pass from the kept dS, the weights' passes, the batch's pair buckets and each layer's per-pair
#: bias), the matmuls (cuBLAS / CUTLASS), the optimizer's update, and everything else: the memory-bound glue (norms,
#: activations, casts, copies, the embedding lookups, inductor's fused kernels).
PARTS = ("attention", "matmul", "optimizer", "other")
_ATTENTION_KERNELS = tuple(name for name in vars(hstu_kernels) if name.endswith("_kernel"))
_MATMUL_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "triton_tem_")  # tem: inductor's templates


def kernel_part(name: str) -> str:
    """The part of :data:`PARTS` a kernel's (profiler) name belongs to."""
    lowered = name.lower()
    if any(k in name for k in _ATTENTION_KERNELS):
        return "attention"
    if any(k in lowered for k in _MATMUL_KERNELS):
        return "matmul"
    # The row update's fused kernel by its name too: a Triton launch outside any aten op can miss its range.
    if "adam" in lowered or "multi_tensor" in lowered or "rowwise_update" in lowered:
        return "optimizer"
    return "other"


def kernel_breakdown(step: Callable[[], None], steps: int = 3, top: int = 12) -> tuple[dict[str, float], dict]:
    """Per step, the ms of GPU kernel time in each of :data:`PARTS`, and of the ``top`` costliest kernels of
    ``other`` by name, from torch.profiler over ``steps`` steps. The item table's row update
    (:data:`TABLE_UPDATE_RANGE`) is the optimizer's, whatever its kernels' names (gathers, sorts, copies)."""
    totals, other = dict.fromkeys(PARTS, 0.0), {}
    kernels, table = kernel_and_range_times_ms(step, steps, TABLE_UPDATE_RANGE)
    for name, ms in kernels.items():
        moved = min(ms, table.get(name, 0.0))
        part = kernel_part(name)
        totals[part] += ms - moved
        totals["optimizer"] += moved
        if part == "other" and ms - moved > 0 and len(other) < top:
            other[name] = ms - moved
    return totals, other


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counts of cudaMalloc, cudaFree and alloc retries so far ({} off CUDA)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(f"num_{key}", 0) for key in ("device_alloc", "device_free", "alloc_retries")}


def host_syncs(step: Callable[[], None], depth: int = 4) -> dict[str, int]:
    """One step's synchronizing CUDA calls (torch.cuda.set_sync_debug_mode), counted by where each came from: the
    innermost ``depth`` Python frames (``file:line < caller:line``). At each the host waits for the device's queue
    to drain, and the device then idles until the host launches again, which back-to-back steps cannot overlap."""
    previous = torch.cuda.get_sync_debug_mode()
    stacks: collections.Counter = collections.Counter()
    stepping = False  # what switching the mode itself warns of is not the step's

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if stepping and "synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            stacks[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[::-1][:depth])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            stepping = True
            step()
        finally:
            stepping = False
            torch.cuda.set_sync_debug_mode(previous)
    return dict(stacks)


def time_back_to_back(device: torch.device, step: Callable[[], None], reps: int) -> tuple[float, Optional[dict]]:
    """The mean ms of ``reps`` steps launched without waiting between them, and the allocator's counts per step
    over them (:func:`allocator_counts`; None off CUDA)."""
    before = allocator_counts(device)
    ms = call_times_ms(device, lambda: [step() for _ in range(reps)], 1, 0)[0] / reps
    after = allocator_counts(device)
    return ms, ({key: (after[key] - before[key]) / reps for key in after} if after else None)


def where_time_goes(step: Callable[[], None], breakdown: bool, gaps: int) -> tuple:
    """A CUDA row's diagnostics, each None where not asked for: with ``breakdown``, :func:`kernel_breakdown`'s
    two dicts; with ``gaps``, the ``gaps`` longest idle spans of two steps back to back and :func:`host_syncs`."""
    parts, other = kernel_breakdown(step) if breakdown else (None, None)
    if not gaps:
        return parts, other, None, None
    return parts, other, trace(lambda: [step() for _ in range(2)]).idle_gaps(gaps), host_syncs(step)


# ---------------------------------------------------------------- one row
def bench_one(args, preset: str, kind: str, rab: bool, compiled: bool, host_batch: Batch, precision: str) -> Record:
    device = torch.device(args.device)
    embeddings = args.position_embeddings
    switches = dict(rab=rab, position_embeddings=embeddings, compile=compiled, fp32_residual=args.residual == "fp32")
    config = HSTUConfig(**{**HSTU_PRESETS[preset], "num_items": args.num_items, **switches})
    lengths = sequence_lengths(host_batch, config.max_uih)
    flops = step_flops(lengths, config.dim, config.num_layers, config.num_heads, config.head_dim)
    base = dict(
        preset=preset,
        lengths=kind,
        rab=rab,
        position_embeddings=embeddings,
        compiled=compiled,
        precision=precision,
        batch=len(lengths),
        tokens=int(lengths.sum()),
        max_len=int(lengths.max()),
        candidates=int(host_batch.candidate_offsets[-1]),
        linear_tflop=flops["linear"] / 1e12,
        attention_tflop=flops["attention"] / 1e12,
        tflop=flops["total"] / 1e12,
        seq_lengths=lengths.tolist(),
        table_update=args.table_update,
        residual=args.residual,
    )
    if precision == "bf16":  # the dense features meet bf16 weights
        host_batch = dataclasses.replace(host_batch, dense=host_batch.dense.to(torch.bfloat16))
    batch = host_batch.to(device)
    torch.manual_seed(args.seed)
    model = HSTUModel(config).to(device).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    breakdown = other_kernels = gaps = syncs = None  # filled on CUDA only
    try:
        step = build_step(model, batch, precision, device, args.table_update)
        first_step_s = call_times_ms(device, step, 1, 0, wall=True)[0] / 1e3
        times = call_times_ms(device, step, args.reps, args.warmup)
        back_to_back, allocator = time_back_to_back(device, step, args.reps)
        if device.type == "cuda":
            breakdown, other_kernels, gaps, syncs = where_time_goes(step, args.breakdown, args.gaps)
        attention = time_attention(model, batch, precision, device, args.reps, args.warmup) * config.num_layers
    except torch.OutOfMemoryError:
        return Record(
            **base,
            step_ms=None,
            attention_ms=None,
            attention_share=None,
            tflops=None,
            mfu=None,
            step_ms_reps=[],
            skipped="out of memory",
        )
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step_ms = statistics.median(times)
    tflops = flops["total"] / step_ms / 1e9
    return Record(
        **base,
        step_ms=step_ms,
        attention_ms=attention,
        attention_share=attention / step_ms,
        tflops=tflops,
        mfu=tflops / args.peak_tflops,
        step_ms_reps=times,
        first_step_s=first_step_s,
        back_to_back_ms=back_to_back,
        breakdown_ms=breakdown,
        other_kernels_ms=other_kernels,
        idle_gaps=gaps,
        host_syncs=syncs,
        allocator=allocator,
    )


# ---------------------------------------------------------------- report
def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def table(records: list[Record]) -> str:
    head = (
        "preset      lengths rab emb comp prec         B  tokens max_len  step ms  attn ms  attn %  TFLOP/step"
        "  TFLOP/s  MFU %  1st s  b2b ms  b2b TFLOP/s"
    )
    lines = [head]
    for r in records:
        left = (
            f"{r.preset:<11} {r.lengths:<7} {_on(r.rab):<3} {_on(r.position_embeddings):<3} {_on(r.compiled):<4} "
            f"{r.precision:<8} {r.batch:>5} {r.tokens:>7} {r.max_len:>7}"
        )
        if r.skipped:
            lines.append(f"{left}  skipped: {r.skipped}")
            continue
        cells = [
            _fmt(r.step_ms, "8.2f"),
            _fmt(r.attention_ms, "8.2f"),
            _fmt(None if r.attention_share is None else 100 * r.attention_share, "6.1f"),
            _fmt(r.tflop, "10.4g"),
            _fmt(r.tflops, "7.1f"),
            _fmt(None if r.mfu is None else 100 * r.mfu, "5.1f"),
            _fmt(r.first_step_s, "5.1f"),
            _fmt(r.back_to_back_ms, "6.2f"),
            _fmt(r.back_to_back_tflops, "11.1f"),
        ]
        lines.append(f"{left} " + "  ".join(cells))
    return "\n".join(lines)


def breakdown_table(records: list[Record]) -> str:
    """Each profiled row's kernel time per step by part, in ms and as a share of the step (CUDA events' median):
    ``other`` is the glue; ``idle`` the step's time with no kernel running (launch gaps, host work)."""
    lines = ["preset      lengths rab emb comp " + "".join(f"{p:>16}" for p in (*PARTS, "idle"))]
    for r in records:
        if not r.breakdown_ms or not r.step_ms:
            continue
        parts = dict(r.breakdown_ms, idle=max(r.step_ms - sum(r.breakdown_ms.values()), 0.0))
        cells = "".join(f"{parts[p]:>8.2f} ({100 * parts[p] / r.step_ms:4.1f}%)" for p in (*PARTS, "idle"))
        left = f"{r.preset:<11} {r.lengths:<7} {_on(r.rab):<3} {_on(r.position_embeddings):<3} {_on(r.compiled):<4}"
        lines.append(f"{left} {cells}")
    return "\n".join(lines)


def gates(records: list[Record], device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [f"gate: CUDA rows only (this run is on {device.type})"]
    out = []
    for r in records:
        if r.tflops is None:
            continue
        gate, aim = GATES_TFLOPS[r.rab]
        verdict = "met" if r.tflops >= gate else "NOT met"
        out.append(
            f"gate {r.preset} {r.lengths} rab {_on(r.rab)} compile {_on(r.compiled)}"
            f"{', input position embeddings' if r.position_embeddings else ''}: step {r.tflops:.1f} TFLOP/s >= "
            f"{gate:.0f} (aim {aim:.0f}): {verdict}{'; aim met' if r.tflops >= aim else ''}"
        )
        if r.back_to_back_ms:  # the same gate as a training loop runs the steps, the host's work overlapped
            b2b = r.back_to_back_tflops
            out.append(f"  back to back {b2b:.1f} TFLOP/s: {'met' if b2b >= gate else 'NOT met'}")
        if r.breakdown_ms and r.step_ms:
            glue = r.breakdown_ms["other"] / r.step_ms
            verdict = "met" if glue <= GLUE_GATE else "NOT met"
            out.append(f"  glue {100 * glue:.0f}% of the step (<= {100 * GLUE_GATE:.0f}%): {verdict}")
    return out


def _choices(flag: str, text: str, allowed) -> list[str]:
    given = text.split(",")
    unknown = [x for x in given if x not in allowed]
    if unknown:
        raise ValueError(f"{flag}: unknown {unknown}; choose from {', '.join(allowed)}")
    return given


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = args.preset or ("hstu-large" if cuda else "hstu")
    if preset not in HSTU_PRESETS:
        raise ValueError(f"--preset: unknown {preset!r}; choose from {', '.join(HSTU_PRESETS)}")
    precision = args.precision or ("autocast" if cuda else "fp32")
    kinds = _choices("--lengths", args.lengths, LENGTHS)
    rabs = [x == "on" for x in _choices("--rab", args.rab, ("on", "off"))]
    compiles = [x == "on" for x in _choices("--compile", args.compile or ("on,off" if cuda else "off"), ("on", "off"))]
    lo, hi = parse_candidates(args.candidates)
    if args.batch_size < 1 or args.reps < 1 or args.warmup < 0:
        raise ValueError("--batch-size and --reps must be >= 1, --warmup >= 0")
    config = HSTUConfig(**{**HSTU_PRESETS[preset], "num_items": args.num_items})
    records = []
    for kind in kinds:
        rng = np.random.default_rng(args.seed)
        lengths = uih_lengths(kind, args.batch_size, config.max_uih, args.zipf_alpha, rng)
        host_batch = synthetic_batch(lengths, rng.integers(lo, hi + 1, args.batch_size), config, rng)
        for rab in rabs:
            for compiled in compiles:
                records.append(bench_one(args, preset, kind, rab, compiled, host_batch, precision))
                print(table(records[-1:]).splitlines()[1], flush=True)
    print(f"the item table's update: {args.table_update} (--table-update); the residual stream: {args.residual}")
    print(table(records))
    if any(r.breakdown_ms for r in records):
        print(breakdown_table(records))
        for r in records:
            if r.other_kernels_ms:
                print(f"costliest 'other' kernels, rab {_on(r.rab)} compile {_on(r.compiled)} (ms per step):")
                for name, ms in r.other_kernels_ms.items():
                    print(f"  {ms:7.3f}  {name[:110]}")
    for r in records:
        if r.allocator:
            counts = ", ".join(f"{key} {value:.1f}" for key, value in r.allocator.items())
            print(f"rab {_on(r.rab)} compile {_on(r.compiled)}: allocator calls per b2b step: {counts}")
        for gap in r.idle_gaps or []:
            print(f"rab {_on(r.rab)} compile {_on(r.compiled)}: {describe_gap(gap)}")
        if r.host_syncs is not None:
            where = ", ".join(f"{line} x{n}" for line, n in r.host_syncs.items()) or "none"
            print(f"rab {_on(r.rab)} compile {_on(r.compiled)}: synchronizing CUDA calls in one step: {where}")
    for line in gates(records, device):
        print(line)
    if args.json:
        setup = dict(
            device=str(device),
            gpu=torch.cuda.get_device_name(device) if cuda else platform.processor(),
            torch=torch.__version__,
            preset=preset,
            config={k: v for k, v in asdict(config).items() if k not in ("rab", "position_embeddings")},  # per record
            precision=precision,
            table_update=args.table_update,
            residual=args.residual,
            batch_size=args.batch_size,
            zipf_alpha=args.zipf_alpha,
            candidates=[lo, hi],
            seed=args.seed,
            reps=args.reps,
            warmup=args.warmup,
            peak_tflops=args.peak_tflops,
            gates_tflops={_on(rab): list(pair) for rab, pair in GATES_TFLOPS.items()},
            glue_gate=GLUE_GATE,
        )
        with open(args.json, "w") as f:
            json.dump(dict(setup=setup, records=[asdict(r) for r in records]), f, indent=1)
    return 0
