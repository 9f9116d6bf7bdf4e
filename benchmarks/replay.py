"""`python -m benchmarks replay`: ``freescale simulate`` on step times from the real forward+backward of the
softmax model or the HSTU model (``--step-model replay``, which importing this module adds to the simulator's
STEP_TIME_MODELS).

The cost model of ``pipelines/simulate/simulator.py`` assumes its coefficients; replay measures them. A virtual rank's
busy time is the time of the model's forward, BCE loss and backward on that rank's local batch, timed on
the actual device (``--device cpu|cuda``), one virtual rank after another, so the step time of N virtual ranks is
the max of real measured times. That brings the model's real kernel behaviour into the figures, which the cost
model only approximates. The kernel (``--replay-kernel``) is the model's attention:

* ``jagged``: the model as it trains by default (``SoftmaxConfig.attention = "jagged"``): packed tokens, no padding,
  each sample's causal attention alone (FlexAttention on CUDA, per-sample SDPA on the CPU), so a local batch
  costs about its ``sum L`` tokens and ``sum L^2 / 2`` pairs.
* ``padded``: the model with ``attention = "padded"``: every local batch right-padded to its longest UIH, so
  ``count * max L`` tokens go through the linear layers and its causal, mask-free SDPA (fused kernels, memory
  linear in tokens) computes about ``count * max L^2 / 2`` pairs.

Models (``--replay-model-preset``). ``tiny``, ``small``, ``production`` and ``replay`` are
:class:`pipelines.models.softmax.SoftmaxModel`'s, with either kernel; ``hstu`` and ``hstu-large`` are
:class:`pipelines.models.hstu.HSTUModel`'s (the job's ``--model hstu``), whose attention is jagged only (kernels.hstu:
Triton on CUDA, its PyTorch twin on the CPU). L, in every feature and record (``sequence``), is what the model's
layers run over (:data:`SEQUENCES`): for the softmax model a sample's kept UIH; for the HSTU model its kept UIH
then its candidates, its targets, in one packed sequence. Its step is then ``sum L`` (linear layers) plus its
attention pairs, ``L_u (L_u + 1) / 2`` of the history and ``C (L_u + 1)`` of the C targets, each seeing the history
and itself: ``L^2 / 2 + L / 2 - C (C - 1) / 2``, which the jagged regressors express up to the last term (C is at
most tens, L thousands).

How one batch is timed (:meth:`Timer.measure`). The batch is moved to the device, run once untimed (the first call
of a shape pays SDPA/cuBLAS plan selection and allocator growth), then ``--replay-repeats`` times (default 3), each
call between two device synchronisations; its time is the median. The repeats' relative deviations from that
median (:func:`repeat_deviations`) are the measured run-to-run noise of one call, kept for every timed batch.

Two modes (``--replay-mode``):

* ``direct``: every rank of every simulated step is timed (``ranks x steps`` batches). For CPU checks and small
  settings.
* ``fit`` (default): timing every rank of every step at 64 to 1,024 ranks would take hours, so replay times a few
hundred
  *whole local batches* exactly as the partitioners produce them: the ``none``, ``fbs``, ``vbs`` and ``kk`` plans
  of timing steps of ``--replay-timing-ranks`` ranks (fresh samples, not the simulated ones), their local batches
  in a random order with the partitioners interleaved, until ``--replay-timings`` batches or
  ``--replay-time-budget`` seconds (a batch is not started when the mean wall time of a batch so far would take
  the run past the budget). No batch is cut to a subset: one that would not fit the memory guard (CUDA:
  ``--replay-mem-gib``, from a two-point probe of peak bytes against tokens; any device: ``--replay-max-pairs``)
  is skipped and counted in the record (``n_skipped_too_large``, by partitioner, with examples), and so is a
  batch that runs out of memory (``n_oom``). It then fits the batch medians

      padded kernel:  time ~ c0 + c1*count + c2*sum L + c5*count*max L + c6*count*max L^2
      jagged kernel:  time ~ c0 + c1*count + c2*sum L + c3*sum L^2

  by non-negative least squares on relative errors (every coefficient >= 0: a kernel never gets faster with more
  work), on a random ``1 - --replay-heldout`` of the timed batches (timings more than 8 robust sigmas off the
  first fit dropped and counted), and checks it on the others (held-out R^2, median and p90 relative error; R^2
  measures the errors against the held-out times' own spread, ``heldout_s_rel_std``, which is small when most
  local batches have one shape, as padded ``none``/``fbs``/``kk`` batches at 21,000 do: then read the relative
  errors).
  The padded regressors are the model's work: per step, per sample (heads, the candidates' target attention), per
  real token (embedding lookups and their gradient), per padded token (linear layers, padding), per padded
  causal attention pair. ``sum L^2`` and ``max L`` alone are not a padded kernel's work and are left out, so
  they cannot soak up noise.

Both kernels time each partitioner's whole local batch as it is. A variable-length kernel's time is a sum over
samples, which is what the jagged regressors express.

Jitter (``--replay-jitter``; both may be given, ``residual,repeat``), one relative factor per rank and step,
resampled from a pool:

* ``repeat``: the measured run-to-run noise of one call, the deviations of every timed batch's repeats from their
  median (with k - 1 degrees of freedom: the median's own call left out for odd k). This is the real noise a
  rank's step has; it needs ``--replay-repeats >= 2``.
* ``residual``: the fit's relative residuals on its fit set. They mix the fit's model error with the noise of a
  median of k calls, so they are not a device's noise; they say how far the simulation may be off per rank.

Noise floor (:func:`noise_floor_pct`). Jitter alone leaves a straggler share: even a perfectly balanced step waits
for its unluckiest rank. Each record carries that floor at its rank count (``noise_floor_pct``): the simulator's
straggler % (:func:`straggler_pct`, the same definition) of :data:`NOISE_FLOOR_STEPS` steps whose ranks all have
the same busy time times one factor ``max(1 + e, 0)`` each, drawn from the same pool as the partitioners' jitter
(``noise_floor_rel_std``: its relative std; ``noise_floor_source``: what it is). With ``residual`` jitter the floor
includes the fit's model error; in ``direct`` mode the pool is one call's measured noise, while a simulated rank's
time is a median of the repeats. The table prints ``floor%`` and ``x floor`` (the row's straggler % over it,
``straggler_over_noise_floor`` in the records) at the end of each row, so a balanced figure reads against what the
device's noise allows at that rank count on any machine.

Every figure says what it rests on: :meth:`ReplayStepTime.record` (``n_timings_fit``, ``n_timings_heldout``,
``n_calls_total``, ``timing_wall_s``, ``r2_heldout``, ``median_rel_err_heldout``, ``repeat_rel_std``, the
coefficients, the jitter's source and size) goes into the JSON records when the simulation is run through
:func:`main` (``python -m benchmarks replay``: the flags of ``freescale simulate``, the replay model's and
``--replay-ranks``), and the raw timings of each fit go next to ``--json`` (``*_timings_<kernel>.json``), written
before the fit so they survive a failed one. While timing, a progress line goes to stderr every
:data:`PROGRESS_EVERY_S` seconds.

On CUDA the default precision is bf16 autocast (``--replay-dtype``). Every model preset (``replay``: d=256, 2 layers,
4 heads) keeps the model's ``max_uih`` at the simulation's ``--max-uih``: the straggler effect comes from long
UIH, so it is never cut.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import numpy as np
import torch

from fsdata.batch import Batch, lengths_to_offsets
from fsdata.partition import GatheredLengths, Plan, RuntimeInfo, get_partitioner
from pipelines.job.memory_probe import equal_length, line_through
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.hstu import HSTU_ATTENTION_IMPLS, HSTU_PRESETS, HSTUConfig, HSTUModel
from pipelines.models.softmax import ATTENTION_IMPLS, SOFTMAX_PRESETS, SoftmaxConfig, SoftmaxModel
from pipelines.simulate import simulator

REPLAY_MODEL_PRESETS: dict[str, dict] = {
    **SOFTMAX_PRESETS,
    # The production width is 512 x 4 layers; half of each keeps a few hundred 21,000-token timings within minutes.
    "replay": dict(num_items=1_000_000, dim=256, num_layers=2, num_heads=4),
}
#: The models replay times, by preset: the softmax model (its own presets and ``replay``) and the HSTU model.
REPLAY_MODELS = {**{name: "softmax" for name in REPLAY_MODEL_PRESETS}, **{name: "hstu" for name in HSTU_PRESETS}}
#: What L of a timed batch's sample is, per model (module docstring, "Models").
SEQUENCES = {
    "uih": "each sample's kept UIH (the softmax model's encoder; its candidates attend from the head)",
    "uih+candidates": "each sample's kept UIH then its candidates, the HSTU model's packed sequence",
}
FEATURES = ("const", "count", "sum_L", "sum_L2", "max_L", "count_x_max_L", "count_x_max_L2")
FIT_FEATURES = {  # the regressors of each kernel (module docstring)
    "padded": ("const", "count", "sum_L", "count_x_max_L", "count_x_max_L2"),
    "jagged": ("const", "count", "sum_L", "sum_L2"),
}
TIMING_PARTITIONERS = ("none", "fbs", "vbs", "kk")
KERNELS = tuple(FIT_FEATURES)
JITTERS = ("residual", "repeat")
JITTER_SOURCES = {
    "repeat": "measured run-to-run noise of one call (repeats' deviations from their median)",
    "residual": "the fit's relative residuals (model error + noise of a median of the repeats; not device noise)",
}
FLOOR_SOURCES = {
    "repeat": "one call's measured noise",
    "residual": "the fit's residuals: the floor includes the fit's model error",
    "direct": "one call's measured noise, while a simulated rank's time is a median of the repeats (less noisy)",
}
NOISE_FLOOR_STEPS = 4000  # balanced steps per floor: six seeds' floors at 8-1,024 ranks lie within 2.3% of each other
DEFAULT_REPEATS = 3
PROGRESS_EVERY_S = 10.0


def features(uih_lengths_per_rank: list[np.ndarray]) -> np.ndarray:
    """Regressors [R, 7] of each local batch (UIH lengths after the cap: what the encoder pads)."""
    rows = []
    for lengths in uih_lengths_per_rank:
        length = np.asarray(lengths, dtype=np.float64)
        n = float(length.size)
        longest = float(length.max()) if length.size else 0.0
        rows.append([1.0, n, length.sum(), (length * length).sum(), longest, n * longest, n * longest * longest])
    return np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURES))


def sequence_of(model: Optional[torch.nn.Module]) -> str:
    """The key of :data:`SEQUENCES` that says what L is for ``model``."""
    return "uih+candidates" if isinstance(model, HSTUModel) else "uih"


def sequence_lengths(uih: np.ndarray, num_candidates: np.ndarray, sequence: str) -> np.ndarray:
    """Each sample's L for the features, from its kept UIH length and its candidate count."""
    if sequence not in SEQUENCES:
        raise ValueError(f"replay: unknown sequence {sequence!r}; choose from {sorted(SEQUENCES)}")
    uih = np.asarray(uih, dtype=np.int64)
    return uih + np.asarray(num_candidates, dtype=np.int64) if sequence == "uih+candidates" else uih


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin sum(((x @ c) - y) / y)^2 subject to c >= 0: the best feasible least-squares fit of all 2^k column
    subsets (k <= 7: at most 128 tiny solves). Relative errors, because timings span milliseconds to seconds."""
    if np.any(y <= 0):
        raise ValueError("replay fit: timings must be positive")
    a = x / y[:, None]
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    a = a / scale
    best, best_err = np.zeros(x.shape[1]), np.inf
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], np.ones_like(y), rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((a[:, cols] @ sol - 1.0) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(x.shape[1])
                best[list(cols)] = sol
    return best / scale


def repeat_deviations(times: np.ndarray) -> np.ndarray:
    """Relative deviations of repeated timings of one batch from their median, scaled so that their mean square is
    ``sum (t / median - 1)^2 / (k - 1)`` (k - 1 degrees of freedom, as a sample variance): for odd k the call that
    is the median is left out (its deviation is 0 by construction), for even k all k are kept, times
    sqrt(k / (k - 1)). Empty for k < 2: one call says nothing about the noise."""
    t = np.sort(np.asarray(times, dtype=np.float64))
    k = t.size
    if k < 2:
        return np.zeros(0)
    dev = t / np.median(t) - 1.0
    return np.delete(dev, k // 2) if k % 2 else dev * math.sqrt(k / (k - 1))


def rel_spread(times: np.ndarray) -> float:
    """Run-to-run spread of one batch's repeats: the relative std around their median (nan for one call)."""
    dev = repeat_deviations(times)
    return float(np.sqrt(np.mean(dev * dev))) if dev.size else float("nan")


