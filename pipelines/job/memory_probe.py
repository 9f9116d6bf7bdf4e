"""``--memory-budget auto``'s memory model, measured on the job's own model (the softmax model, the HSTU model or a
user's factory's) on its own device, instead of figures measured once on another model.

The balancer's budget (fsdata.partition.budget) caps each rank's kept tokens, ``min(L, max_uih) + candidates`` per
sample, through a line ``peak bytes = fixed_bytes + bytes_per_token * kept tokens`` (``MemoryModel``). Its default
figures are the softmax model's (the replay's probe of its preset ``replay``); a model of another width, depth or
layout needs its own: the HSTU model, for one, puts its candidates into the sequence and holds u, v, q and k of every
token for the backward.

The probe (:func:`probe_memory_model`) runs the job's step without the optimizer, as the trainer runs it (the model's
arguments from the spec's ``inputs``, its attention plan where it takes one, autocast at the job's precision, the
spec's loss, backward), on one and on :data:`PROBE_COPIES` copies of one sample set to ``max_uih`` events
(:func:`equal_length`), and takes the line through the two peaks of allocated bytes, per kept token. It runs before
the embedding wrap swaps the tables, so the full tables' dense gradients count in the fixed part, which a sharded
table does not hold: the budget then errs low by at most that, never high. Training is unchanged by it: the
gradients are dropped, the random streams restored and the device's peak statistics reset.

``auto:bytes_per_token=B`` or ``auto:fixed_bytes=F`` gives figures and nothing is probed; ``auto:headroom=H`` alone
keeps the probe (:func:`measured_budget`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from fsdata.batch import Batch
from fsdata.partition import BudgetSpec, MemoryModel, kept_tokens
from pipelines.api.numerics import autocast, autocast_dtype

if TYPE_CHECKING:  # the balancer's stages and the API's step need torchdata, which the replay benchmark does without
    from fsdata.balancer import BalancerConfig
    from pipelines.api.step import ModelSpec

#: Copies of the sample in the probe's second batch: the line's other point.
PROBE_COPIES = 4
#: The figures of ``auto:key=value`` that replace the probe.
MEASURED_KEYS = ("bytes_per_token", "fixed_bytes")
#: The first samples of the source searched for one with a UIH event (the probe repeats its events).
SEARCHED_SAMPLES = 64

PeakBytes = Callable[[Callable[[], None], torch.device], float]


def equal_length(batch: Batch, length: int) -> Batch:
    """Every sample set to exactly ``length`` UIH events: its most recent ``length`` events, or, when it has fewer,
    its own events repeated from the start to fill (the last event stays last); candidates and the rest are
    unchanged. The probes' batches: every sample as long as the model keeps."""
    if length < 1:
        raise ValueError(f"equal_length: length must be >= 1, got {length}")
    n = batch.batch_size
    uo = batch.uih_offsets.numpy()
    have = uo[1:] - uo[:-1]
    if n and int(have.min()) < 1:
        raise ValueError("equal_length: a sample has no UIH event to repeat")
    sample = np.repeat(np.arange(n, dtype=np.int64), length)
    j = np.tile(np.arange(length, dtype=np.int64), n)
    keep = torch.from_numpy(uo[:-1][sample] + (have[sample] - length + j) % np.maximum(have[sample], 1))
    opt = lambda t: None if t is None else t[keep]  # noqa: E731
    return dataclasses.replace(
        batch,
        uih_offsets=torch.arange(n + 1, dtype=torch.int64) * length,
        uih_item_ids=batch.uih_item_ids[keep],
        uih_action_types=opt(batch.uih_action_types),
        uih_timestamps=opt(batch.uih_timestamps),
    )


def probe_batches(source, length: Optional[int]) -> tuple[Batch, Batch]:
    """One sample of the source (the first of its first samples with a UIH event) set to ``length`` events (None:
    its own), alone and in :data:`PROBE_COPIES` copies."""
    lengths = source.read(0, 0, min(SEARCHED_SAMPLES, source.num_samples(0))).uih_lengths.numpy()
    having = np.flatnonzero(lengths > 0)
    if having.size == 0:
        raise ValueError(
            f"--memory-budget auto: none of the source's first {lengths.size} samples has a UIH event to probe "
            "with; give auto:bytes_per_token=B,fixed_bytes=F"
        )
    first = int(having[0])
    one = equal_length(source.read(0, first, first + 1), length or int(lengths[first]))
    return one, Batch.concat([one] * PROBE_COPIES)


