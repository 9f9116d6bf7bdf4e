"""`freescale simulate`: the straggler effect of N ranks, with and without balancing, without N devices.

Event-level: every global step, N ranks draw their local batches from a length distribution (a synthetic
preset or a Parquet file), the partitioner plans the step exactly as the loader would (same GatheredLengths,
same RuntimeInfo, the same lookahead lag for autotune and the cost fit), each rank's busy time comes from a
pluggable step-time model, and all ranks meet at the gradient AllReduce:

    step time      T = max_r busy_r + sync
    idle wait      idle_r = max busy - busy_r                (the bubble at the gradient synchronisation)
    straggler %    sum over steps of mean_r idle_r / sum over steps of T      (the paper's Figure 2 / 8 metric)

Step-time models (``--step-model``): ``cost`` (here) is a per-sample cost model with jitter. Others plug in through
:data:`STEP_TIME_MODELS`: any callable ``step_time(lengths: GatheredLengths, plan: Plan) -> busy seconds [W]``
works, optionally with ``sample_costs(lengths) -> [G]`` (noise-free per-sample seconds, for the lower bound) and
``describe() -> str``. The replay harness (``python -m benchmarks replay`` in a source checkout: the real
forward+backward of the softmax model, one virtual rank after another) adds ``replay`` this way.

``--sweep DIR`` runs the three sweeps of the paper's Figures 2 and 8 (max UIH, batch size, ranks), writes their
records and PNG plots into DIR.

Memory. Every record has the per-rank kept tokens, max over mean (mean over steps) and the worst step's; with
``--memory-budget SPEC`` (a token count or ``Nx``, fsdata.partition.budget) every partitioner runs twice, without
and then with the budget, on the same lengths and the same noise, so the budget's cost in balance is the
difference of two rows. ``none`` moves nothing: its row with the budget reports how far over it an unbalanced
step goes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from fsdata.partition import (
    AutoTune,
    BudgetSpec,
    CostModel,
    GatheredLengths,
    OnlineCostFit,
    Plan,
    RuntimeInfo,
    get_partitioner,
    kept_tokens,
)
from fsdata.partition.cost import rank_features
from fsdata.partition.plan_sparsity import per_rank_sparsity

KUAIRAND_MEDIAN, KUAIRAND_MEAN = 3379.0, 5038.0  # KuaiRand-1K UIH lengths as published


# ---------------------------------------------------------------------------------------------- lengths
class LengthSource(Protocol):
    def step(self, step: int) -> GatheredLengths: ...
    def describe(self) -> str: ...


class PresetLengths:
    """Lengths of a synthetic preset: fsdata.synthetic's cheap ``lengths()`` path (same numbers ``read`` gives)."""

    def __init__(self, preset: str, ranks: int, batch_size: int, max_uih: int, steps: int, seed: int) -> None:
        from fsdata.synthetic import SyntheticConfig, SyntheticSource

        self.ranks, self.batch_size = ranks, batch_size
        config = SyntheticConfig.from_preset(preset, uih_cap=max_uih, num_samples=ranks * batch_size * steps, seed=seed)
        self.source = SyntheticSource(config)

    def step(self, step: int) -> GatheredLengths:
        global_batch = self.ranks * self.batch_size
        sizes = self.source.lengths(0, step * global_batch, (step + 1) * global_batch)
        offsets = np.arange(self.ranks + 1, dtype=np.int64) * self.batch_size
        ids = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
        return GatheredLengths(
            sizes["uih_lengths"], sizes["num_candidates"], sizes["candidate_lengths"], ids, offsets, self.ranks
        )

    def describe(self) -> str:
        return self.source.describe()