# ---------------------------------------------------------------------------------------------- noise floor
def straggler_pct(busy: np.ndarray, sync_s: float = 0.0) -> float:
    """The simulator's straggler % of steps whose per-rank busy seconds are the rows of ``busy`` [S, W]: the sum
    over steps of the mean idle wait ``max - busy_r`` over the sum over steps of ``T = max + sync``
    (``pipelines/simulate/simulator.py``'s module docstring)."""
    busy = np.atleast_2d(np.asarray(busy, dtype=np.float64))
    longest = busy.max(axis=1)
    total = float((longest + sync_s).sum())
    return 100.0 * float((longest[:, None] - busy).mean(axis=1).sum()) / total if total > 0 else 0.0


def noise_floor_pct(
    pool: np.ndarray,
    ranks: int,
    rng: np.random.Generator,
    steps: int = NOISE_FLOOR_STEPS,
    busy_s: float = 1.0,
    sync_s: float = 0.0,
) -> float:
    """The straggler % that the jitter alone gives at ``ranks`` ranks: ``steps`` perfectly balanced steps (every
    rank's noise-free busy time the same ``busy_s``), each rank's time times one factor ``max(1 + e, 0)`` drawn
    from ``pool`` with replacement, as the step-time model draws it, then :func:`straggler_pct`. For the same total
    work no plan does better on average (the expected max of independently jittered busy times with a fixed sum is
    smallest when they are equal: it is convex and symmetric in them), so a balanced figure reads against it.
    ``busy_s`` matters only with ``sync_s``."""
    pool = np.asarray(pool, dtype=np.float64)
    if pool.size == 0:
        return 0.0
    factors = np.maximum(1.0 + rng.choice(pool, size=(steps, ranks)), 0.0)
    return straggler_pct(busy_s * factors, sync_s)


def floor_record(pool: np.ndarray, ranks: int, seed: int, busy_s: float, sync_s: float, source: str) -> dict:
    """The noise floor's keys of a record: the floor at ``ranks``, the jitter's size and what it rests on. The
    floor's stream is seeded by ``--seed`` and ``ranks`` only, so every partitioner of one rank count gets the same
    floor; without a sync time to the bit (the busy time, which only a sync time makes matter, is then 1 s for all:
    scaled by each partitioner's own mean busy time, the same floor would round apart)."""
    pool = np.asarray(pool, dtype=np.float64)
    rng = np.random.default_rng([seed, 11, ranks])
    busy_s = busy_s if sync_s else 1.0
    return {
        "noise_floor_pct": noise_floor_pct(pool, ranks, rng, busy_s=busy_s, sync_s=sync_s),
        "noise_floor_rel_std": float(np.sqrt(np.mean(pool * pool))) if pool.size else 0.0,
        "noise_floor_n_values": int(pool.size),
        "noise_floor_steps": NOISE_FLOOR_STEPS,
        "noise_floor_source": source,
    }


def over_floor(record: dict) -> Optional[float]:
    """A record's straggler % over its noise floor (None where there is no floor: no jitter, or none measured)."""
    floor = record.get("noise_floor_pct")
    return record["straggler_pct"] / floor if floor else None


