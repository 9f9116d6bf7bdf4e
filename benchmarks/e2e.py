"""`python -m benchmarks e2e`: every train mode on the same data in one invocation, bubbles side by side.

For each case (a workload) and each mode it launches the same job (`pipelines.job.launch.launcher.launch`), then
prints one table: samples/s, step time, exposed communication by part, straggler %, bubbles, NE, peak memory, and the
bubble reduction of freescale against sync (``bubble_reduction``, a fraction: 0.9 = 90% fewer bubbles; of the
per-step means, and ``bubble_reduction_median`` of the per-step medians).
``--modes ...,torchrec,torchrec-pec`` adds the real torchrec as an outside baseline (CPU only): its synchronous
pipeline and its prioritized embedding communication (PEC); what they cannot measure shows as "n/m" (None in the
JSON), never as 0. ``losses against sync`` gives, per run, every mode's largest per-step loss difference to sync's
(``loss_max_diff_vs_sync`` in the JSON; 0 and "bit for bit" where every step's loss is sync's).
``moved``: the steps whose samples the balancer moved; the balance
gate (``--min-gain``, fsdata.partition.gate) keeps the others local when moving would not pay. ``emb``: the
embedding schedule freescale kept after its probe (pipelines.job.run.schedule_probe; prio or sdd); every mode's
timings leave out the same warm-up steps, the probe's included.

Every case runs the softmax model with ``--attention`` (default jagged: no padding, so a rank's step costs
what the sum of its samples' L^2 costs, the imbalance the balancer removes; ``padded`` for comparison), or with
``--model hstu`` / ``hstu-large`` the HSTU model (pipelines.models.hstu: each sample's kept UIH then its candidates
in one jagged sequence, its own attention kernel; jagged only). Under the table, per case and run, ``straggler
share`` puts sync's straggler % (no balancer) beside freescale's: the share of the step that ranks spent waiting for
the slowest one, in real training; and ``NE against sync`` puts every mode's NE beside sync's, with the difference
(``ne_minus_sync`` in the JSON): the modes train the same model on the same global batches, so their NE differs by
float rounding alone (the balancer's summation order, and on a GPU bf16), whatever the model. With ``--repeats``
2 or more, ``NE run to run`` gives sync's own spread over the runs beside the largest gap of a mode to sync: where
training amplifies bf16 rounding (the HSTU model under Adam), two sync runs already differ, and that is the floor.

Cases:
    heavy   long, heavy-tailed UIH (where balancing and prioritized updates should pay)
    light   short sequences, tiny tables (where FreeScale should not help: it must cost nothing there); the item
            table has as many rows as the tiny preset's vocabulary (10,000), so both ranks' shards are used
    long    production-like histories, KuaiRand lengths capped at 16,384, the small model (d=64, 2 layers): the
            step FreeScale is meant for; not in the default ``--cases``, and ``--model`` / ``--uih-cap`` leave it
            as it is (``--batch-size`` still applies)

``--precision`` (default auto: bf16 autocast on CUDA, fp32 on CPU) is the model's compute in every run.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

from pipelines.api.modes import MODES as ALL_MODES
from pipelines.api.modes import TORCHREC_MODES
from pipelines.job.config.flags import add_tuning_arguments, apply_tuning
from pipelines.job.config.sections import JobConfig
from pipelines.job.run.schedule_probe import PROBE_START, ScheduleProbe
from pipelines.models.hstu import HSTU_PRESETS

# every mode but the torchrec baselines (CPU only: --modes ...,torchrec,torchrec-pec adds them)
MODES = tuple(name for name in ALL_MODES if name not in TORCHREC_MODES)
TORCHREC_NOTE = (
    "torchrec: the real DistributedModelParallel + TrainPipelineSparseDist (pipelines.models.torchrec_baseline).\n"
    "  n/m = not measured: its ID AllToAll (input dist), embedding and gradient AllToAlls and DDP's all-reduce run\n"
    "  inside progress(), which times none of its parts, so compute alone, straggler % and bubbles are unknown;\n"
    "  step time, QPS, data, label count and NE are measured as in every mode (step time includes one bookkeeping\n"
    "  all-reduce).\n"
    "  Same data, initial weights, loss scaling and optimizers as sync (dense Adam; table SGD / row-wise Adagrad in\n"
    "  fbgemm); the loss is multiplied by the world size to undo DDP's and torchrec's division of gradients by it;\n"
    "  losses match sync to float rounding (fbgemm and DDP sum in other orders), not bit for bit."
)
TORCHREC_PEC_NOTE = (
    "torchrec-pec: torchrec's PEC (PECEmbeddingCollectionSharder) driven as upstream's TrainPipelinePEC\n"
    "  (pipelines.models.torchrec_pec): the next batch's non-overlapped rows looked up a step ahead, their gradient\n"
    "  applied a step late; n/m as for torchrec (its exchanges are timed as one step). PEC's gradient AllToAll does\n"
    "  not divide by the world size: the rows' gradient is scaled by 1/world size before it, so it trains sync's\n"
    "  numbers to float rounding; the item table is read by one feature (torchrec 1.8.0's PEC updates other rows\n"
    "  with several: docs/pec.md)."
)
CASES = {
    "heavy": dict(preset="kuairand-1k", uih_cap=2_048, batch_size=8, model="tiny", max_uih=2_048),
    "light": dict(preset="tiny", uih_cap=64, batch_size=16, model="tiny", max_uih=64, num_items=10_000),
    # production-like histories (the cap of KuaiRand-27k's long tail), a batch two ranks fit on one GPU
    "long": dict(preset="kuairand-1k", uih_cap=16_384, batch_size=16, model="small", max_uih=16_384),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="local ranks per run")
    parser.add_argument("--steps", type=int, default=45, help="steps per run (warm-up included)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="first steps of every run left out of the timings, in every mode alike (compilation, first "
        "pinned allocations, and freescale's embedding-schedule probe); their wall time is shown "
        "apart (warm ms) and every step's time stays in the JSON (default: 3, or 3 plus the probe's "
        f"{ScheduleProbe.length()} steps when a freescale run probes)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes (add torchrec,torchrec-pec for the real torchrec's, CPU only)",
    )
    parser.add_argument("--cases", default="heavy,light", help=f"comma-separated cases of {sorted(CASES)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--uih-cap", type=int, default=None, help="override the heavy case's UIH cap")
    parser.add_argument("--batch-size", type=int, default=None, help="override every case's local batch size")
    parser.add_argument(
        "--model",
        default=None,
        help="override every case's model preset but long's: the softmax model's (tiny, small, ...) or the HSTU"
        " model's (hstu, hstu-large)",
    )
    parser.add_argument(
        "--attention",
        choices=("jagged", "padded"),
        default="jagged",
        help="the softmax model's attention in every run (see --attention of train)",
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="the model's compute in every run (see --precision of train)",
    )
    parser.add_argument(
        "--partitioner", default="fbs", help="the balancer's partitioner in mode freescale (fbs, vbs, kk)"
    )
    parser.add_argument(
        "--min-gain",
        type=float,
        default=None,
        help="override the balance gate's threshold (0: the balancer moves samples every step)",
    )
    # every tuning knob of `freescale train` (--TABLE.NAME; default: the train default)
    add_tuning_arguments(parser, show=True)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every case's modes this many times, interleaved (sync, freescale, sync, ...), and print "
        "the spread of freescale's paired ratios to sync (for noisy machines)",
    )
    parser.add_argument("--json", help="write the records here")
    parser.add_argument(
        "--trace", help="write a torch.profiler trace of every run: DIR/CASE_MODE.rankR.json (Perfetto)"
    )
    parser.add_argument("--plot", help="write the NE-parity plot (cumulative NE per step, every mode) here (PNG)")


def case_config(case: str, mode: str, args: argparse.Namespace) -> JobConfig:
    c = dict(CASES[case])
    if args.uih_cap and case == "heavy":
        c["uih_cap"] = c["max_uih"] = args.uih_cap
    cfg = JobConfig()
    cfg.data.preset, cfg.data.uih_cap, cfg.data.num_samples = c["preset"], c["uih_cap"], 1_000_000
    cfg.loader.batch_size = args.batch_size or c["batch_size"]
    cfg.model.name, cfg.model.max_uih = (args.model if case != "long" else None) or c["model"], c["max_uih"]
    cfg.model.num_items = c.get("num_items")
    cfg.model.attention = args.attention
    cfg.run.mode, cfg.run.steps, cfg.run.nproc = mode, args.steps, args.nproc
    cfg.run.warmup_steps = warmup_steps(args)
    cfg.run.device, cfg.run.progress = args.device, False
    cfg.run.precision = args.precision
    cfg.balancer.partitioner = args.partitioner
    if args.min_gain is not None:
        cfg.balancer.min_gain = args.min_gain
    apply_tuning(args, cfg)
    if args.trace:
        cfg.run.trace = str(Path(args.trace) / f"{case}_{mode}")
    return copy.deepcopy(cfg.validate())


def warmup_steps(args: argparse.Namespace) -> int:
    """The steps every mode leaves out of its timings: ``--warmup-steps``, else 3, plus freescale's schedule
    probe when it runs (so that every mode is timed over the same steps, all of them past the probe)."""
    if args.warmup_steps is not None:
        return args.warmup_steps
    probing = "freescale" in args.modes.split(",") and (getattr(args, "embeddings.schedule") or "auto") == "auto"
    return PROBE_START + ScheduleProbe.length() if probing else 3


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else 1e3 * seconds


def _row(case: str, s: dict) -> dict:
    exposed = s["exposed_s"]
    unknown = any(v is None for v in exposed.values())
    return {
        "case": case,
        "mode": s["mode"],
        "samples_per_s": s["samples_per_s"],
        "step_time_ms": 1e3 * s["step_time_s"],
        "step_time_median_ms": 1e3 * s["step_time_median_s"],
        "data_wait_median_ms": 1e3 * s["data_wait_median_s"],
        "data_blocked_median_ms": 1e3 * s["data_blocked_median_s"],
        # the stage worker's own waits per item (off the critical path unless the training thread waits: data)
        "loader_worker_ms": {k: 1e3 * v["mean_s"] for k, v in (s.get("loader_worker_timing") or {}).items()},
        "compute_median_ms": _ms(s["compute_median_s"]),
        "exposed_ms": {k: _ms(v) for k, v in exposed.items()},
        "exposed_total_ms": None if unknown else 1e3 * sum(exposed.values()),
        "straggler_pct": s["straggler_pct"],
        "bubble_ms": _ms(s["bubble_s"]),
        "bubble_median_ms": _ms(s["bubble_median_s"]),
        "warmup_steps": s["warmup_steps"],
        "warmup_ms": 1e3 * s["warmup_s"],
        "drain_steps": s["drain_steps"],
        "drain_ms": 1e3 * s["drain_s"],  # the run's last step, left out of the timings in every mode (trainer)
        "gc_ms": 1e3 * s["gc_s"],  # rank 0's garbage-collection pauses over the timed steps (max: gc_max_ms)
        "gc_max_ms": 1e3 * s["gc_max_s"],
        "step_times_ms": [1e3 * t for t in s["step_times_s"]],
        "bubbles_ms": [_ms(t) for t in s["bubbles_s"]],
        "exposed_per_step_ms": {k: [_ms(t) for t in v] for k, v in s["exposed_per_step_s"].items()},
        "straggler_per_step_ms": [_ms(t) for t in s["straggler_per_step_s"]],
        "stall_clues_per_step": s["stall_clues_per_step"],  # rank 0's gc pauses (s) and new pinned blocks
        "kernel_variants": s["kernel_variants"],
        "per_rank_compute_ms": [_ms(t) for t in s["per_rank_compute_s"]],
        "partitioner": s["config"]["balancer"]["partitioner"],
        "model": s["config"]["model"]["name"],
        # the HSTU model's attention is its own (kernels.hstu), whatever --attention says
        "attention": "hstu" if s["config"]["model"]["name"] in HSTU_PRESETS else s["config"]["model"].get("attention"),
        "min_gain": s["config"]["balancer"]["min_gain"],
        "embedding_schedule": s.get("embedding_schedule"),  # freescale: the probe's choice and its median step times
        "balanced_steps": s["balanced_steps"],  # steps whose samples the balancer moved (None: no balancer)
        "predicted_gains": s["predicted_gains"],  # per step, the balance gate's (None: no prediction yet)
        "unmeasured": s.get("unmeasured", []),
        "ne": s["ne"],
        "loss": s["loss"],
        "loss_curve": s["loss_curve"],
        # the busiest rank's peak (the table), and every rank's (the JSON)
        "peak_memory_mib": max(s.get("peak_memory_bytes_per_rank") or [s["peak_memory_bytes"] or 0]) / 2**20,
        "peak_memory_mib_per_rank": [b / 2**20 for b in s.get("peak_memory_bytes_per_rank") or []],
        "steps": s["steps"],
        "curve_steps": s["curve_steps"],
        "ne_curve": s["ne_curve"],
        "world_size": s["world_size"],
    }


def _run(cfg: JobConfig) -> dict:
    """One job's summary, with every step's series (the summary holds aggregates only) read back from its
    ``--metrics-jsonl``."""
    from pipelines.job.launch.launcher import launch
    from pipelines.job.run.aggregates import per_step, read_metrics
    from pipelines.job.train import worker

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as folder:
        cfg.run.metrics_jsonl = str(Path(folder) / "metrics.jsonl")
        summary = launch(cfg, worker)
        return {**summary, **per_step(read_metrics(cfg.run.metrics_jsonl))}


def main(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; choose from {sorted(CASES)}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.model in HSTU_PRESETS and args.attention != "jagged":
        raise SystemExit(
            f"--attention {args.attention} is the softmax model's; --model {args.model} packs its sequences "
            "(jagged) always"
        )
    rows = []
    for case in cases:
        for repeat in range(args.repeats):
            for mode in modes:
                print(
                    f"[bench e2e] case {case}, mode {mode}, run {repeat + 1}/{args.repeats}: {args.nproc} ranks x "
                    f"{args.steps} steps on {args.device}",
                    flush=True,
                )
                row = _row(case, _run(case_config(case, mode, args)))
                row["repeat"] = repeat
                rows.append(row)
    pair_with_sync(rows)
    _print_table(rows)
    for line in straggler_shares(rows) + ne_against_sync(rows) + losses_against_sync(rows):
        print(line)
    if args.repeats > 1:
        for line in spread(rows) + ne_run_to_run(rows):
            print(line)
    for line in stalled_steps(rows):
        print(line)
    if args.plot:
        _plot_ne(rows, args.plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _runs(rows: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    """The rows grouped by (case, run), each group by mode: sync and freescale pair up only within a run."""
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["case"], r.get("repeat", 0)), {})[r["mode"]] = r
    return dict(sorted(out.items()))


def pair_with_sync(rows: list[dict]) -> None:
    """Sets freescale's ``bubble_reduction`` (of the per-step means) and ``bubble_reduction_median`` (of the
    per-step medians: the typical step, without one-off outliers) against sync of the same case and run."""
    for by_mode in _runs(rows).values():
        sync, ours = by_mode.get("sync"), by_mode.get("freescale")
        for r in by_mode.values():
            r["bubble_reduction"] = r["bubble_reduction_median"] = None
            both = sync is not None and r.get("ne") is not None and sync.get("ne") is not None
            r["ne_minus_sync"] = r["ne"] - sync["ne"] if both else None
            curves = (r.get("loss_curve"), (sync or {}).get("loss_curve"))
            same = None not in curves and len(curves[0]) == len(curves[1])
            r["loss_max_diff_vs_sync"] = max((abs(a - b) for a, b in zip(*curves)), default=0.0) if same else None
        if sync is None or ours is None or not (sync["bubble_ms"] or 0) > 0:
            continue
        ours["bubble_reduction"] = 1.0 - ours["bubble_ms"] / sync["bubble_ms"]
        ours["bubble_reduction_median"] = 1.0 - ours["bubble_median_ms"] / sync["bubble_median_ms"]


def straggler_shares(rows: list[dict]) -> list[str]:
    """Per case and run: sync's straggler % beside freescale's (the share of the step spent waiting for the
    slowest rank, without and with the balancer)."""
    lines = []
    for (case, repeat), by_mode in _runs(rows).items():
        sync, ours = by_mode.get("sync"), by_mode.get("freescale")
        if sync is None or ours is None or sync["straggler_pct"] is None or ours["straggler_pct"] is None:
            continue
        lines.append(
            f"straggler share, {case} (run {repeat + 1}, {ours.get('attention') or 'jagged'} attention): "
            f"sync {sync['straggler_pct']:.1f}%, freescale {ours['straggler_pct']:.1f}% "
            f"({ours['partitioner']}, moved {ours['balanced_steps']} steps)"
        )
    return lines


def ne_against_sync(rows: list[dict]) -> list[str]:
    """Per case and run with sync and another mode: every mode's NE beside sync's, and the difference (set by
    :func:`pair_with_sync`)."""
    lines = []
    for (case, repeat), by_mode in _runs(rows).items():
        sync = by_mode.get("sync")
        others = [r for mode, r in by_mode.items() if mode != "sync" and r.get("ne_minus_sync") is not None]
        if sync is None or not others:
            continue
        lines.append(
            f"NE against sync, {case} (run {repeat + 1}, model {sync.get('model')}): sync {sync['ne']:.6f}; "
            + ", ".join(f"{r['mode']} {r['ne']:.6f} ({r['ne_minus_sync']:+.1e})" for r in others)
        )
    return lines


def losses_against_sync(rows: list[dict]) -> list[str]:
    """Per case and run with sync and another mode: every mode's largest per-step loss difference to sync's."""
    lines = []
    for (case, repeat), by_mode in _runs(rows).items():
        others = [r for mode, r in by_mode.items() if mode != "sync" and r.get("loss_max_diff_vs_sync") is not None]
        if "sync" in by_mode and others:
            lines.append(
                f"losses against sync, {case} (run {repeat + 1}, {len(by_mode['sync']['loss_curve'])} steps): "
                + ", ".join(f"{r['mode']} {_loss_gap(r['loss_max_diff_vs_sync'])}" for r in others)
            )
    return lines


def _loss_gap(gap: float) -> str:
    return "bit for bit" if gap == 0 else f"max |diff| {gap:.1e}"


def ne_run_to_run(rows: list[dict]) -> list[str]:
    """Per case with two sync runs or more: how far sync's NE moves from run to run on its own (bf16 kernels whose
    sums are not reproducible, amplified by training), beside the largest gap between another mode and sync of
    the same run: 'NE equal to sync's' reads against that floor, as a straggler share reads against its noise."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        syncs = [r["ne"] for r in rows if r["case"] == case and r["mode"] == "sync" and r.get("ne") is not None]
        gaps = [
            abs(r["ne_minus_sync"])
            for r in rows
            if r["case"] == case and r["mode"] != "sync" and r.get("ne_minus_sync") is not None
        ]
        if len(syncs) < 2 or not gaps:
            continue
        lines.append(
            f"NE run to run, {case}: sync {min(syncs):.6f}-{max(syncs):.6f} over {len(syncs)} runs (spread "
            f"{max(syncs) - min(syncs):.1e}); largest |mode - sync| of one run {max(gaps):.1e}"
        )
    return lines