def step_once(spec: "ModelSpec", batch: Batch, device: torch.device, precision: str) -> None:
    """The job's step on ``batch`` without the optimizer: forward (with the attention plan where the spec builds
    one on this device, built before, as the loader builds it), the spec's loss, backward; the gradients dropped."""
    from pipelines.api.step import bce_loss  # here: the API's step needs torchdata (see TYPE_CHECKING above)
    from pipelines.api.wrap import as_args

    model = spec.model
    batch = batch.to(device)
    kwargs = {}
    if spec.plan is not None and device.type == "cuda":
        plan = spec.plan(batch.host_offsets("uih_offsets"), batch.host_offsets("candidate_offsets"))
        kwargs["attention_plan"] = plan.to(device)
    with autocast(autocast_dtype(precision, device), device):
        loss = (spec.loss or bce_loss)(model(*as_args(spec.inputs, batch), **kwargs), batch)
    loss.float().backward()
    model.zero_grad(set_to_none=True)


def cuda_peak_bytes(run: Callable[[], None], device: torch.device) -> float:
    """Peak allocated bytes of ``run()`` on ``device`` above what was allocated before it."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


#: How each device type measures a call's peak bytes (the CPU has no allocator statistics: no probe there).
PEAK_BYTES: dict[str, PeakBytes] = {"cuda": cuda_peak_bytes}


def line_through(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(bytes_per_token, fixed_bytes)`` of the line through two ``(tokens, bytes)`` points: at least one byte
    per token (a noisy pair never gives a free token), the fixed part never below zero."""
    (t1, b1), (t2, b2) = points
    if t2 <= t1:
        raise ValueError(f"line_through: the second point needs more tokens ({t2} <= {t1})")
    per_token = max((b2 - b1) / (t2 - t1), 1.0)
    return per_token, max(b1 - per_token * t1, 0.0)


def probe_memory_model(
    spec: "ModelSpec",
    source,
    device: torch.device,
    precision: str,
    max_uih: Optional[int],
    headroom: float,
    peak_bytes: PeakBytes = cuda_peak_bytes,
) -> MemoryModel:
    """The memory model of ``spec``'s model on ``device`` (module docstring): one untimed step of the sample first
    (the first call of a shape allocates workspaces and, on a GPU, may tune its kernels), then the peaks of one and
    of :data:`PROBE_COPIES` copies."""
    one, many = probe_batches(source, max_uih)
    fork = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):
        step_once(spec, one, device, precision)
        points = []
        for batch in (one, many):
            peak = peak_bytes(lambda batch=batch: step_once(spec, batch, device, precision), device)
            points.append((int(kept_tokens(batch, max_uih).sum()), peak))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the job's reported peak is its training's
    per_token, fixed = line_through(points)
    return MemoryModel(bytes_per_token=per_token, fixed_bytes=fixed, headroom=headroom)


def wants_probe(memory_budget: Optional[str]) -> bool:
    """Whether ``--memory-budget`` asks for the probe: ``auto`` without figures of its own."""
    spec = BudgetSpec.parse(memory_budget)
    if spec is None or spec.auto is None:
        return False
    given = {part.partition("=")[0].strip() for part in str(memory_budget).strip().lower()[5:].split(",")}
    return not given & set(MEASURED_KEYS)


def spelling(model: MemoryModel) -> str:
    """``--memory-budget``'s spelling of a memory model, read back by ``BudgetSpec.parse``."""
    return (
        f"auto:bytes_per_token={model.bytes_per_token!r},fixed_bytes={model.fixed_bytes!r},headroom={model.headroom!r}"
    )


def measured_budget(
    config: "BalancerConfig",
    spec: "ModelSpec",
    source,
    device: torch.device,
    precision: str,
    max_uih: Optional[int],
) -> tuple["BalancerConfig", Optional[MemoryModel]]:
    """``config`` with ``auto``'s figures measured on ``spec``'s model (:func:`probe_memory_model`) where
    :func:`wants_probe` says so and the device measures peaks (:data:`PEAK_BYTES`), and the memory model; else
    ``config`` as it is and None (off a GPU, ``auto`` then refuses in one line where the budget is read).
    ``max_uih`` None (a model that declares no cap): the probe's sample keeps its own length."""
    peak_bytes = PEAK_BYTES.get(torch.device(device).type)
    if peak_bytes is None or not wants_probe(config.memory_budget):
        return config, None
    headroom = BudgetSpec.parse(config.memory_budget).auto.headroom
    model = probe_memory_model(spec, source, torch.device(device), precision, max_uih, headroom, peak_bytes)
    return dataclasses.replace(config, memory_budget=spelling(model)), model