# ---------------------------------------------------------------------------------------------- batches
def select(batch: Batch, idx: np.ndarray) -> Batch:
    """The samples ``idx`` of ``batch``, in that order (vectorized jagged gather)."""
    from fsdata.synthetic import segment_arange

    idx = torch.as_tensor(np.asarray(idx, dtype=np.int64))
    uo, co, xo = batch.uih_offsets, batch.candidate_offsets, batch.content_offsets
    uih = torch.from_numpy(segment_arange(uo[:-1][idx].numpy(), (uo[1:] - uo[:-1])[idx].numpy()))
    cand = torch.from_numpy(segment_arange(co[:-1][idx].numpy(), (co[1:] - co[:-1])[idx].numpy()))
    content = torch.from_numpy(segment_arange(xo[:-1][cand].numpy(), (xo[1:] - xo[:-1])[cand].numpy()))
    opt = lambda t, i: None if t is None else t[i]  # noqa: E731
    return Batch(
        sample_ids=batch.sample_ids[idx],
        user_ids=batch.user_ids[idx],
        uih_offsets=lengths_to_offsets((uo[1:] - uo[:-1])[idx]),
        uih_item_ids=batch.uih_item_ids[uih],
        candidate_offsets=lengths_to_offsets((co[1:] - co[:-1])[idx]),
        candidate_labels=batch.candidate_labels[cand],
        content_offsets=lengths_to_offsets((xo[1:] - xo[:-1])[cand]),
        content_ids=batch.content_ids[content],
        dense=batch.dense[idx],
        uih_action_types=opt(batch.uih_action_types, uih),
        uih_timestamps=opt(batch.uih_timestamps, uih),
    )


# ---------------------------------------------------------------------------------------------- timing
class Timer:
    """Times forward + BCE loss + backward of the model on one local batch, device-synchronised around each
    call. ``calls`` counts every forward+backward it ran (warm-ups and memory probes included)."""

    def __init__(self, model: Union[SoftmaxModel, HSTUModel, None], device: torch.device, dtype: str) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.sequence = sequence_of(model)
        self.calls = 0
        self.last_peak_bytes: Optional[float] = None  # CUDA: peak above the allocation before the last measure()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _call(self, batch: Batch, plan=None) -> float:
        """One forward+backward of a batch already on the device, with its attention plan (if its kernel takes
        one) built beforehand; its seconds."""
        self.model.zero_grad(set_to_none=True)
        self._sync()
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
            logits = self.model(batch) if plan is None else self.model(batch, plan)
            loss = binary_cross_entropy_sum(logits.float(), batch.candidate_labels)
        loss.backward()
        self._sync()
        self.calls += 1
        return time.perf_counter() - start

    def lengths(self, batch: Batch) -> np.ndarray:
        """The batch's L per sample, as the timed model sees them (:data:`SEQUENCES`)."""
        return sequence_lengths(batch.uih_lengths.numpy(), batch.num_candidates.numpy(), self.sequence)

    def _plan(self, batch: Batch):
        """The batch's attention plan, on the device, where the model's kernel takes one (FlexAttention's block
        masks), else None. Training builds it in the loader's worker a batch ahead and copies it with the batch,
        so it is built here before the timed calls, never inside one."""
        if not self.model.needs_plan(self.device):
            return None
        plan = self.model.plan_function()(batch.host_offsets("uih_offsets"), batch.host_offsets("candidate_offsets"))
        return plan.to(self.device)

    def measure(self, batch: Batch, repeats: int) -> np.ndarray:
        """One untimed warm-up call of this exact shape, then ``repeats`` timed calls: their seconds, in order.
        What the loader prepares ahead in training (the copy to the device, the attention plan) is prepared
        before the first call."""
        batch = batch.to(self.device)
        plan = self._plan(batch)
        cuda = self.device.type == "cuda"
        if cuda:
            self.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._call(batch, plan)
        times = np.array([self._call(batch, plan) for _ in range(repeats)], dtype=np.float64)
        if cuda:
            self.last_peak_bytes = float(torch.cuda.max_memory_allocated(self.device) - base)
        return times


@dataclass
class MemoryGuard:
    """Which timed batches may run: ``fixed + per_token * tokens <= limit`` (CUDA, from a probe) and
    ``pairs <= max_pairs`` (``--replay-max-pairs``): for the padded kernel ``tokens = count * max L`` and
    ``pairs = count * max L^2``, for the jagged one ``sum L`` and ``sum L^2``."""

    limit_bytes: float = math.inf
    fixed_bytes: float = 0.0
    per_token_bytes: float = 0.0
    max_pairs: float = math.inf
    kernel: str = "padded"

    def token_cap(self) -> float:
        return (self.limit_bytes - self.fixed_bytes) / self.per_token_bytes if self.per_token_bytes > 0 else math.inf

    def work(self, x: np.ndarray) -> tuple[float, float]:
        """(tokens, attention pairs) the kernel computes for a batch with features ``x``."""
        names = ("count_x_max_L", "count_x_max_L2") if self.kernel == "padded" else ("sum_L", "sum_L2")
        return x[FEATURES.index(names[0])], x[FEATURES.index(names[1])]

    def refuses(self, x: np.ndarray) -> Optional[str]:
        """Why a batch with features ``x`` may not run, or None."""
        tokens, pairs = self.work(x)
        if tokens > self.token_cap():
            return (
                f"memory: {tokens:.4g} {self.kernel} tokens need about "
                f"{(self.fixed_bytes + self.per_token_bytes * tokens) / 2**30:.1f} GiB > {self.limit_bytes / 2**30:.1f}"
            )
        if pairs > self.max_pairs:
            return f"--replay-max-pairs: {pairs:.4g} {self.kernel} attention pairs > {self.max_pairs:.4g}"
        return None

    @classmethod
    def probe(
        cls, timer: Timer, batch: Batch, length: int, limit_gib: float, max_pairs: float, kernel: str = "padded"
    ) -> "MemoryGuard":
        """CUDA: peak bytes of one and of four copies of a sample set to ``length`` events; the line through the
        two points gives fixed and per-token bytes, a token being one of L (:data:`SEQUENCES`: the HSTU model's
        candidates count) (activations are linear in tokens: neither kernel holds a mask of pairs; on equal lengths
        both kernels see the same tokens). Elsewhere only ``max_pairs`` applies."""
        guard = cls(max_pairs=max_pairs, kernel=kernel)
        if timer.device.type != "cuda":
            return guard
        points = []
        for k in (1, 4):
            probe = equal_length(select(batch, np.zeros(k, dtype=np.int64)), length)
            timer.measure(probe, repeats=0)
            points.append((float(timer.lengths(probe).sum()), timer.last_peak_bytes))
        per_token, fixed = line_through(points)
        return cls(limit_gib * 2**30, fixed, per_token, max_pairs, kernel)


def timing_batches(args: argparse.Namespace, source, rng: np.random.Generator) -> Iterator[tuple[str, int, int, Batch]]:
    """Endless ``(partitioner, step, rank, local batch)``: the whole local batches of the ``none``/``fbs``/``vbs``/
    ``kk`` plans of timing steps of ``--replay-timing-ranks`` ranks, in a random rank order per partitioner with
    the partitioners interleaved (a budget cut leaves each about the same number). Each local batch is exactly
    ``plan.rank_samples(rank)`` of that step, in the plan's order."""
    w, b = args.replay_timing_ranks, args.batch_size
    parts = {name: get_partitioner(name, alpha=args.alpha) for name in TIMING_PARTITIONERS}
    for step in itertools.count():
        lo, hi = step * w * b, (step + 1) * w * b
        sizes = source.lengths(0, lo, hi)
        lengths = GatheredLengths(
            sizes["uih_lengths"],
            sizes["num_candidates"],
            sizes["candidate_lengths"],
            np.arange(w * b),
            np.arange(w + 1) * b,
            w,
        )
        batch = source.read(0, lo, hi)
        plans = {name: parts[name](lengths, RuntimeInfo(step=step)) for name in TIMING_PARTITIONERS}
        ranks = {name: rng.permutation(w) for name in TIMING_PARTITIONERS}
        for i in range(w):
            for j in rng.permutation(len(TIMING_PARTITIONERS)):
                name = TIMING_PARTITIONERS[j]
                rank = int(ranks[name][i])
                yield name, step, rank, select(batch, plans[name].rank_samples(rank).numpy())


