"""`freescale simulate --model replay`: step times from the real forward+backward of the reference model.

The cost model of ``pipelines/simulate.py`` assumes its coefficients; replay measures them. A virtual rank's busy
time is the time of :class:`pipelines.model.SequenceModel`'s forward, ``bce_sum`` loss and backward on that rank's
local batch, timed on the actual device (``--device cpu|cuda``), one virtual rank after another, so the step
time of N virtual ranks is the max of real measured times. That brings the model's real kernel behaviour into the
figures: this model pads every local batch to its longest UIH (``count * max L`` tokens through the linear layers,
``count * max L^2`` pairs through attention), which the cost model only approximates.

Two modes (``--replay-mode``):

* ``direct``: every rank of every simulated step is timed. Exact, but costs ``ranks x steps`` timings, and a
  local batch of 128 samples padded to 21,000 does not fit in memory (the attention mask alone is
  ``count * max L^2`` elements). For CPU checks and small settings.
* ``fit`` (default): one GPU call lasts at most 10 minutes, so for 64 to 1,024 ranks replay times a few hundred
  fresh batches of varied composition, drawn as the partitioners produce them (local batches of ``none``,
  ``fbs``, ``vbs`` and ``kk`` plans of a few timing steps, then a random subset of each that fits the memory
  budget, so the fit sees mixed and length-sorted batches of every size), fits

      time ~ c0 + c1*count + c2*sum L + c3*sum L^2 + c4*max L + c5*count*max L + c6*count*max L^2

  by non-negative least squares on relative errors (every coefficient >= 0: a kernel never gets faster with more
  work), checks it on held-out timings (R^2, median relative error), and uses the relative residuals of the fit
  set as jitter (resampled per rank and step). ``count*max L`` is the padded token count, ``count*max L^2`` the
  padded attention pairs. The timed subsets are smaller than a full local batch where memory requires, so the
  fit extrapolates in ``count``; for a padded kernel time is linear in the batch dimension once the device is
  busy, which is what the ``count*`` terms express.

Every figure says what it rests on: :meth:`ReplayStepTime.record` (``n_timings_fit``, ``n_timings_heldout``,
``r2_heldout``, ``median_rel_err_heldout``, the coefficients and the jitter) goes into the JSON records when the
simulation is run through :func:`main` (``python -m pipelines.replay``, the same flags as ``freescale simulate``).

On CUDA the default precision is bf16 autocast (``--replay-dtype``): fp32 attention over 21,000-token padded
batches runs on the SIMT path and would leave time for only a few dozen timings in one call. ``--replay-kernel jagged`` times equal-length batches instead (every subset cut
to its shortest sample: no padding, so the padded kernels do exactly a variable-length kernel's work) and fits
only ``c0..c3``: the cost of the paper's jagged (HSTU-style) kernels, from this model's real kernels. The ``replay``
model preset (d=256, 2 layers, 4 heads) keeps the model's ``max_uih`` at the simulation's ``--max-uih``: the
straggler effect comes from long UIH, so it is never cut.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from fsdata.batch import Batch, lengths_to_offsets
from fsdata.partition import GatheredLengths, Plan, RuntimeInfo, get_partitioner
from pipelines.model import MODEL_PRESETS, ModelConfig, SequenceModel, bce_sum

REPLAY_MODEL_PRESETS: dict[str, dict] = {
    **MODEL_PRESETS,
    # The production width is 512 x 4 layers; half of each keeps a few hundred 21,000-token timings inside one call.
    "replay": dict(num_items=1_000_000, dim=256, num_layers=2, num_heads=4),
}
FEATURES = ("const", "count", "sum_L", "sum_L2", "max_L", "count_x_max_L", "count_x_max_L2")
TIMING_PARTITIONERS = ("none", "fbs", "vbs", "kk")
KERNELS = ("padded", "jagged")
JITTERS = ("residual", "repeat")
REPEAT_EVERY = 5  # every 5th timed batch is timed twice: the run-to-run noise apart from the fit's error


def features(uih_lengths_per_rank: list[np.ndarray]) -> np.ndarray:
    """Regressors [R, 7] of each local batch (UIH lengths after the cap: what the encoder pads)."""
    rows = []
    for lengths in uih_lengths_per_rank:
        length = np.asarray(lengths, dtype=np.float64)
        n = float(length.size)
        longest = float(length.max()) if length.size else 0.0
        rows.append([1.0, n, length.sum(), (length * length).sum(), longest, n * longest, n * longest * longest])
    return np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURES))


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin sum(((x @ c) - y) / y)^2 subject to c >= 0: the best feasible least-squares fit of all 2^k column
    subsets (k = 7: 128 tiny solves). Relative errors, because timings span milliseconds to seconds."""
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