def spread(rows: list[dict]) -> list[str]:
    """Per case, over the runs: freescale's bubble reduction and samples/s ratio to sync of the same run."""
    paired: dict[str, list[tuple[float, float]]] = {}
    for (case, _), by_mode in _runs(rows).items():
        if "sync" in by_mode and by_mode.get("freescale", {}).get("bubble_reduction") is not None:
            ours = by_mode["freescale"]
            paired.setdefault(case, []).append(
                (ours["bubble_reduction"], ours["samples_per_s"] / by_mode["sync"]["samples_per_s"])
            )
    kept: dict[str, list[str]] = {}
    for r in rows:
        if r["mode"] == "freescale" and r.get("embedding_schedule"):
            kept.setdefault(r["case"], []).append(r["embedding_schedule"]["choice"] or "none")
    lines = []
    for case, pairs in paired.items():
        reductions, ratios = [p[0] for p in pairs], [p[1] for p in pairs]
        lines.append(
            f"{case}: over {len(pairs)} runs, bubble_reduction median {100 * statistics.median(reductions):.1f}% "
            f"(min {100 * min(reductions):.1f}%, max {100 * max(reductions):.1f}%); freescale/sync samples/s "
            f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
            + (
                f"; embedding schedule kept: {', '.join(f'{k} {v}x' for k, v in sorted(Counter(kept[case]).items()))}"
                if kept.get(case)
                else ""
            )
        )
    return lines


