"""The embedding schedule probe (pipelines.job.run.schedule_probe): which schedule each step runs, and the choice."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.job.run.schedule_probe import ScheduleProbe, describe_choice


def run(probe: ScheduleProbe, seconds, steps: int, first: int = 0) -> list[str]:
    """Drives the probe as the trainer does: step j's schedule before it, step j-1's time during it."""
    ran = []
    for step in range(first, first + steps):
        ran.append(probe.schedule_for(step))
        probe.observe(step - 1, seconds(step - 1, ran[step - 1 - first] if step > first else None))
    return ran


def test_fixed_schedules_never_probe():
    for schedule in ("prioritized", "sdd"):
        probe = ScheduleProbe(schedule)
        assert run(probe, lambda s, k: 1.0, 30) == [schedule] * 30
        assert probe.choice == schedule and probe.times == {"prioritized": [], "sdd": []}


@pytest.mark.parametrize("faster,choice", [("sdd", "sdd"), ("prioritized", "prioritized")])
def test_auto_probes_both_then_keeps_the_faster(faster, choice):
    start, k = 3, 4
    probe = ScheduleProbe("auto", start=start, steps=k)
    ran = run(probe, lambda s, sched: 1.0 if sched == faster else 2.0, 30)
    decided = start + 2 * k + 3
    # probe A (with the step that runs while its last time is on its way), the transition, probe B (same)
    assert ran[: start + k + 1] == ["prioritized"] * (start + k + 1)
    assert ran[start + k + 1 : decided] == ["sdd"] * (k + 2)
    assert ran[decided:] == [choice] * (30 - decided)
    assert probe.choice == choice and probe.decided_at == decided
    assert decided + 1 == start + ScheduleProbe.length(k)
    assert len(probe.times["prioritized"]) == len(probe.times["sdd"]) == k


def test_warm_up_and_transition_steps_are_not_measured():
    """Huge times in the warm-up steps and in sdd's first step (it flushes) must not decide anything."""
    start, k = 2, 3
    probe = ScheduleProbe("auto", start=start, steps=k)
    transition = start + k + 1

    def seconds(step, sched):
        return 100.0 if step < start or step == transition else (1.0 if sched == "sdd" else 1.5)

    run(probe, seconds, 20)
    assert probe.choice == "sdd" and max(probe.times["sdd"] + probe.times["prioritized"]) < 100.0


def test_prioritized_is_kept_only_where_it_pays_the_margin():
    """prioritized must be at least ``margin`` faster; within it (or slower) the job runs sdd."""
    for prioritized_s, choice in ((0.95, "sdd"), (1.05, "sdd"), (0.85, "prioritized")):
        probe = ScheduleProbe("auto", start=0, steps=2, margin=0.1)
        run(probe, lambda s, sched: prioritized_s if sched == "prioritized" else 1.0, 20)
        assert probe.choice == choice, prioritized_s


def test_a_resumed_job_probes_from_its_first_step():
    probe = ScheduleProbe("auto", first_step=100, start=3, steps=2)
    ran = run(probe, lambda s, sched: 1.0 if sched == "sdd" else 3.0, 20, first=100)
    assert probe.decided_at == 100 + 3 + 2 * 2 + 3 and ran[-1] == "sdd"


def test_a_short_job_ends_inside_the_probe():
    probe = ScheduleProbe("auto", start=1, steps=4)
    run(probe, lambda s, sched: 1.0, 7)
    assert probe.choice is None and probe.summary()["choice"] is None