# ---------------------------------------------------------------------------------------------- timing
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
        sample_ids=batch.sample_ids[idx], user_ids=batch.user_ids[idx],
        uih_offsets=lengths_to_offsets((uo[1:] - uo[:-1])[idx]), uih_item_ids=batch.uih_item_ids[uih],
        candidate_offsets=lengths_to_offsets((co[1:] - co[:-1])[idx]), candidate_labels=batch.candidate_labels[cand],
        content_offsets=lengths_to_offsets((xo[1:] - xo[:-1])[cand]), content_ids=batch.content_ids[content],
        dense=batch.dense[idx], uih_action_types=opt(batch.uih_action_types, uih),
        uih_timestamps=opt(batch.uih_timestamps, uih),
    )


class Timer:
    """Times forward + ``bce_sum`` + backward of the model on one local batch, device-synchronised around it."""

    def __init__(self, model: SequenceModel, device: torch.device, dtype: str) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.count = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, batch: Batch) -> float:
        batch = batch.to(self.device)
        self.model.zero_grad(set_to_none=True)
        self._sync()
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
            loss = bce_sum(self.model(batch).float(), batch.candidate_labels)
        loss.backward()
        self._sync()
        self.count += 1
        return time.perf_counter() - start

    def peak_bytes(self, batch: Batch) -> float:
        """Peak device memory of one forward+backward above what was allocated before (CUDA only)."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self(batch)
        self.count -= 1  # a probe, not a timing
        return float(torch.cuda.max_memory_allocated(self.device) - base)


@dataclass
class Fit:
    coefficients: np.ndarray
    residuals: np.ndarray  # relative residuals y / pred - 1 of the fit set: jitter "residual"
    info: dict = field(default_factory=dict)
    repeats: np.ndarray = field(default_factory=lambda: np.zeros(0))  # one timing's relative noise: jitter "repeat"

    def predict(self, x: np.ndarray) -> np.ndarray:
        return x @ self.coefficients

    @property
    def d(self) -> float:
        """Fixed seconds per rank and step (the intercept): simulate's lower bound adds it to every rank."""
        return float(self.coefficients[0])