def stalled_steps(rows: list[dict], factor: float = 5.0, floor_ms: float = 5.0) -> list[str]:
    """One line per timed step whose bubbles exceed ``factor`` times its run's median and ``floor_ms``: the part
    that absorbed it, and rank 0's clues (gc pause, new pinned blocks) in that step."""
    lines = []
    for r in rows:
        median, steps = r.get("bubble_median_ms"), r.get("bubbles_ms") or []
        if median is None:
            continue
        clues = r.get("stall_clues_per_step") or {}
        for i in range(r["warmup_steps"], len(steps) - r["drain_steps"]):
            if steps[i] is None or steps[i] <= max(factor * median, floor_ms):
                continue
            parts = {k: v[i] for k, v in r["exposed_per_step_ms"].items() if v[i]}
            worst = max(parts, key=parts.get) if parts else "straggler"
            found = [f"gc {1e3 * clues['gc_s'][i]:.1f} ms"] if clues.get("gc_s") else []
            found += [
                f"{k.replace('_', ' ')} {clues[k][i]}"
                for k in ("new_relay_blocks", "new_pinned_blocks")
                if clues.get(k) is not None
            ]
            lines.append(
                f"stalled step: {r['case']} {r['mode']} run {r.get('repeat', 0) + 1} step {i}: bubbles "
                f"{steps[i]:.1f} ms (run median {median:.2f}), most in {worst}"
                + (f"; rank 0: {', '.join(found)}" if found else "")
            )
    return lines