class LognormalLengths:
    """KuaiRand-like lengths without fsdata.synthetic: lognormal, median 3,379, mean 5,038, cut at max UIH."""

    def __init__(self, ranks: int, batch_size: int, max_uih: int, seed: int, candidates: int = 1) -> None:
        self.ranks, self.batch_size, self.max_uih, self.seed, self.candidates = (
            ranks,
            batch_size,
            max_uih,
            seed,
            candidates,
        )
        self.sigma = math.sqrt(2.0 * math.log(KUAIRAND_MEAN / KUAIRAND_MEDIAN))

    def step(self, step: int) -> GatheredLengths:
        rng = np.random.default_rng([self.seed, step])
        g = self.ranks * self.batch_size
        uih = np.minimum(np.maximum(rng.lognormal(math.log(KUAIRAND_MEDIAN), self.sigma, g), 1), self.max_uih)
        cands = np.full(g, self.candidates, dtype=np.int64)
        return GatheredLengths(
            uih.astype(np.int64),
            cands,
            np.ones(g * self.candidates, dtype=np.int64),
            np.arange(step * g, (step + 1) * g),
            np.arange(self.ranks + 1) * self.batch_size,
            self.ranks,
        )

    def describe(self) -> str:
        return f"lognormal(median={KUAIRAND_MEDIAN:.0f}, mean={KUAIRAND_MEAN:.0f}, cap={self.max_uih})"


class ParquetLengths:
    """UIH lengths and candidate counts of a FreeScale Parquet dataset, read in file order, wrapping around."""

    def __init__(self, path: str, ranks: int, batch_size: int, max_uih: int) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from fsdata.parquet import expand_paths
        from fsdata.schema import CANDIDATE_LABELS, UIH_ITEM_IDS

        self.ranks, self.batch_size, self.path = ranks, batch_size, path
        uih, cands = [], []
        for file in expand_paths(path):
            table = pq.read_table(file, columns=[UIH_ITEM_IDS, CANDIDATE_LABELS])
            uih.append(pc.list_value_length(table[UIH_ITEM_IDS]).to_numpy(zero_copy_only=False))
            cands.append(pc.list_value_length(table[CANDIDATE_LABELS]).to_numpy(zero_copy_only=False))
        self.uih = np.minimum(np.concatenate(uih).astype(np.int64), max_uih)
        self.cands = np.concatenate(cands).astype(np.int64)
        if self.uih.size == 0:
            raise ValueError(f"{path}: no samples")

    def step(self, step: int) -> GatheredLengths:
        g = self.ranks * self.batch_size
        idx = (np.arange(step * g, (step + 1) * g)) % self.uih.size
        cands = self.cands[idx]
        return GatheredLengths(
            self.uih[idx],
            cands,
            np.ones(int(cands.sum()), dtype=np.int64),
            np.arange(step * g, (step + 1) * g),
            np.arange(self.ranks + 1) * self.batch_size,
            self.ranks,
        )

    def describe(self) -> str:
        return f"parquet({self.path}: {self.uih.size} samples, mean UIH {self.uih.mean():.0f})"


# ---------------------------------------------------------------------------------------------- step time
StepTimeFn = Callable[[GatheredLengths, Plan], np.ndarray]


@dataclass
class CostParams:
    """Per-rank busy time of the cost model, in seconds. These are assumed values of an attention-heavy
    sequence model (quadratic term equal to the linear one at L = a/b = 5,000 tokens), not measurements; the
    replay model measures the real thing."""

    a: float = 2e-8  # per token (linear layers, embeddings)
    b: float = 8e-12  # per token pair (attention), see ``kernel``
    c: float = 2e-5  # per sample
    d: float = 5e-3  # per step (launches, optimizer, fixed)
    pad: float = 1e-9  # per padded token: tiles launched up to the batch's longest sample that exit at once
    kernel: str = "jagged"  # jagged: attention costs sum(L^2); padded: count * max(L)^2, a dense padded kernel
    jitter: float = 0.01  # sigma of a multiplicative normal noise per rank and step (assumed, not measured)


