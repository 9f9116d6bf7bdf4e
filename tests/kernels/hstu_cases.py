"""Random jagged HSTU attention cases and the comparison both the interpreted (CPU) and the CUDA tests run: the
Triton kernel against the per-sample twin, output and every gradient (q, k, v and the rab bucket weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.hstu import hstu_attention, hstu_sequences
from kernels.triton.triton_hstu_attention import pair_layout

#: Largest |kernel - twin| over the twin's largest magnitude, per dtype: fp32 runs IEEE matmuls; bf16 rounds the
#: inputs of every matmul (the twin computes in fp32 from the same bf16 inputs).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
POSITION_BUCKETS = 40


@dataclass
class Case:
    lengths: list[int]
    heads: int = 2
    dim: int = 16
    dim_v: int = 16
    targets: Optional[list[int]] = None
    window: int = 0
    rab: bool = False
    ordered_times: bool = True
    time_unit: int = 1  # timestamps in this many ticks a second (1000: milliseconds, gaps beyond int32's range)
    time_buckets: int = 24
    seq_norm: Optional[int] = 64
    dtype: torch.dtype = torch.float32
    deterministic: bool = False  # the Triton kernels at their fixed launch configuration
    recompute: bool = False  # the Triton dQ pass recomputes the scores instead of reading the kept dS
    paired: bool = True  # with rab, the Triton kernels read the batch's precomputed pair buckets
    seed: int = 0


def inputs(case: Case, device) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    n = sum(case.lengths)

    def rand(*shape, scale=0.5):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    gaps = torch.randint(0, 4000, (n,), generator=gen)
    times = (1_700_000_000 + (gaps.cumsum(0) if case.ordered_times else gaps)) * case.time_unit
    return dict(
        offsets=torch.tensor([0, *case.lengths]).cumsum(0),
        q=rand(n, case.heads, case.dim).to(case.dtype),
        k=rand(n, case.heads, case.dim).to(case.dtype),
        v=rand(n, case.heads, case.dim_v).to(case.dtype),
        grad=rand(n, case.heads, case.dim_v, scale=1.0).to(case.dtype),
        position_weights=rand(case.heads, POSITION_BUCKETS) if case.rab else None,
        time_weights=rand(case.heads, case.time_buckets) if case.rab else None,
        timestamps=times.to(device) if case.rab else None,
        num_targets=torch.tensor(case.targets) if case.targets is not None else None,
    )


def _pair_budget(case: Case, offsets: torch.Tensor) -> int:
    """Room for every per-pair tensor, or, for ``recompute``, for the pair buckets (4 bytes a pair: two copies) and
    not the score gradients (heads x 2 or 4 bytes a pair) or the per-pair bias (as large); where those are no
    larger than the buckets, for none of them."""
    if not case.recompute:
        return 1 << 40
    pairs = pair_layout(offsets[1:] - offsets[:-1])[1]
    paired = case.paired and case.heads * torch.finfo(case.dtype).bits // 8 > 4
    return 4 * pairs if paired else 0


def run(case: Case, data: dict, impl: str) -> list[torch.Tensor]:
    """Output and gradients of q, k, v (and the two weight tables with rab), in fp32."""
    leaves = [data[name].detach().clone().requires_grad_() for name in ("q", "k", "v")]
    weights = {}
    if case.rab:
        weights = {name: data[name].detach().clone().requires_grad_() for name in ("position_weights", "time_weights")}
    seqs = hstu_sequences(
        data["offsets"],
        num_targets=data["num_targets"],
        timestamps=data["timestamps"],
        impl=impl,
        device=leaves[0].device,
        pair_budget=_pair_budget(case, data["offsets"]),
        rab_buckets=(POSITION_BUCKETS, case.time_buckets) if case.paired else None,
    )
    out = hstu_attention(
        *leaves,
        seqs,
        alpha=0.4,
        seq_norm=case.seq_norm,
        window=case.window,
        deterministic=case.deterministic,
        **weights,
    )
    out.backward(data["grad"])
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (*leaves, *weights.values())]
    return [out.detach().float()] + [g.float() for g in grads]


def assert_matches_twin(case: Case, device) -> None:
    data = inputs(case, device)
    got, want = run(case, data, "triton"), run(case, data, "torch")
    names = ("out", "dq", "dk", "dv", "d_position_weights", "d_time_weights")
    for name, a, b in zip(names, got, want):
        if not b.numel():
            assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)}, twin's {tuple(b.shape)}"
            continue
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        assert err <= TOLERANCE[case.dtype], f"{name}: relative error {err:.2e} > {TOLERANCE[case.dtype]:.0e} in {case}"