def _cell(value: Optional[float], width: int, digits: int) -> str:
    """A number, or "n/m" where the mode cannot measure it (never a 0 that looks measured)."""
    return f"{'n/m':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _schedule_cell(row: dict) -> str:
    """freescale's embedding schedule after the probe: prio, sdd, or ? when the run ended inside the probe."""
    schedule = row.get("embedding_schedule")
    if not schedule:
        return "-"
    return {"prioritized": "prio", "sdd": "sdd", None: "?"}[schedule["choice"]]


def _print_table(rows: list[dict]) -> None:
    parts = ("data", "ids_a2a", "emb_a2a", "grad_a2a", "balancer", "label_count", "dense_allreduce")
    head = f"{'case':<6} {'mode':<12} {'QPS':>8} {'step ms':>8} {'med ms':>7} {'comp ms':>7} " + " ".join(
        f"{p[:9]:>9}" for p in parts
    )
    head += f" {'strag %':>7} {'bubble ms':>9} {'med bub':>7} {'warm ms':>7} {'NE':>8} {'peak MiB':>8}"
    head += f" {'moved':>5} {'emb':>4} {'bubble red.':>11}"
    print(head)
    for r in rows:
        red = r.get("bubble_reduction")
        print(
            f"{r['case']:<6} {r['mode']:<12} {r['samples_per_s']:>8.1f} {r['step_time_ms']:>8.1f} "
            f"{r['step_time_median_ms']:>7.1f} {_cell(r['compute_median_ms'], 7, 1)} "
            + " ".join(_cell(r["exposed_ms"].get(p, 0.0), 9, 2) for p in parts)
            + f" {_cell(r['straggler_pct'], 7, 1)} {_cell(r['bubble_ms'], 9, 2)} {_cell(r['bubble_median_ms'], 7, 2)} "
            f"{r['warmup_ms']:>7.0f} {r['ne']:>8.5f} {r['peak_memory_mib']:>8.0f}"
            + f" {'-' if r.get('balanced_steps') is None else r['balanced_steps']:>5} {_schedule_cell(r):>4}"
            + (f" {100 * red:>10.1f}%" if red is not None else f" {'':>11}")
        )
    if any(r["mode"] == "torchrec" for r in rows):
        print(TORCHREC_NOTE)
    if any(r["mode"] == "torchrec-pec" for r in rows):
        print(TORCHREC_PEC_NOTE)


def _plot_ne(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 3.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for r in (r for r in rows if r["case"] == case):
            ax.plot(
                [step + 1 for step in r["curve_steps"]],
                r["ne_curve"],
                label=r["mode"],
                linestyle="--" if r["mode"] == "freescale" else "-",
            )
        ax.set_title(f"cumulative NE, case {case}")
        ax.set_xlabel("step")
        ax.set_ylabel("NE")
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"NE parity plot written to {path}")