class CostStepTime:
    """busy_r = d + a*sum(L) + b*attention + c*count + pad*(count*max L - sum L), times (1 + jitter * N(0,1))."""

    def __init__(self, params: CostParams, seed: int = 0) -> None:
        if params.kernel not in ("jagged", "padded"):
            raise ValueError(f"cost model kernel must be 'jagged' or 'padded', got {params.kernel!r}")
        self.params = params
        self.rng = np.random.default_rng([seed, 7])

    def noise_free(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        p = self.params
        w = plan.world_size
        tokens = (lengths.uih_lengths + lengths.num_candidates).numpy().astype(np.float64)
        dest = plan.destinations().numpy()
        features = rank_features(tokens, dest, w)
        longest = np.zeros(w)
        np.maximum.at(longest, dest, tokens)
        count = features[:, 2]
        attention = features[:, 1] if p.kernel == "jagged" else count * longest * longest
        return p.d + p.a * features[:, 0] + p.b * attention + p.c * count + p.pad * (count * longest - features[:, 0])

    def __call__(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        busy = self.noise_free(lengths, plan)
        return busy * np.maximum(1.0 + self.params.jitter * self.rng.standard_normal(busy.size), 0.0)

    def sample_costs(self, lengths: GatheredLengths) -> np.ndarray:
        """Noise-free seconds per sample when alone on a rank (jagged attention), for the lower bound."""
        p = self.params
        tokens = (lengths.uih_lengths + lengths.num_candidates).numpy().astype(np.float64)
        return p.a * tokens + p.b * tokens * tokens + p.c

    def describe(self) -> str:
        return f"cost({asdict(self.params)})"


def build_cost_model(args: argparse.Namespace) -> CostStepTime:
    params = CostParams(
        a=args.cost_a,
        b=args.cost_b,
        c=args.cost_c,
        d=args.cost_d,
        pad=args.cost_pad,
        kernel=args.kernel,
        jitter=args.jitter,
    )
    return CostStepTime(params, seed=args.seed)


# name -> builder(args); a harness outside the product registers its own (benchmarks/replay.py adds "replay").
STEP_TIME_MODELS: dict[str, Callable[[argparse.Namespace], StepTimeFn]] = {"cost": build_cost_model}


def build_step_time(args: argparse.Namespace) -> StepTimeFn:
    builder = STEP_TIME_MODELS.get(args.step_model)
    if builder is None:
        raise ValueError(
            f"unknown --step-model {args.step_model!r}; choose from {sorted(STEP_TIME_MODELS)}"
            " (the measured one, replay, runs from a source checkout: python -m benchmarks replay)"
        )
    return builder(args)


# ---------------------------------------------------------------------------------------------- simulation
@dataclass
class SimSettings:
    ranks: int
    batch_size: int
    max_uih: int
    steps: int
    warmup: int = 10
    lookahead: int = 2
    sync_s: float = 0.0
    alpha: float = 1.5
    autotune: bool = True  # VBS only
    fit_cost: bool = False
    memory_budget: Optional[BudgetSpec] = None  # a token count or Nx; auto needs a device, which is not simulated


def simulate(partitioner: str, source: LengthSource, step_time: StepTimeFn, s: SimSettings) -> dict:
    """One partitioner over ``s.steps`` global steps; returns its JSON record (statistics after ``s.warmup``)."""
    part = get_partitioner(partitioner, alpha=s.alpha)
    autotune = AutoTune(s.ranks) if (s.autotune and partitioner == "vbs") else None
    fit = OnlineCostFit() if s.fit_cost else None
    cost_model = CostModel(alpha=s.alpha)
    pending: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # step -> busy [W], features [W, 4], weights [W]
    latest: Optional[tuple[int, np.ndarray]] = None
    rows: list[dict] = []  # one per measured step
    budget = s.memory_budget
    for step in range(s.steps + s.warmup):
        # Lookahead: the plan of `step` is made while step - lookahead + 1 runs: only older steps are measured.
        for measured in sorted(m for m in pending if m <= step - s.lookahead):
            busy, features, weights = pending.pop(measured)
            latest = (measured, busy)
            if autotune is not None:
                autotune.observe(measured, busy, weights)
            if fit is not None:
                fit.update(features, busy)
        lengths = source.step(step)
        runtime = RuntimeInfo(
            step=step,
            measured_step=-1 if latest is None else latest[0],
            step_times=None if latest is None else latest[1],
            budget_shares=None if autotune is None else autotune.shares_for_step(step),
            cost_coefficients=None if fit is None else fit.coefficients(),
            memory_budget=None if budget is None else budget.for_step(lengths),
        )
        start = time.perf_counter()
        plan = part(lengths, runtime)
        elapsed = time.perf_counter() - start
        if budget is not None and getattr(part, "honours_budget", True):  # the loader's own check
            plan.validate(lengths.num_samples, s.ranks, f"partitioner {partitioner}", lengths, runtime.memory_budget)
        busy = np.asarray(step_time(lengths, plan), dtype=np.float64)
        tokens = cost_model.token_lengths(lengths)
        dest = plan.destinations().numpy()
        weights = np.bincount(dest, weights=cost_model.sample_costs(lengths, runtime), minlength=s.ranks)
        pending[step] = (busy, rank_features(tokens, dest, s.ranks), weights)
        if step < s.warmup:
            continue
        longest = busy.max()
        costs = (
            step_time.sample_costs(lengths) if hasattr(step_time, "sample_costs") else cost_model.sample_costs(lengths)
        )
        fixed = getattr(getattr(step_time, "params", None), "d", 0.0)
        held = np.bincount(dest, weights=kept_tokens(lengths, s.max_uih), minlength=s.ranks)
        limit = runtime.memory_budget
        rows.append(
            dict(
                step_s=longest + s.sync_s,
                idle_s=(longest - busy).mean(),
                samples=lengths.num_samples,
                imbalance=longest / busy.mean(),
                bound=max(1.0, (fixed + costs.max()) / (fixed + costs.sum() / s.ranks)),
                sparsity=float(per_rank_sparsity(plan, lengths.uih_lengths).mean()),
                plan_s=elapsed,
                token_ratio=held.max() / held.mean(),
                budget=None if limit is None else limit.tokens,
                budget_ratio=None if limit is None else held.max() / limit.tokens,
            )
        )
    return _record(partitioner, s, rows, autotune is not None)


def _record(partitioner: str, s: SimSettings, rows: list[dict], autotuned: bool) -> dict:
    """The JSON record of one partitioner's measured steps."""
    col = lambda key: [r[key] for r in rows if r[key] is not None]
    total_step = float(sum(col("step_s")))
    budgets, budget_ratio = col("budget"), col("budget_ratio")
    return {
        "ranks": s.ranks,
        "batch_size": s.batch_size,
        "max_uih": s.max_uih,
        "partitioner": partitioner,
        "straggler_pct": 100.0 * float(sum(col("idle_s"))) / total_step,
        "imbalance_max_over_mean": float(np.mean(col("imbalance"))),
        "lower_bound": float(np.mean(col("bound"))),
        "samples_per_s": float(sum(col("samples"))) / total_step,
        "sparsity": float(np.mean(col("sparsity"))),
        "tokens_max_over_mean": float(np.mean(col("token_ratio"))),  # per-rank kept tokens, mean over steps
        "tokens_max_over_mean_worst": float(np.max(col("token_ratio"))),
        "memory_budget": None if s.memory_budget is None else str(s.memory_budget),
        "budget_tokens_mean": float(np.mean(budgets)) if budgets else None,
        "tokens_max_over_budget_worst": float(np.max(budget_ratio)) if budget_ratio else None,
        "mean_step_s": total_step / s.steps,
        "plan_ms": 1e3 * float(np.mean(col("plan_s"))),
        "steps": s.steps,
        "warmup": s.warmup,
        "alpha": s.alpha,
        "autotune": autotuned,
        "fit_cost": s.fit_cost,
    }


def make_source(args: argparse.Namespace, ranks: int, batch_size: int, max_uih: int, steps: int) -> LengthSource:
    if args.data:
        return ParquetLengths(args.data, ranks, batch_size, max_uih)
    try:
        return PresetLengths(args.preset, ranks, batch_size, max_uih, steps, args.seed)
    except ImportError:  # fsdata.synthetic absent: the same published KuaiRand-1K median and mean
        if args.preset != "kuairand-1k":
            raise ValueError(f"preset {args.preset!r} needs fsdata.synthetic, which is not installed") from None
        return LognormalLengths(ranks, batch_size, max_uih, args.seed)


def run_grid(args: argparse.Namespace, ranks: int, batch_size: int, max_uih: int) -> list[dict]:
    settings = SimSettings(
        ranks=ranks,
        batch_size=batch_size,
        max_uih=max_uih,
        steps=args.steps,
        warmup=args.warmup,
        lookahead=args.lookahead,
        sync_s=args.sync_ms / 1e3,
        alpha=args.alpha,
        autotune=not args.no_autotune,
        fit_cost=args.fit_cost,
    )
    budget = simulated_budget(getattr(args, "memory_budget", None))
    records = []
    for name in args.partitioner.split(","):
        for spec in (None, budget) if budget is not None else (None,):
            source = make_source(args, ranks, batch_size, max_uih, args.steps + args.warmup)
            step_time = build_step_time(args)  # fresh jitter stream per run: the same noise for each
            settings.memory_budget = spec
            record = simulate(name.strip(), source, step_time, settings)
            record["step_model"] = args.step_model
            record["source"] = source.describe()
            record.update(getattr(step_time, "record", dict)())  # replay: how many fresh timings the figure rests on
            records.append(record)
    return records


def simulated_budget(value: Optional[str]) -> Optional[BudgetSpec]:
    """``--memory-budget`` for the simulator: a token count or ``Nx``; ``auto`` reads a device, none is simulated."""
    spec = BudgetSpec.parse(value)
    if spec is not None and spec.auto is not None:
        raise ValueError("--memory-budget auto reads a device's free memory; the simulator takes a token count or Nx")
    return spec


def print_table(records: list[dict], out=sys.stdout) -> None:
    header = (
        f"{'ranks':>6} {'batch':>6} {'max_uih':>8} {'partitioner':>12} {'budget':>7} {'straggler%':>10} "
        f"{'max/mean':>9} {'bound':>7} {'tok max/mean':>12} {'samples/s':>10} {'sparsity':>8} {'plan_ms':>8}"
    )
    print(header, file=out)
    for r in records:
        print(
            f"{r['ranks']:>6} {r['batch_size']:>6} {r['max_uih']:>8} {r['partitioner']:>12} "
            f"{r.get('memory_budget') or '-':>7} {r['straggler_pct']:>10.2f} {r['imbalance_max_over_mean']:>9.4f} "
            f"{r['lower_bound']:>7.4f} {r.get('tokens_max_over_mean', float('nan')):>12.4f} "
            f"{r['samples_per_s']:>10.0f} {r['sparsity']:>8.3f} {r['plan_ms']:>8.1f}",
            file=out,
        )


# ---------------------------------------------------------------------------------------------- sweeps
SWEEPS = {
    "max_uih": [1000, 2000, 4000, 8000, 12000, 16000, 21000],
    "batch_size": [32, 64, 128, 256, 512],
    "ranks": [8, 16, 32, 64, 128, 256, 512, 1024],
}


def run_sweeps(args: argparse.Namespace, out_dir: str) -> list[dict]:
    """Every sweep point for every partitioner; PNGs into ``out_dir``, records to ``--json`` (or ``out_dir``)."""
    import os

    os.makedirs(out_dir, exist_ok=True)
    records = []
    for axis, values in SWEEPS.items():
        for value in values:
            point = {"ranks": args.ranks, "batch_size": args.batch_size, "max_uih": args.max_uih, axis: value}
            for record in run_grid(args, point["ranks"], point["batch_size"], point["max_uih"]):
                record["sweep"] = axis
                records.append(record)
            print_table([r for r in records if r["sweep"] == axis and r[axis] == value])
    if not args.json:
        with open(os.path.join(out_dir, "balancer_sweep.json"), "w") as f:
            json.dump(records, f, indent=1)
    plot_sweeps(records, out_dir)
    return records


def plot_sweeps(records: list[dict], out_dir: str) -> list[str]:
    """One PNG per sweep axis: sparsity (Figure 2) and straggler % (Figure 8) against that axis."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"max_uih": "max UIH length", "batch_size": "local batch size", "ranks": "ranks"}
    paths = []
    for axis, label in labels.items():
        rows = [r for r in records if r.get("sweep") == axis]
        if not rows:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        for i, name in enumerate(dict.fromkeys(r["partitioner"] for r in rows)):
            pts = sorted((r[axis], r["sparsity"], r["straggler_pct"]) for r in rows if r["partitioner"] == name)
            xs = [p[0] for p in pts]
            style = dict(
                marker="os^xdv"[i % 6], linestyle=("-", "--", "-.", ":")[i % 4], label=name
            )  # overlaps stay visible
            left.plot(xs, [p[1] for p in pts], **style)
            right.plot(xs, [p[2] for p in pts], **style)
        for ax, title in ((left, "sparsity (Eq. 1) of the local batches"), (right, "straggler %")):
            ax.set_xlabel(label)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if axis != "max_uih":
                ax.set_xscale("log", base=2)
        right.set_yscale("log")
        left.legend(title="partitioner")
        first = rows[0]
        fixed = ", ".join(f"{k}={first[k]}" for k in labels if k != axis)
        fig.suptitle(f"simulated ({first['step_model']} model, {first['steps']} steps): {fixed}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"balancer_vs_{axis}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--step-model",
        default="cost",
        help=f"step-time model: {' | '.join(STEP_TIME_MODELS)} (default cost)",
    )
    parser.add_argument("--ranks", type=int, default=64, help="simulated ranks, 1 to 1024 (default 64)")
    parser.add_argument("--batch-size", type=int, default=128, help="local batch size per rank (default 128)")
    parser.add_argument("--max-uih", type=int, default=21000, help="UIH length cap (default 21000)")
    parser.add_argument("--partitioner", default="none,fbs,vbs,kk", help="comma-separated (default none,fbs,vbs,kk)")
    parser.add_argument("--steps", type=int, default=50, help="measured global steps per partitioner (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="steps run before measuring (autotune, cost fit)")
    parser.add_argument("--lookahead", type=int, default=2, help="a step's times feed the plan this many steps later")
    parser.add_argument("--alpha", type=float, default=1.5, help="cost exponent of the partitioners' L^alpha")
    parser.add_argument("--no-autotune", action="store_true", help="VBS without autotune")
    parser.add_argument("--fit-cost", action="store_true", help="partitioners use the online least-squares cost fit")
    parser.add_argument(
        "--memory-budget",
        default=None,
        metavar="SPEC",
        help="also run every partitioner under this per-rank budget of kept tokens: a count or Nx"
        " (N times the step's mean per rank); records and table show both",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="kuairand-1k", help="synthetic length preset (default kuairand-1k)")
    source.add_argument("--data", default=None, help="Parquet file, directory or glob: its UIH lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-ms", type=float, default=0.0, help="gradient AllReduce time added to every step")
    _add_cost_arguments(parser)
    parser.add_argument("--json", default=None, help="write the records (a JSON list) here")
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="DIR",
        help="run the max-UIH, batch-size and rank sweeps (other sizes fixed at --ranks, --batch-size,"
        " --max-uih); PNG plots into DIR, records to --json (default DIR/balancer_sweep.json)",
    )


def _add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    cost = parser.add_argument_group("cost model (--step-model cost; assumed values, see CostParams)")
    defaults = CostParams()
    cost.add_argument("--kernel", choices=["jagged", "padded"], default=defaults.kernel)
    cost.add_argument("--jitter", type=float, default=defaults.jitter, help="relative noise per rank and step")
    cost.add_argument("--cost-a", type=float, default=defaults.a, help="seconds per token")
    cost.add_argument("--cost-b", type=float, default=defaults.b, help="seconds per token pair (attention)")
    cost.add_argument("--cost-c", type=float, default=defaults.c, help="seconds per sample")
    cost.add_argument("--cost-d", type=float, default=defaults.d, help="seconds per step")
    cost.add_argument("--cost-pad", type=float, default=defaults.pad, help="seconds per padded token")


def _validate(args: argparse.Namespace) -> None:
    if not 1 <= args.ranks <= 1024:
        raise ValueError(f"--ranks must be in [1, 1024], got {args.ranks}")
    for name in ("batch_size", "max_uih", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.lookahead < 1:
        raise ValueError("--warmup must be >= 0 and --lookahead >= 1")
    for name in args.partitioner.split(","):
        get_partitioner(name.strip())  # fails early, naming a bad partitioner
    simulated_budget(getattr(args, "memory_budget", None))


def main(args: argparse.Namespace) -> int:
    _validate(args)
    records = run_sweeps(args, args.sweep) if args.sweep else run_grid(args, args.ranks, args.batch_size, args.max_uih)
    if not args.sweep:
        print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="freescale simulate")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