class ReplayStepTime:
    """Mode fit: ``step_time(lengths, plan) -> [W]`` busy seconds predicted by a :class:`Fit`, times one resampled
    relative residual per rank and step."""

    def __init__(self, fit: Fit, seed: int, jitter: str = "residual") -> None:
        if jitter not in JITTERS:
            raise ValueError(f"--replay-jitter {jitter!r}: choose from {JITTERS}")
        if jitter == "repeat" and fit.repeats.size < 2:
            raise ValueError(f"--replay-jitter repeat: only {fit.repeats.size} repeated timings; raise --replay-timings")
        self.fit, self.jitter = fit, jitter
        self.noise = fit.residuals if jitter == "residual" else fit.repeats
        self.params = fit  # simulate reads params.d as the fixed per-rank cost of the lower bound
        self.rng = np.random.default_rng([seed, 11])

    def __call__(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        uih = lengths.uih_lengths.numpy()
        busy = self.fit.predict(features([uih[plan.rank_samples(r).numpy()] for r in range(plan.world_size)]))
        if self.noise.size:
            busy = busy * np.maximum(1.0 + self.rng.choice(self.noise, size=busy.size), 0.0)
        return busy

    def sample_costs(self, lengths: GatheredLengths) -> np.ndarray:
        """Seconds a sample adds alone on a rank, without the fixed intercept (for the lower bound)."""
        length = lengths.uih_lengths.numpy().astype(np.float64)
        x = np.stack([np.zeros_like(length), np.ones_like(length), length, length**2, length, length, length**2], 1)
        return self.fit.predict(x)

    def record(self) -> dict:
        """What the figures rest on, for the JSON records."""
        return {**self.fit.info, "jitter": self.jitter}

    def describe(self) -> str:
        return f"replay({self.record()})"


class DirectStepTime:
    """Mode direct: every rank of every step timed for real (``n_timings_sim`` counts them)."""

    def __init__(self, direct: "_Direct") -> None:
        self.direct = direct
        self.n_timings_sim = 0

    def __call__(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        self.n_timings_sim += plan.world_size
        return np.array([self.direct.time(lengths, plan.rank_samples(r).numpy()) for r in range(plan.world_size)])

    def record(self) -> dict:
        return {**self.direct.info, "n_timings_sim": self.n_timings_sim}

    def describe(self) -> str:
        return f"replay({self.record()})"


class _Direct:
    """Mode direct: reads each rank's real samples from the same synthetic source the simulator draws from."""

    def __init__(self, source, timer: Timer, max_pairs: float, info: dict) -> None:
        self.source, self.timer, self.max_pairs, self.info = source, timer, max_pairs, info
        self._cached: tuple[int, int, Optional[Batch]] = (-1, -1, None)

    def time(self, lengths: GatheredLengths, idx: np.ndarray) -> float:
        ids = lengths.sample_ids.numpy()
        lo, hi = int(ids.min()), int(ids.max()) + 1
        if self._cached[:2] != (lo, hi):
            self._cached = (lo, hi, self.source.read(0, lo, hi))
        uih = lengths.uih_lengths.numpy()[idx]
        pairs = uih.size * float(uih.max() if uih.size else 0) ** 2
        if pairs > self.max_pairs:
            raise ValueError(f"replay direct: a local batch of {uih.size} samples padded to {uih.max()} "
                             f"({pairs:.3g} attention pairs) exceeds the budget {self.max_pairs:.3g}; use --replay-mode fit")
        local = select(self._cached[2], ids[idx] - lo)
        if not np.array_equal(local.uih_lengths.numpy(), uih):
            raise ValueError("replay direct: the simulated lengths are not those of the synthetic source's samples "
                             f"{ids[idx][:4].tolist()}...; direct mode needs the same --preset, --seed and --max-uih")
        return self.timer(local)


# ---------------------------------------------------------------------------------------------- building
def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    return torch.device(args.device)


def _source(args: argparse.Namespace, num_samples: int, seed: int):
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    if getattr(args, "data", None):
        raise ValueError("--model replay draws real samples from a synthetic --preset; --data is not supported")
    return SyntheticSource(SyntheticConfig.from_preset(args.preset, uih_cap=args.max_uih, num_samples=num_samples, seed=seed))


def _model(args: argparse.Namespace, source, device: torch.device) -> SequenceModel:
    if args.replay_model_preset not in REPLAY_MODEL_PRESETS:
        raise ValueError(f"--replay-model-preset {args.replay_model_preset!r}: choose from {sorted(REPLAY_MODEL_PRESETS)}")
    sizes = dict(REPLAY_MODEL_PRESETS[args.replay_model_preset])
    for key, flag in (("dim", "replay_dim"), ("num_layers", "replay_layers"), ("num_heads", "replay_heads")):
        if getattr(args, flag) is not None:
            sizes[key] = getattr(args, flag)
    c = source.config
    # max_uih follows the simulation: a model preset's shorter cap would hide the long-UIH stragglers.
    config = ModelConfig(**{**sizes, "max_uih": args.max_uih, "num_labels": c.num_labels, "dense_dim": c.dense_dim})
    torch.manual_seed(args.seed)
    return SequenceModel(config).to(device)


def _dtype(args: argparse.Namespace) -> str:
    return args.replay_dtype if args.replay_dtype != "auto" else ("bf16" if args.device == "cuda" else "fp32")


_CACHE: dict[tuple, object] = {}


def _key(args: argparse.Namespace) -> tuple:
    names = ("device", "preset", "max_uih", "batch_size", "seed", "alpha", "replay_model_preset", "replay_dim",
             "replay_layers", "replay_heads", "replay_kernel", "replay_timings", "replay_heldout", "replay_mode", "replay_dtype",
             "replay_mem_gib", "replay_time_budget", "replay_timing_ranks", "replay_max_pairs")
    direct = ("ranks", "steps", "warmup") if args.replay_mode == "direct" else ()  # a fit serves every rank count
    return tuple(getattr(args, n, None) for n in names + direct)


def _pair_budget(args: argparse.Namespace, timer: Timer, batch: Batch) -> float:
    """Attention pairs (count * max L^2) one timed batch may hold: --replay-max-pairs, and on CUDA what
    --replay-mem-gib allows, from the peak memory of one probe (the longest sample alone; everything it allocates
    is charged to its attention pairs, which over-estimates per pair for shorter samples: on the safe side)."""
    budget = float(args.replay_max_pairs) if args.replay_max_pairs else np.inf
    if timer.device.type == "cuda":
        longest = int(np.argmax(batch.uih_lengths.numpy()))
        length = float(batch.uih_lengths[longest])
        per_pair = timer.peak_bytes(select(batch, np.array([longest]))) / (length * length)
        budget = min(budget, args.replay_mem_gib * 2**30 / per_pair)
        timer.info_bytes_per_pair = per_pair
    return budget


def equal_length(batch: Batch, length: int) -> Batch:
    """Every sample cut to its most recent ``length`` UIH events (all must have at least that many): a batch
    without padding, whose padded kernels do exactly the work a variable-length kernel would."""
    uo = batch.uih_offsets
    if batch.batch_size and int((uo[1:] - uo[:-1]).min()) < length:
        raise ValueError(f"equal_length: a sample is shorter than {length}")
    from fsdata.synthetic import segment_arange

    keep = torch.from_numpy(segment_arange((uo[1:] - length).numpy(), np.full(batch.batch_size, length)))
    opt = lambda t: None if t is None else t[keep]  # noqa: E731
    return dataclasses.replace(
        batch, uih_offsets=torch.arange(batch.batch_size + 1, dtype=torch.int64) * length,
        uih_item_ids=batch.uih_item_ids[keep], uih_action_types=opt(batch.uih_action_types),
        uih_timestamps=opt(batch.uih_timestamps),
    )


def _timing_batches(args, source, rng: np.random.Generator, budget: list):
    """Endless local batches as the partitioners produce them (``none``/``fbs``/``vbs``/``kk`` plans of timing
    steps of ``--replay-timing-ranks`` ranks), each a random subset whose attention pairs fit ``budget[0]``.
    With ``--replay-kernel jagged`` the subset is cut to equal lengths (its shortest sample's): no padding."""
    w, b = args.replay_timing_ranks, args.batch_size
    jagged = args.replay_kernel == "jagged"
    parts = {name: get_partitioner(name, alpha=args.alpha) for name in TIMING_PARTITIONERS}
    for step in itertools.count():
        sizes = source.lengths(0, step * w * b, (step + 1) * w * b)
        lengths = GatheredLengths(sizes["uih_lengths"], sizes["num_candidates"], sizes["candidate_lengths"],
                                  np.arange(w * b), np.arange(w + 1) * b, w)
        batch = source.read(0, step * w * b, (step + 1) * w * b)
        uih = sizes["uih_lengths"].astype(np.float64)
        jobs = [(name, parts[name](lengths, RuntimeInfo(step=step)).rank_samples(r).numpy())
                for name in TIMING_PARTITIONERS for r in range(w)]
        for j in rng.permutation(len(jobs)):
            name, idx = jobs[j]
            idx = idx[rng.permutation(idx.size)]
            padded_to = (np.minimum if jagged else np.maximum).accumulate(uih[idx])
            fits = np.nonzero(np.arange(1, idx.size + 1) * padded_to**2 <= budget[0])[0]
            if fits.size == 0:
                continue
            k = int(rng.choice(fits)) + 1  # a random size among those that fit
            local = select(batch, np.sort(idx[:k]))
            yield name, equal_length(local, int(padded_to[k - 1])) if jagged else local


def _trim(x: np.ndarray, y: np.ndarray, cols: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Fit, drop timings more than 8 robust sigmas (MAD) above or below the fit (a shared CPU's hiccups), refit.
    Returns the coefficients and the mask of kept timings."""
    coef = np.zeros(x.shape[1])
    coef[cols] = fit_nonnegative(x[:, cols], y)
    rel = y / np.maximum(x @ coef, 1e-12) - 1.0
    mad = 1.4826 * np.median(np.abs(rel - np.median(rel)))
    keep = np.abs(rel - np.median(rel)) <= max(8 * mad, 0.05)
    if not keep.all() and keep.sum() >= len(cols) + 1:
        coef = np.zeros(x.shape[1])
        coef[cols] = fit_nonnegative(x[keep][:, cols], y[keep])
    return coef, keep


def build_fit(args: argparse.Namespace) -> Fit:
    """Times ``--replay-timings`` fresh batches (or as many as ``--replay-time-budget`` allows), fits, checks."""
    device, dtype = _device(args), _dtype(args)
    source = _source(args, num_samples=10**9, seed=args.seed + 1_000)  # fresh samples, not the simulated ones
    model = _model(args, source, device)
    timer = Timer(model, device, dtype)
    rng = np.random.default_rng([args.seed, 3])
    first = source.read(0, 0, args.replay_timing_ranks * args.batch_size)
    started = time.perf_counter()
    budget = [_pair_budget(args, timer, first)]
    # Warm-up: first calls (allocator, cuBLAS/SDPA kernel selection) at a few shapes, not recorded.
    for k in (1, 2, 4):
        timer(select(first, rng.permutation(first.batch_size)[:k]))
    ys, xs, names, repeats, n_oom = [], [], [], [], 0
    for name, batch in _timing_batches(args, source, rng, budget):
        if len(ys) >= args.replay_timings or time.perf_counter() - started > args.replay_time_budget:
            break
        try:
            ys.append(timer(batch))
            if len(ys) % REPEAT_EVERY == 0:  # the same batch again: pure run-to-run noise, no fit error in it
                repeats.append((len(ys) - 1, timer(batch) / ys[-1] - 1.0))
        except torch.cuda.OutOfMemoryError:  # fragmentation beyond the probe's estimate: shrink the budget
            n_oom += 1
            budget[0] *= 0.8
            timer.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        xs.append(features([batch.uih_lengths.numpy()])[0])
        names.append(name)
    n = len(ys)
    n_held = int(round(n * args.replay_heldout))
    cols = list(range(len(FEATURES))) if args.replay_kernel == "padded" else [0, 1, 2, 3]
    if n - n_held < len(cols) + 2 or n_held < 2:
        raise ValueError(f"replay: only {n} timings within --replay-time-budget {args.replay_time_budget}s; "
                         f"need at least {len(cols) + 4}")
    x, y = np.asarray(xs), np.asarray(ys)
    order = rng.permutation(n)
    held, fit_idx = order[:n_held], order[n_held:]
    coef, keep = _trim(x[fit_idx], y[fit_idx], cols)
    # Jitter pools from the larger half of the timings only: a millisecond batch's relative noise (launches, the
    # host) says little about a rank's second-long step, which is what the simulation draws noise for.
    big = x @ coef >= np.median(x @ coef)
    residuals = (y[fit_idx] / np.maximum(x[fit_idx] @ coef, 1e-12) - 1.0)[keep & big[fit_idx]]
    repeat_noise = np.array([d for i, d in repeats if big[i]]) / np.sqrt(2)  # std(t2/t1 - 1) = sqrt(2) x one timing's
    pred, truth = x[held] @ coef, y[held]
    rel_err = np.abs(pred - truth) / truth
    ss_res, ss_tot = float(np.sum((truth - pred) ** 2)), float(np.sum((truth - truth.mean()) ** 2))
    info = {
        "replay_mode": "fit",
        "replay_kernel": args.replay_kernel,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": dtype,
        "model_config": dataclasses.asdict(model.config),
        "n_timings_fit": int(fit_idx.size),
        "n_timings_heldout": int(n_held),
        "n_timings_fit_outliers_dropped": int((~keep).sum()),
        "n_oom_skipped": n_oom,
        "timings_by_partitioner": {p: names.count(p) for p in TIMING_PARTITIONERS},
        "timing_s_total": float(y.sum()),
        "timing_wall_s": time.perf_counter() - started,
        "timed_count_range": [int(x[:, 1].min()), int(x[:, 1].max())],
        "timed_max_L_range": [int(x[:, 4].min()), int(x[:, 4].max())],
        "timed_s_range": [float(y.min()), float(y.max())],
        "pair_budget": None if not np.isfinite(budget[0]) else float(budget[0]),
        "bytes_per_pair": getattr(timer, "info_bytes_per_pair", None),
        "coefficients": dict(zip(FEATURES, map(float, coef))),
        "r2_heldout": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
        "median_rel_err_heldout": float(np.median(rel_err)),
        "p90_rel_err_heldout": float(np.quantile(rel_err, 0.9)),
        "n_timings_repeat": len(repeats),
        "jitter_pool_min_s": float(np.median(x @ coef)),
        "n_jitter_residuals": int(residuals.size),
        "n_jitter_repeats": int(repeat_noise.size),
        "repeat_rel_std": float(repeat_noise.std()) if repeat_noise.size > 1 else float("nan"),
        "jitter_rel_std_fit": float(residuals.std()),
        "jitter_rel_p5_p95_fit": [float(np.quantile(residuals, 0.05)), float(np.quantile(residuals, 0.95))],
    }
    print(f"replay fit ({args.replay_kernel} kernel): {n} timings in {info['timing_wall_s']:.0f} s, held-out R^2 "
          f"{info['r2_heldout']:.4f}, median rel err {info['median_rel_err_heldout']:.4f}", file=sys.stderr, flush=True)
    return Fit(coef, residuals, info, repeats=repeat_noise)


def build_step_time(args: argparse.Namespace) -> ReplayStepTime:
    """The builder ``pipelines/simulate.py`` imports for ``--model replay``. It is called once per partitioner:
    timings and the fit are made once per setting and shared, each call gets a fresh jitter stream (the same
    noise for every partitioner, as the cost model does)."""
    if args.replay_mode not in ("fit", "direct"):
        raise ValueError(f"--replay-mode must be 'fit' or 'direct', got {args.replay_mode!r}")
    if args.replay_timings < 1 or not 0.0 < args.replay_heldout < 1.0 or args.replay_timing_ranks < 1:
        raise ValueError("need --replay-timings >= 1, 0 < --replay-heldout < 1, --replay-timing-ranks >= 1")
    if args.replay_kernel not in KERNELS:
        raise ValueError(f"--replay-kernel {args.replay_kernel!r}: choose from {KERNELS} (one per fit)")
    if args.replay_mode == "direct" and args.replay_kernel != "padded":
        raise ValueError("--replay-mode direct times the model as it is: only --replay-kernel padded")
    key = _key(args)
    if key not in _CACHE:
        if args.replay_mode == "fit":
            _CACHE[key] = build_fit(args)
        else:
            device = _device(args)
            source = _source(args, num_samples=args.ranks * args.batch_size * (args.steps + args.warmup), seed=args.seed)
            timer = Timer(_model(args, source, device), device, _dtype(args))
            warm = source.read(0, 0, min(4, source.config.num_samples))
            for k in range(1, warm.batch_size + 1):
                timer(select(warm, np.arange(k)))
            timer.count = 0
            max_pairs = float(args.replay_max_pairs) if args.replay_max_pairs else np.inf
            _CACHE[key] = _Direct(source, timer, max_pairs, {"replay_mode": "direct", "device": str(device),
                                                             "dtype": _dtype(args)})
    cached = _CACHE[key]
    if isinstance(cached, Fit):
        return ReplayStepTime(cached, args.seed, args.replay_jitter)
    return DirectStepTime(cached)


# ---------------------------------------------------------------------------------------------- CLI
def main(args: argparse.Namespace) -> int:
    """``freescale simulate`` with ``--model replay``, whose records also carry what each figure rests on."""
    from pipelines import simulate

    args.model = "replay"
    simulate._validate(args)
    ranks_list = [int(r) for r in str(getattr(args, "replay_ranks", None) or args.ranks).split(",")]
    kernels, jitters = args.replay_kernel.split(","), args.replay_jitter.split(",")
    records = []
    grid = itertools.product(kernels, jitters, ranks_list, args.partitioner.split(","))
    for kernel, jitter, ranks, name in grid:
        change = {"partitioner": name, "ranks": ranks, "replay_kernel": kernel, "replay_jitter": jitter}
        args_one = argparse.Namespace(**{**vars(args), **change})
        simulate._validate(args_one)
        for record in simulate.run_grid(args_one, ranks, args.batch_size, args.max_uih):
            record.update(build_step_time(args_one).record())
            if record["replay_mode"] == "direct":  # the timings this partitioner's run made
                record["n_timings_sim"] = ranks * (args.steps + args.warmup)
            records.append(record)
            if args.json:  # after every record: a run cut short still leaves what it measured
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)
    simulate.print_table(records)
    for kernel, jitter in itertools.product(kernels, jitters):
        group = [r for r in records if r.get("replay_kernel", "padded") == kernel and r.get("jitter") == jitter]
        fit = group[0] if group else {}
        if fit.get("replay_mode") == "fit" and jitter == jitters[0]:
            print(f"{kernel} kernel, {fit['device']} {fit['dtype']}: fit on {fit['n_timings_fit']} timings "
                  f"({fit['n_timings_fit_outliers_dropped']} outliers dropped), held-out {fit['n_timings_heldout']}: "
                  f"R^2 {fit['r2_heldout']:.4f}, median rel err {fit['median_rel_err_heldout']:.4f}, p90 "
                  f"{fit['p90_rel_err_heldout']:.4f}; residual std {fit['jitter_rel_std_fit']:.4f}, repeat std "
                  f"{fit['repeat_rel_std']:.4f} ({fit['n_timings_repeat']} repeats); timing wall "
                  f"{fit['timing_wall_s']:.0f} s; timed count {fit['timed_count_range']}, max L "
                  f"{fit['timed_max_L_range']}; coefficients {fit['coefficients']}")
        for ranks in ranks_list:
            by = {r["partitioner"]: r["straggler_pct"] for r in group if r["ranks"] == ranks}
            if "none" in by:
                print(f"{kernel}/{jitter} jitter, ranks {ranks}: straggler none {by['none']:.2f}% / " + ", ".join(
                    f"{p} {v:.2f}% ({by['none'] / max(v, 1e-12):.1f}x lower)" for p, v in by.items() if p != "none"))
    return 0


if __name__ == "__main__":
    from pipelines.simulate import add_arguments

    parser = argparse.ArgumentParser(prog="python -m pipelines.replay")
    add_arguments(parser)
    parser.add_argument("--replay-ranks", default=None, help="comma-separated rank counts simulated from one fit "
                        "(default: --ranks)")
    sys.exit(main(parser.parse_args()))