@pytest.mark.parametrize("kwargs", [dict(schedule="semisync"), dict(steps=0), dict(start=-1), dict(margin=1.0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ScheduleProbe(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.01, 1.0), min_size=40, max_size=40),
    st.integers(0, 4),
    st.integers(1, 5),
    st.sampled_from([0.0, 0.05, 0.2]),
)
def test_the_choice_is_the_rule_on_the_measured_steps(times, start, k, margin):
    """Whatever the times: the choice is prioritized exactly when the median of the prioritized steps it measured
    is at least ``margin`` below that of the sdd ones, and every measured step ran the schedule it is filed under."""
    probe = ScheduleProbe("auto", start=start, steps=k, margin=margin)
    ran = run(probe, lambda s, sched: times[s], 40)
    assert probe.choice is not None
    measured = {sched: [t for t in probe.times[sched]] for sched in probe.times}
    for sched, values in measured.items():
        assert len(values) == k
        assert all(any(times[s] == v and ran[s] == sched for s in range(40)) for v in values)
    pays = statistics.median(measured["prioritized"]) < (1 - margin) * statistics.median(measured["sdd"])
    assert probe.choice == ("prioritized" if pays else "sdd")


@pytest.mark.parametrize(
    "prioritized_s,line",
    [
        (0.0903, "prioritized 90.3 ms, sdd 94.4 ms; prioritized 4.3% faster, kept only when at least 5% faster)"),
        (0.0600, "prioritized 60.0 ms, sdd 94.4 ms; prioritized 36.4% faster, kept only when at least 5% faster)"),
        (0.1000, "prioritized 100.0 ms, sdd 94.4 ms; prioritized 5.9% slower, kept only when at least 5% faster)"),
    ],
)
def test_the_summary_line_names_the_margin_that_decided(prioritized_s, line):
    """The run summary's line: which schedule, from which step, both medians and the margin between them."""
    probe = ScheduleProbe("auto", start=0, steps=2)
    run(probe, lambda s, sched: prioritized_s if sched == "prioritized" else 0.0944, 12)
    choice = "prioritized" if prioritized_s < 0.95 * 0.0944 else "sdd"
    assert describe_choice(probe.summary()) == f"{choice} from step {probe.decided_at} (probe medians: {line}"


def test_the_summary_line_of_a_run_that_ended_inside_the_probe():
    probe = ScheduleProbe("auto", start=0, steps=4)
    run(probe, lambda s, sched: 0.05, 3)
    assert describe_choice(probe.summary()) == (
        "not chosen: the run ended inside the schedule probe (probe medians: prioritized 50.0 ms)"
    )


# ---------------------------------------------------------------- in the trainer, on gloo ranks
STEPS = 16


def _config(mode: str, schedule: str = "auto"):
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config(mode, STEPS)
    cfg.balancer.partitioner = "none"  # the same samples on every rank as in sync: losses equal bit for bit
    cfg.embeddings.schedule = schedule
    return cfg.validate()


RUNS = {  # name: (mode, schedule, the schedule whose probe times are made the faster; None: measured)
    "sync": ("sync", "auto", None),
    "sdd wins": ("freescale", "auto", "sdd"),
    "prioritized wins": ("freescale", "auto", "prioritized"),
    "measured": ("freescale", "auto", None),
    "fixed sdd": ("freescale", "sdd", None),
}


def _train(rank, world_size, name):
    """One run per process group (a process makes its thread groups once)."""
    import torch

    from pipelines.job.trainer import Trainer

    mode, schedule, faster = RUNS[name]
    trainer = Trainer(_config(mode, schedule), rank=rank, world_size=world_size, device=torch.device("cpu"))
    if faster is not None:  # the probe's times replaced: the named schedule wins, on every rank alike
        probe, observe = trainer.schedule_probe, trainer.schedule_probe.observe
        probe.observe = lambda step, s: observe(step, 1.0 if probe._ran.get(step) == faster else 2.0)
    trainer.train()
    probe = trainer.schedule_probe
    return {
        "losses": [r["loss"] for r in trainer.history],
        "ran": [r.get("schedule") for r in trainer.history],
        "choice": None if probe is None else probe.choice,
        "decided_at": None if probe is None else probe.decided_at,
        "allocations": [r["relay_allocations"] for r in trainer.history],
    }


@pytest.mark.multiprocess
def test_the_trainer_switches_schedules_on_every_rank_alike_and_keeps_sync_losses():
    from pipelines.job.run.schedule_probe import PROBE_START
    from tests.harness import run_ranks

    results = {name: run_ranks(_train, 2, args=(name,), timeout=120) for name in RUNS}
    decided = PROBE_START + 2 * 4 + 3
    for name, (r0, r1) in results.items():
        assert r0["ran"] == r1["ran"], f"{name}: the ranks ran other schedules"
        assert all(n >= 0 for n in r0["allocations"]) and r0["allocations"] == sorted(r0["allocations"])  # cumulative
        assert r0["losses"] == results["sync"][0]["losses"], f"{name}: losses differ from sync"
    sdd, prio = results["sdd wins"][0], results["prioritized wins"][0]
    assert sdd["choice"] == "sdd" and sdd["ran"][decided:] == ["sdd"] * (STEPS - decided)
    assert prio["choice"] == "prioritized" and prio["decided_at"] == decided
    assert prio["ran"][decided:] == ["prioritized"] * (STEPS - decided) and "sdd" in prio["ran"][:decided]
    assert results["measured"][0]["choice"] in ("sdd", "prioritized")
    assert results["fixed sdd"][0]["ran"] == ["sdd"] * STEPS