def _trim(x: np.ndarray, y: np.ndarray, cols: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Fit, drop timings more than 8 robust sigmas (MAD) above or below the fit (a shared machine's hiccups),
    refit. Returns the coefficients and the mask of kept timings."""
    coef = np.zeros(x.shape[1])
    coef[cols] = fit_nonnegative(x[:, cols], y)
    rel = y / np.maximum(x @ coef, 1e-12) - 1.0
    mad = 1.4826 * np.median(np.abs(rel - np.median(rel)))
    keep = np.abs(rel - np.median(rel)) <= max(8 * mad, 0.05)
    if not keep.all() and keep.sum() >= len(cols) + 1:
        coef = np.zeros(x.shape[1])
        coef[cols] = fit_nonnegative(x[keep][:, cols], y[keep])
    return coef, keep


class ReplayFitError(ValueError):
    """Too few batches could be timed for a fit: :func:`main` records it and goes on with the next kernel."""


@dataclass
class Fit:
    coefficients: np.ndarray
    residuals: np.ndarray  # relative residuals y / pred - 1 of the fit set: jitter "residual"
    info: dict = field(default_factory=dict)
    repeats: np.ndarray = field(
        default_factory=lambda: np.zeros(0)
    )  # repeat_deviations of every batch: jitter "repeat"
    timings: list = field(default_factory=list)  # one dict per timed batch (the *_timings_<kernel>.json file)
    sequence: str = "uih"  # what L is (SEQUENCES): the features of a plan's local batches are computed alike

    def predict(self, x: np.ndarray) -> np.ndarray:
        return x @ self.coefficients

    @property
    def d(self) -> float:
        """Fixed seconds per rank and step (the intercept): simulate's lower bound adds it to every rank."""
        return float(self.coefficients[0])


class ReplayStepTime:
    """Mode fit: ``step_time(lengths, plan) -> [W]`` busy seconds predicted by a :class:`Fit`, times one resampled
    relative jitter per rank and step (``jitter``: see the module docstring). Its record carries the noise floor of
    that jitter at the rank count it ran (:func:`floor_record`, balanced busy time = the run's mean predicted one,
    which matters only with ``sync_s``)."""

    def __init__(self, fit: Fit, seed: int, jitter: str = "residual", sync_s: float = 0.0) -> None:
        if jitter not in JITTERS:
            raise ValueError(f"--replay-jitter {jitter!r}: choose from {JITTERS}")
        if jitter == "repeat" and fit.repeats.size < 2:
            raise ValueError(
                f"--replay-jitter repeat: only {fit.repeats.size} deviations of repeated timings; "
                "time with --replay-repeats >= 2"
            )
        self.fit, self.jitter = fit, jitter
        self.noise = fit.residuals if jitter == "residual" else fit.repeats
        self.params = fit  # simulate reads params.d as the fixed per-rank cost of the lower bound
        self.seed, self.sync_s = seed, sync_s
        self.rng = np.random.default_rng([seed, 11])
        self.ranks, self.busy_means = 0, []  # the world size and each step's mean noise-free busy, for the floor

    def __call__(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        seq = gathered_lengths(lengths, self.fit.sequence)
        busy = self.fit.predict(features([seq[plan.rank_samples(r).numpy()] for r in range(plan.world_size)]))
        self.ranks = plan.world_size
        self.busy_means.append(float(busy.mean()))
        if self.noise.size:
            busy = busy * np.maximum(1.0 + self.rng.choice(self.noise, size=busy.size), 0.0)
        return busy

    def sample_costs(self, lengths: GatheredLengths) -> np.ndarray:
        """Seconds a sample adds alone on a rank, without the fixed intercept (for the lower bound)."""
        length = gathered_lengths(lengths, self.fit.sequence).astype(np.float64)
        x = np.stack([np.zeros_like(length), np.ones_like(length), length, length**2, length, length, length**2], 1)
        return self.fit.predict(x)

    def record(self) -> dict:
        """What the figures rest on, for the JSON records."""
        noise = self.noise
        floor = {}
        if self.ranks:
            busy = float(np.mean(self.busy_means))
            floor = floor_record(noise, self.ranks, self.seed, busy, self.sync_s, FLOOR_SOURCES[self.jitter])
        return {
            **self.fit.info,
            "jitter": self.jitter,
            "jitter_source": JITTER_SOURCES[self.jitter],
            "jitter_rel_std": float(np.sqrt(np.mean(noise * noise))) if noise.size else 0.0,
            "n_jitter_values": int(noise.size),
            **floor,
        }

    def describe(self) -> str:
        return f"replay({self.record()})"


def gathered_lengths(lengths: GatheredLengths, sequence: str) -> np.ndarray:
    """Every gathered sample's L (:data:`SEQUENCES`)."""
    return sequence_lengths(lengths.uih_lengths.numpy(), lengths.num_candidates.numpy(), sequence)


class DirectStepTime:
    """Mode direct: every rank of every step timed for real (``n_timings_sim`` counts them). Its noise floor draws
    one call's noise: the repeats' deviations measured so far in this setting, every partitioner's run included."""

    def __init__(self, direct: "_Direct", seed: int = 0, sync_s: float = 0.0) -> None:
        self.direct, self.seed, self.sync_s = direct, seed, sync_s
        self.n_timings_sim = 0
        self.ranks, self.busy_means = 0, []

    def __call__(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        self.n_timings_sim += plan.world_size
        busy = np.array([self.direct.time(lengths, plan.rank_samples(r).numpy()) for r in range(plan.world_size)])
        self.ranks = plan.world_size
        self.busy_means.append(float(busy.mean()))
        return busy

    def record(self) -> dict:
        pool = np.concatenate(self.direct.deviations) if self.direct.deviations else np.zeros(0)
        floor = {}
        if self.ranks:
            busy = float(np.mean(self.busy_means))
            floor = floor_record(pool, self.ranks, self.seed, busy, self.sync_s, FLOOR_SOURCES["direct"])
        return {
            **self.direct.info,
            "n_timings_sim": self.n_timings_sim,
            "n_calls_total": self.direct.timer.calls,
            "repeat_rel_std": float(np.sqrt(np.mean(pool * pool))) if pool.size else float("nan"),
            **floor,
        }

    def describe(self) -> str:
        return f"replay({self.record()})"


class _Direct:
    """Mode direct: reads each rank's real samples from the same synthetic source the simulator draws from."""

    def __init__(self, source, timer: Timer, guard: MemoryGuard, repeats: int, info: dict) -> None:
        self.source, self.timer, self.guard, self.repeats, self.info = source, timer, guard, repeats, info
        self.deviations: list[np.ndarray] = []
        self._cached: tuple[int, int, Optional[Batch]] = (-1, -1, None)

    def time(self, lengths: GatheredLengths, idx: np.ndarray) -> float:
        ids = lengths.sample_ids.numpy()
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if self._cached[:2] != (lo, hi):
            self._cached = (lo, hi, self.source.read(0, lo, hi))
        uih = lengths.uih_lengths.numpy()[idx]
        refused = self.guard.refuses(features([gathered_lengths(lengths, self.timer.sequence)[idx]])[0])
        if refused:
            raise ValueError(
                f"replay direct: a local batch of {uih.size} samples up to {uih.max()} events does not "
                f"fit ({refused}); use --replay-mode fit"
            )
        local = select(self._cached[2], ids[idx] - lo)
        if not np.array_equal(local.uih_lengths.numpy(), uih):
            raise ValueError(
                "replay direct: the simulated lengths are not those of the synthetic source's samples "
                f"{ids[idx][:4].tolist()}...; direct mode needs the same --preset, --seed and --max-uih"
            )
        times = self.timer.measure(local, self.repeats)
        self.deviations.append(repeat_deviations(times))
        return float(np.median(times))


# ---------------------------------------------------------------------------------------------- building
def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    return torch.device(args.device)


def _source(args: argparse.Namespace, num_samples: int, seed: int):
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    if getattr(args, "data", None):
        raise ValueError("--step-model replay draws real samples from a synthetic --preset; --data is not supported")
    return SyntheticSource(
        SyntheticConfig.from_preset(args.preset, uih_cap=args.max_uih, num_samples=num_samples, seed=seed)
    )


def _sizes(args: argparse.Namespace) -> dict:
    """The preset's sizes with the ``--replay-dim/-layers/-heads/-head-dim`` overrides."""
    if args.replay_model_preset not in REPLAY_MODELS:
        raise ValueError(f"--replay-model-preset {args.replay_model_preset!r}: choose from {sorted(REPLAY_MODELS)}")
    hstu = REPLAY_MODELS[args.replay_model_preset] == "hstu"
    sizes = dict((HSTU_PRESETS if hstu else REPLAY_MODEL_PRESETS)[args.replay_model_preset])
    overrides = (("dim", "replay_dim"), ("num_layers", "replay_layers"), ("num_heads", "replay_heads"))
    for key, flag in overrides + ((("head_dim", "replay_head_dim"),) if hstu else ()):
        if getattr(args, flag, None) is not None:
            sizes[key] = getattr(args, flag)
    return sizes


def _config(args: argparse.Namespace, shape: dict) -> Union[SoftmaxConfig, HSTUConfig]:
    """The timed model's config: the softmax model's (its attention ``--replay-kernel``) or, for an HSTU preset,
    the HSTU model's; ``shape``: the data's label and dense widths. max_uih follows the simulation: a model preset's
    shorter cap would hide the long-UIH stragglers."""
    values = {**_sizes(args), **shape, "max_uih": args.max_uih}
    impl = getattr(args, "replay_attention_impl", None)
    if REPLAY_MODELS[args.replay_model_preset] == "hstu":
        return HSTUConfig(**values, attention_impl=impl)
    return SoftmaxConfig(**values, attention=args.replay_kernel, attention_impl=impl)


def _model(args: argparse.Namespace, source, device: torch.device) -> Union[SoftmaxModel, HSTUModel]:
    """The timed model (:func:`_config`), shaped by the source's labels and dense width."""
    config = _config(args, {"num_labels": source.config.num_labels, "dense_dim": source.config.dense_dim})
    torch.manual_seed(args.seed)
    return (HSTUModel if isinstance(config, HSTUConfig) else SoftmaxModel)(config).to(device)


def _dtype(args: argparse.Namespace) -> str:
    return args.replay_dtype if args.replay_dtype != "auto" else ("bf16" if args.device == "cuda" else "fp32")


def _repeats(args: argparse.Namespace) -> int:
    """``--replay-repeats``, or its default where the caller's namespace lacks it."""
    repeats = getattr(args, "replay_repeats", None)
    return DEFAULT_REPEATS if repeats is None else repeats


def _max_pairs(args: argparse.Namespace) -> float:
    return float(args.replay_max_pairs) if args.replay_max_pairs else math.inf


_CACHE: dict[tuple, object] = {}


def _key(args: argparse.Namespace) -> tuple:
    names = (
        "device",
        "preset",
        "max_uih",
        "batch_size",
        "seed",
        "alpha",
        "replay_model_preset",
        "replay_dim",
        "replay_layers",
        "replay_heads",
        "replay_head_dim",
        "replay_attention_impl",
        "replay_kernel",
        "replay_timings",
        "replay_heldout",
        "replay_mode",
        "replay_dtype",
        "replay_mem_gib",
        "replay_time_budget",
        "replay_timing_ranks",
        "replay_max_pairs",
    )
    direct = ("ranks", "steps", "warmup") if args.replay_mode == "direct" else ()  # a fit serves every rank count
    return tuple(getattr(args, n, None) for n in names + direct) + (_repeats(args),)


def timings_path(json_path: str, kernel: str) -> str:
    """Where the raw timings of a fit go: next to ``--json``."""
    return f"{os.path.splitext(json_path)[0]}_timings_{kernel}.json"


def _write_timings(args: argparse.Namespace, info: dict, rows: list[dict]) -> None:
    if getattr(args, "json", None):
        with open(timings_path(args.json, args.replay_kernel), "w") as f:
            json.dump({"info": info, "timings": rows}, f, indent=1)


def _progress(kernel: str, rows: list[dict], skipped: list[dict], calls: int, elapsed: float, args) -> None:
    last = rows[-1] if rows else None
    tail = (
        (
            f"; last {last['partitioner']} count {last['count']} max L {last['max_L']}: "
            f"{1e3 * last['median_s']:.1f} ms, spread {last['rel_spread']:.2%}"
        )
        if last
        else ""
    )
    print(
        f"replay timing ({kernel}): {len(rows)}/{args.replay_timings} batches, {calls} calls, "
        f"{elapsed:.0f}/{args.replay_time_budget:.0f} s, {len(skipped)} skipped{tail}",
        file=sys.stderr,
        flush=True,
    )


def _announce(args: argparse.Namespace, guard: "MemoryGuard", repeats: int) -> None:
    kernel, cap = args.replay_kernel, guard.token_cap()
    print(
        f"replay timing ({kernel}): whole local batches of {args.replay_timing_ranks}-rank plans, 1 warm-up + "
        f"{repeats} timed calls each, up to {args.replay_timings} batches or {args.replay_time_budget:.0f} s"
        + (
            f"; memory probe {guard.per_token_bytes / 1024:.1f} KiB per {kernel} token + "
            f"{guard.fixed_bytes / 2**30:.2f} "
            f"GiB: at most {cap:.4g} tokens in {args.replay_mem_gib} GiB"
            if math.isfinite(cap)
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )


def _refuse_from_now_on(guard: "MemoryGuard", timer: "Timer", x: np.ndarray, shape: dict, kernel: str) -> None:
    """After an out-of-memory error on batch features ``x``: the probe under-estimated this shape, so the guard
    refuses this many tokens and more from now on; the failed call's memory is given back."""
    guard.limit_bytes = min(guard.limit_bytes, guard.fixed_bytes + 0.95 * guard.per_token_bytes * guard.work(x)[0])
    timer.model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    print(
        f"replay timing ({kernel}): out of memory on {shape}; the cap is now {guard.token_cap():.4g} tokens",
        file=sys.stderr,
        flush=True,
    )


def _time_batches(
    args: argparse.Namespace, timer: "Timer", guard: "MemoryGuard", jobs, started: float
) -> tuple[list[dict], list[dict], list[dict]]:
    """Times the whole local batches ``jobs`` yields, one warm-up and ``--replay-repeats`` calls each, until
    ``--replay-timings`` of them or the time budget; batches the memory guard refuses, and those that run out of
    memory, are recorded apart. Returns (timed rows, skipped, out of memory)."""
    kernel, repeats = args.replay_kernel, _repeats(args)
    rows: list[dict] = []
    skipped: list[dict] = []
    ooms: list[dict] = []
    batch_walls: list[float] = []
    printed = started
    _announce(args, guard, repeats)
    while True:
        elapsed = time.perf_counter() - started
        next_end = elapsed + (np.mean(batch_walls) if batch_walls else 0.0)  # when the next batch would end
        if len(rows) >= args.replay_timings or next_end > args.replay_time_budget:
            break
        if not rows and len(skipped) >= 4 * len(TIMING_PARTITIONERS) * args.replay_timing_ranks:
            break  # four timing steps and nothing fits: the error below says so
        if time.perf_counter() - printed >= PROGRESS_EVERY_S:
            _progress(kernel, rows, skipped, timer.calls, elapsed, args)
            printed = time.perf_counter()
        name, step, rank, local = next(jobs)
        if local.batch_size == 0:
            skipped.append({"partitioner": name, "step": step, "rank": rank, "count": 0, "reason": "empty"})
            continue
        x = features([timer.lengths(local)])[0]
        shape = {
            "partitioner": name,
            "step": step,
            "rank": rank,
            "count": int(x[1]),
            "max_L": int(x[4]),
            "tokens": int(x[5]),
        }
        refused = guard.refuses(x)
        if refused:
            skipped.append({**shape, "reason": refused})
            if len(skipped) <= 5:  # the record counts them all
                print(
                    f"replay timing ({kernel}): skipped a whole local batch {shape}: {refused}",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        t0 = time.perf_counter()
        try:
            times = timer.measure(local, repeats)
        except torch.cuda.OutOfMemoryError:
            times = None
        if times is None:  # outside the except block, so the failed call's tensors are freed first
            ooms.append(shape)
            _refuse_from_now_on(guard, timer, x, shape, kernel)
            continue
        batch_walls.append(time.perf_counter() - t0)
        rows.append(
            {
                **shape,
                "sum_L": float(x[2]),
                "sum_L2": float(x[3]),
                "local_max_L": int(x[4]),  # the whole local batch is timed: its figures are the local ones
                "local_sum_L": float(x[2]),
                "local_sum_L2": float(x[3]),
                "times_s": times.tolist(),
                "median_s": float(np.median(times)),
                "rel_spread": rel_spread(times),
                "peak_gib": None if timer.last_peak_bytes is None else timer.last_peak_bytes / 2**30,
            }
        )
    return rows, skipped, ooms


@dataclass
class _Regression:
    """A fit of the timed batches: features ``x`` and median times ``y`` of every batch, the coefficients, which
    of the fit's batches were kept (``keep``, over ``fit_idx``), the held-out batches, the kept relative
    residuals, the repeats' deviations from their medians (``pool``) and each batch's spread."""

    x: np.ndarray
    y: np.ndarray
    coef: np.ndarray
    keep: np.ndarray
    fit_idx: np.ndarray
    held: np.ndarray
    residuals: np.ndarray
    pool: np.ndarray
    spreads: np.ndarray


def _fit_info(args, model, timer, guard, rows, skipped, ooms, wall, fit: _Regression) -> dict:
    """What a fit rests on, for the records (see the module docstring)."""
    kernel, device, dtype = args.replay_kernel, timer.device, timer.dtype
    x, y, coef, keep, fit_idx, held = fit.x, fit.y, fit.coef, fit.keep, fit.fit_idx, fit.held
    residuals, pool, spreads = fit.residuals, fit.pool, fit.spreads
    n, repeats, n_held = len(rows), _repeats(args), int(held.size)
    pred, truth = x[held] @ coef, y[held]
    rel_err = np.abs(pred - truth) / truth
    ss_res, ss_tot = float(np.sum((truth - pred) ** 2)), float(np.sum((truth - truth.mean()) ** 2))
    nan = float("nan")
    return {
        "replay_mode": "fit",
        "replay_kernel": kernel,
        "replay_model": REPLAY_MODELS[args.replay_model_preset],
        "sequence": timer.sequence,  # what L is in every figure below
        "sequence_is": SEQUENCES[timer.sequence],
        "timed_unit": "whole local batch, padded to its longest UIH"
        if kernel == "padded"
        else "whole local batch, jagged (no padding)",
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": dtype,
        "model_config": dataclasses.asdict(model.config),
        "replay_repeats": repeats,
        "n_timings_fit": int(fit_idx.size),
        "n_timings_heldout": int(n_held),
        "n_timings_fit_outliers_dropped": int((~keep).sum()),
        "n_batches_timed": n,
        "n_calls_timed": n * repeats,
        "n_calls_total": timer.calls,  # timed + one warm-up per batch + memory probes + batches that ran out of memory
        "timing_steps": int(max(r["step"] for r in rows)) + 1,
        "timing_ranks": args.replay_timing_ranks,
        "timings_by_partitioner": {p: sum(r["partitioner"] == p for r in rows) for p in TIMING_PARTITIONERS},
        "n_skipped_too_large": sum(s.get("reason") != "empty" for s in skipped),
        "n_skipped_empty": sum(s.get("reason") == "empty" for s in skipped),
        "skipped_by_partitioner": {p: sum(s["partitioner"] == p for s in skipped) for p in TIMING_PARTITIONERS},
        "skipped_examples": skipped[:5],
        "n_oom": len(ooms),
        "n_subset_batches": 0,  # never: a batch is timed whole or skipped
        "timing_s_total": float(sum(sum(r["times_s"]) for r in rows)),
        "timing_wall_s": wall,
        "timed_count_range": [int(x[:, 1].min()), int(x[:, 1].max())],
        "timed_max_L_range": [int(x[:, 4].min()), int(x[:, 4].max())],
        "timed_tokens_range": [int(x[:, 5].min()), int(x[:, 5].max())],
        "timed_s_range": [float(y.min()), float(y.max())],
        "peak_gib_max": max((r["peak_gib"] for r in rows if r["peak_gib"] is not None), default=None),
        "token_cap": None if not math.isfinite(guard.token_cap()) else float(guard.token_cap()),
        "bytes_per_token": guard.per_token_bytes or None,
        "fixed_bytes": guard.fixed_bytes or None,
        "fit_features": list(FIT_FEATURES[kernel]),
        "coefficients": dict(zip(FEATURES, map(float, coef))),
        "r2_heldout": 1.0 - ss_res / ss_tot if ss_tot > 0 else nan,
        "median_rel_err_heldout": float(np.median(rel_err)),
        "p90_rel_err_heldout": float(np.quantile(rel_err, 0.9)),
        "heldout_s_rel_std": float(truth.std() / truth.mean()),  # R^2 compares the errors with this spread
        "n_timings_repeat": int(np.isfinite(spreads).sum()),  # batches whose run-to-run spread was measured
        "repeat_rel_std": float(np.sqrt(np.mean(pool * pool))) if pool.size else nan,
        "repeat_rel_spread_median": float(np.nanmedian(spreads)) if pool.size else nan,
        "repeat_rel_spread_p90": float(np.nanquantile(spreads, 0.9)) if pool.size else nan,
        "repeat_rel_spread_max": float(np.nanmax(spreads)) if pool.size else nan,
        "n_jitter_residuals": int(residuals.size),
        "n_jitter_repeats": int(pool.size),
        "jitter_rel_std_fit": float(np.sqrt(np.mean(residuals * residuals))),
        "jitter_rel_p5_p95_fit": [float(np.quantile(residuals, 0.05)), float(np.quantile(residuals, 0.95))],
    }


def build_fit(args: argparse.Namespace) -> Fit:
    """Times whole local batches (``--replay-timings`` of them, or as many as ``--replay-time-budget`` allows), each
    one warm-up plus ``--replay-repeats`` calls; fits their medians; checks the fit on held-out batches."""
    device, dtype, kernel, repeats = _device(args), _dtype(args), args.replay_kernel, _repeats(args)
    source = _source(args, num_samples=10**9, seed=args.seed + 1_000)  # fresh samples, not the simulated ones
    model = _model(args, source, device)
    timer = Timer(model, device, dtype)
    rng = np.random.default_rng([args.seed, 3])
    started = time.perf_counter()
    guard = MemoryGuard.probe(timer, source.read(0, 0, 1), args.max_uih, args.replay_mem_gib, _max_pairs(args), kernel)
    rows, skipped, ooms = _time_batches(args, timer, guard, timing_batches(args, source, rng), started)
    wall = time.perf_counter() - started
    _progress(kernel, rows, skipped, timer.calls, wall, args)
    n = len(rows)
    context = {
        "replay_kernel": kernel,
        "device": str(device),
        "dtype": dtype,
        "replay_repeats": repeats,
        "timing_wall_s": wall,
        "skipped": skipped,
        "oom": ooms,
    }
    _write_timings(args, context, rows)  # before the fit: the raw timings survive a failed one
    cols = [FEATURES.index(f) for f in FIT_FEATURES[kernel]]
    n_held = int(round(n * args.replay_heldout))
    if n - n_held < len(cols) + 2 or n_held < 2:
        raise ReplayFitError(
            f"replay: only {n} whole local batches timed within --replay-time-budget "
            f"{args.replay_time_budget}s ({len(skipped)} skipped as too large, {len(ooms)} out of memory); "
            f"the fit needs {len(cols) + 2} plus at least 2 held out"
        )
    x = np.array(
        [
            [1.0, r["count"], r["sum_L"], r["sum_L2"], r["max_L"], r["tokens"], r["count"] * float(r["max_L"]) ** 2]
            for r in rows
        ]
    )
    y = np.array([r["median_s"] for r in rows])
    order = rng.permutation(n)
    held, fit_idx = order[:n_held], order[n_held:]
    coef, keep = _trim(x[fit_idx], y[fit_idx], cols)
    residuals = (y[fit_idx] / np.maximum(x[fit_idx] @ coef, 1e-12) - 1.0)[keep]
    pool = np.concatenate([repeat_deviations(r["times_s"]) for r in rows])
    spreads = np.array([r["rel_spread"] for r in rows])
    held_set = set(held.tolist())
    for i, row in enumerate(rows):
        row["heldout"] = i in held_set
        row["predicted_s"] = float(x[i] @ coef)
    for i, kept in zip(fit_idx, keep):
        rows[i]["outlier_dropped"] = not bool(kept)
    fit = _Regression(x, y, coef, keep, fit_idx, held, residuals, pool, spreads)
    info = _fit_info(args, model, timer, guard, rows, skipped, ooms, wall, fit)
    _write_timings(args, {**context, **{k: v for k, v in info.items() if k != "model_config"}}, rows)
    print(
        f"replay fit ({kernel} kernel): {n} whole local batches x {repeats} repeats in {wall:.0f} s, held-out R^2 "
        f"{info['r2_heldout']:.4f}, median rel err {info['median_rel_err_heldout']:.4f}, run-to-run spread "
        f"{info['repeat_rel_std']:.4f}",
        file=sys.stderr,
        flush=True,
    )
    return Fit(coef, residuals, info, repeats=pool, timings=rows, sequence=timer.sequence)


def _check(args: argparse.Namespace) -> None:
    """Every replay flag, before anything is timed (a bad flag must not cost device time)."""
    if args.replay_mode not in ("fit", "direct"):
        raise ValueError(f"--replay-mode must be 'fit' or 'direct', got {args.replay_mode!r}")
    if args.replay_timings < 1 or not 0.0 < args.replay_heldout < 1.0 or args.replay_timing_ranks < 1:
        raise ValueError("need --replay-timings >= 1, 0 < --replay-heldout < 1, --replay-timing-ranks >= 1")
    if not args.replay_time_budget > 0 or not args.replay_mem_gib > 0:
        raise ValueError("need --replay-time-budget > 0 and --replay-mem-gib > 0")
    if args.replay_kernel not in KERNELS:
        raise ValueError(f"--replay-kernel {args.replay_kernel!r}: choose from {KERNELS} (one per fit)")
    if args.replay_jitter not in JITTERS:
        raise ValueError(f"--replay-jitter {args.replay_jitter!r}: choose from {JITTERS}")
    repeats = _repeats(args)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--replay-repeats must be an integer >= 1, got {repeats!r}")
    if args.replay_jitter == "repeat" and repeats < 2:
        raise ValueError("--replay-jitter repeat is the spread of repeated calls: it needs --replay-repeats >= 2")
    _check_model(args)
    if getattr(args, "data", None):
        raise ValueError("--step-model replay draws real samples from a synthetic --preset; --data is not supported")
    _device(args)


def _check_model(args: argparse.Namespace) -> None:
    """The model flags: a known preset, and what the chosen model has (the HSTU model: jagged only, its own kernels
    and head width; the softmax model: its kernels, head width d / heads)."""
    preset = args.replay_model_preset
    if preset not in REPLAY_MODELS:
        raise ValueError(f"--replay-model-preset {preset!r}: choose from {sorted(REPLAY_MODELS)}")
    impl = getattr(args, "replay_attention_impl", None)
    if REPLAY_MODELS[preset] == "hstu":
        if args.replay_kernel != "jagged":
            raise ValueError(
                f"--replay-kernel {args.replay_kernel}: --replay-model-preset {preset} packs its sequences (jagged) "
                "always; the HSTU model has no padded attention"
            )
        if impl not in (None, *HSTU_ATTENTION_IMPLS):
            raise ValueError(f"--replay-attention-impl {impl}: the HSTU model's are {', '.join(HSTU_ATTENTION_IMPLS)}")
    else:
        if getattr(args, "replay_head_dim", None) is not None:
            raise ValueError(
                f"--replay-head-dim is the HSTU model's; --replay-model-preset {preset}'s head width is d / heads"
            )
        if impl not in (None, *ATTENTION_IMPLS):
            raise ValueError(f"--replay-attention-impl {impl}: the softmax model's are {', '.join(ATTENTION_IMPLS)}")
    _config(args, {})  # the sizes' own checks


def build_step_time(args: argparse.Namespace) -> ReplayStepTime:
    """The builder of ``--step-model replay`` in the simulator's STEP_TIME_MODELS. It is called once per partitioner:
    timings and the fit are made once per setting and shared, each call gets a fresh jitter stream (the same
    noise for every partitioner, as the cost model does)."""
    _check(args)
    key = _key(args)
    if key not in _CACHE:
        if args.replay_mode == "fit":
            _CACHE[key] = build_fit(args)
        else:
            device = _device(args)
            source = _source(
                args, num_samples=args.ranks * args.batch_size * (args.steps + args.warmup), seed=args.seed
            )
            timer = Timer(_model(args, source, device), device, _dtype(args))
            guard = MemoryGuard.probe(
                timer, source.read(0, 0, 1), args.max_uih, args.replay_mem_gib, _max_pairs(args), args.replay_kernel
            )
            _CACHE[key] = _Direct(
                source,
                timer,
                guard,
                _repeats(args),
                {
                    "replay_mode": "direct",
                    "replay_kernel": args.replay_kernel,
                    "replay_model": REPLAY_MODELS[args.replay_model_preset],
                    "sequence": timer.sequence,
                    "device": str(device),
                    "dtype": _dtype(args),
                    "replay_repeats": _repeats(args),
                },
            )
    cached = _CACHE[key]
    sync_s = getattr(args, "sync_ms", 0.0) / 1e3
    if isinstance(cached, Fit):
        return ReplayStepTime(cached, args.seed, args.replay_jitter, sync_s)
    return DirectStepTime(cached, args.seed, sync_s)


# ---------------------------------------------------------------------------------------------- CLI
def print_table(records: list[dict], out=None) -> None:
    """The simulator's table, each row followed by its noise floor (``floor%``: the straggler % the jitter alone
    gives on a perfectly balanced step at that rank count) and the row's straggler % over it (``x floor``)."""
    buf = io.StringIO()
    simulator.print_table(records, out=buf)
    lines, out = buf.getvalue().splitlines(), out or sys.stdout  # sys.stdout as it is now (a test may capture it)
    print(f"{lines[0]} {'floor%':>7} {'x floor':>8}", file=out)
    for line, r in zip(lines[1:], records):
        ratio = over_floor(r)
        floor = f"{r['noise_floor_pct']:>7.2f}" if "noise_floor_pct" in r else f"{'-':>7}"
        print(f"{line} {floor} {'-' if ratio is None else f'{ratio:.1f}x':>8}", file=out)


def _floor_line(r: dict) -> str:
    """The noise floor of a record's rank count in words, for the summary."""
    if "noise_floor_pct" not in r:
        return ""
    return (
        f"; noise floor {r['noise_floor_pct']:.2f}% (jitter rel std {r['noise_floor_rel_std']:.4f} over "
        f"{r['noise_floor_n_values']} values, {r['noise_floor_steps']} balanced steps): {r['noise_floor_source']}"
    )


def summary(records: list[dict], kernels: list[str], jitters: list[str], ranks_list: list[int]) -> list[str]:
    """The run's lines under the table: per kernel what the fit rests on, per jitter what the noise is."""
    lines = []
    for kernel in kernels:
        lines += [
            f"{kernel} kernel: FAILED, {r['error']}"
            for r in records
            if r.get("replay_kernel") == kernel and "error" in r
        ]
        group = [r for r in records if r.get("replay_kernel", "padded") == kernel and "error" not in r]
        if not group:
            continue
        f = group[0]
        model = f"{f.get('replay_model', 'softmax')} model, L = {f.get('sequence', 'uih')}"
        if f.get("replay_mode") == "fit":
            lines.append(
                f"{kernel} kernel ({model}), {f['device']} {f['dtype']}: {f['n_batches_timed']} whole local batches "
                "timed from "
                f"{f['timing_steps']} steps of {f['timing_ranks']} ranks, each 1 warm-up + {f['replay_repeats']} "
                f"timed calls, time = median ({f['n_calls_total']} calls, {f['timing_wall_s']:.0f} s); "
                f"{f['n_skipped_too_large']} skipped as too large, {f['n_oom']} out of memory; fit on "
                f"{f['n_timings_fit']} ({f['n_timings_fit_outliers_dropped']} outliers dropped), held-out "
                f"{f['n_timings_heldout']}: R^2 {f['r2_heldout']:.4f} (their times' rel std "
                f"{f['heldout_s_rel_std']:.4f}), median rel err {f['median_rel_err_heldout']:.4f}, "
                f"p90 {f['p90_rel_err_heldout']:.4f}; run-to-run spread of one call {f['repeat_rel_std']:.4f} (per "
                "batch:"
                f" median {f['repeat_rel_spread_median']:.4f}, p90 {f['repeat_rel_spread_p90']:.4f}); timed count "
                f"{f['timed_count_range']}, max L {f['timed_max_L_range']}, {f['timed_s_range'][0] * 1e3:.1f}-"
                f"{f['timed_s_range'][1] * 1e3:.1f} ms; coefficients {f['coefficients']}"
            )
            if f["n_skipped_too_large"] or f["n_oom"]:
                lines.append(
                    f"  WARNING: {f['n_skipped_too_large'] + f['n_oom']} whole local batches could not be "
                    f"timed ({f['skipped_by_partitioner']}); the fit extrapolates to them"
                )
        else:
            lines.append(
                f"{kernel} kernel ({model}), direct: every rank timed, {f.get('replay_repeats')} repeats each, "
                f"run-to-run spread {f.get('repeat_rel_std', float('nan')):.4f}"
            )
        fit = f.get("replay_mode") == "fit"
        for jitter in jitters if fit else jitters[:1]:  # direct mode draws no jitter: its noise is measured
            rows = [r for r in group if r.get("jitter", jitter) == jitter]
            label = f"{kernel}/{jitter} jitter" if fit else f"{kernel} direct"
            if fit and rows:
                lines.append(
                    f"  {kernel}/{jitter} jitter = {JITTER_SOURCES[jitter]}: rel std "
                    f"{rows[0]['jitter_rel_std']:.4f} over {rows[0]['n_jitter_values']} values"
                )
            for ranks in ranks_list:
                at = {r["partitioner"]: r for r in rows if r["ranks"] == ranks}
                if "none" in at:
                    none = at["none"]["straggler_pct"]
                    others = "".join(
                        f" / {p} {r['straggler_pct']:.2f}% ({none / max(r['straggler_pct'], 1e-12):.1f}x lower"
                        + ("" if over_floor(r) is None else f", {over_floor(r):.1f}x floor")
                        + ")"
                        for p, r in at.items()
                        if p != "none"
                    )
                    lines.append(
                        f"  {label}, ranks {ranks}: straggler none {none:.2f}%{others}" + _floor_line(at["none"])
                    )
    return lines


def main(args: argparse.Namespace) -> int:
    """``freescale simulate`` with ``--step-model replay``, whose records also carry what each figure rests on."""
    args.step_model = "replay"
    simulator._validate(args)
    ranks_list = [int(r) for r in str(getattr(args, "replay_ranks", None) or args.ranks).split(",")]
    kernels, jitters = args.replay_kernel.split(","), args.replay_jitter.split(",")
    grid = list(itertools.product(kernels, jitters, ranks_list, args.partitioner.split(",")))
    runs = []
    for kernel, jitter, ranks, name in grid:  # every flag checked before the first timing
        change = {"partitioner": name, "ranks": ranks, "replay_kernel": kernel, "replay_jitter": jitter}
        runs.append(argparse.Namespace(**{**vars(args), **change}))
        simulator._validate(runs[-1])
        _check(runs[-1])
    records, failed = [], {}
    for args_one in runs:
        kernel = args_one.replay_kernel
        if kernel in failed:
            continue
        try:
            # run_grid merges the step-time model's record into each record (what the figure rests on, its floor)
            for record in simulator.run_grid(args_one, args_one.ranks, args.batch_size, args.max_uih):
                records.append({**record, "straggler_over_noise_floor": over_floor(record)})
        except ReplayFitError as error:  # the other kernel may still fit in this call's time
            failed[kernel] = str(error)
            records.append({"replay_kernel": kernel, "replay_mode": args.replay_mode, "error": str(error)})
            print(f"replay: {kernel} kernel not simulated: {error}", file=sys.stderr, flush=True)
        if args.json:  # after every record: a run cut short still leaves what it measured
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    print_table([r for r in records if "error" not in r])
    for line in summary(records, kernels, jitters, ranks_list):
        print(line)
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``freescale simulate``, the replay model's, and those that span several runs of one fit."""
    simulator.add_arguments(parser)
    _add_replay_model_arguments(parser)
    parser.add_argument(
        "--replay-ranks", default=None, help="comma-separated rank counts simulated from one fit (default: --ranks)"
    )
    parser.add_argument(
        "--replay-attention-impl",
        default=None,
        choices=tuple(dict.fromkeys(ATTENTION_IMPLS + HSTU_ATTENTION_IMPLS)),
        help="the jagged attention's kernel on CUDA: the softmax model's "
        f"{'|'.join(ATTENTION_IMPLS)} (default varlen), the HSTU model's {'|'.join(HSTU_ATTENTION_IMPLS)} (default"
        " triton)",
    )
    parser.add_argument(
        "--replay-repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="timed calls per batch after one untimed warm-up; its time is their median, their spread"
        f" the run-to-run noise (default {DEFAULT_REPEATS})",
    )


def _add_replay_model_arguments(parser: argparse.ArgumentParser) -> None:
    replay = parser.add_argument_group("replay model")
    replay.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model is timed")
    replay.add_argument(
        "--replay-model-preset",
        default="replay",
        help="the softmax model's tiny|small|production|replay (default replay: d=256, 2 layers, 4 heads) or the"
        " HSTU model's hstu|hstu-large; max_uih always follows --max-uih",
    )
    replay.add_argument("--replay-dim", type=int, default=None, help="override the preset's width d")
    replay.add_argument("--replay-layers", type=int, default=None, help="override the preset's layer count")
    replay.add_argument("--replay-heads", type=int, default=None, help="override the preset's head count")
    replay.add_argument(
        "--replay-head-dim", type=int, default=None, help="override an HSTU preset's head width (HSTU only)"
    )
    replay.add_argument(
        "--replay-mode",
        default="fit",
        choices=["fit", "direct"],
        help="fit: time a few hundred batches, fit, simulate from the fit; direct: time every rank",
    )
    replay.add_argument(
        "--replay-kernel",
        default="jagged",
        help="the model's attention: jagged (its default: packed tokens, no padding) or padded (pads"
        " each local batch to its longest UIH); a comma-separated list runs each",
    )
    replay.add_argument("--replay-timings", type=int, default=300, help="fresh timings for the fit (fit + held-out)")
    replay.add_argument("--replay-heldout", type=float, default=0.25, help="share of the timings held out")
    replay.add_argument(
        "--replay-time-budget",
        type=float,
        default=240.0,
        help="stop timing after this many seconds (the records say how many timings were made)",
    )
    replay.add_argument("--replay-timing-ranks", type=int, default=8, help="ranks of the plans timed batches come from")
    replay.add_argument(
        "--replay-jitter",
        default="residual",
        help="noise per rank and step: residual (the fit's relative residuals) or repeat (repeated"
        " timings' spread); a comma-separated list runs each",
    )
    replay.add_argument(
        "--replay-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="auto: bf16 autocast on cuda, fp32 on cpu",
    )
    replay.add_argument("--replay-mem-gib", type=float, default=90.0, help="device memory one timed batch may use")
    replay.add_argument(
        "--replay-max-pairs",
        type=float,
        default=None,
        help="cap on count * max_L^2 (padded attention pairs) of one timed batch",
    )


# Importing this module is what offers --step-model replay to the simulator (the product knows no benchmark).
simulator.STEP_TIME_MODELS["replay"] = build_step_time
