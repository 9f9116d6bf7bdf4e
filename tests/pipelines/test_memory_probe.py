"""``--memory-budget auto``'s memory model measured on the job's own model (pipelines.job.memory_probe): the probe
runs the job's step on the model the job built (the HSTU model for ``--model hstu``) on batches of its kept tokens,
leaves training as it was, and the trainer hands its figures to the balancer. The CPU has no allocator statistics,
so the CPU tests measure through a stand-in that reads the batch the model got; the GPU test measures for real."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fsdata.batch import Batch
from fsdata.partition import BudgetSpec, MemoryModel, kept_tokens
from pipelines.job import memory_probe
from pipelines.job.builders import build_model_spec, build_source
from pipelines.job.config.sections import JobConfig
from pipelines.models.hstu import HSTUModel
from pipelines.models.softmax import SoftmaxModel

PER_TOKEN, FIXED = 5000.0, 1e6  # the stand-in device's memory: FIXED + PER_TOKEN per kept token


def job(model: str, memory_budget: str = "auto") -> JobConfig:
    cfg = JobConfig()
    cfg.data.preset, cfg.data.uih_cap, cfg.data.num_samples = "tiny", 64, 1000
    cfg.model.name, cfg.model.max_uih, cfg.balancer.memory_budget = model, 48, memory_budget
    return cfg


class StandIn:
    """A peak measure for the CPU: runs the call, and reports FIXED + PER_TOKEN x the kept tokens of the batch the
    model's forward got in it (seen through a forward hook), so the line the probe fits is known."""

    def __init__(self, model: torch.nn.Module, max_uih: int) -> None:
        self.batches, self.max_uih = [], max_uih
        model.register_forward_hook(lambda module, args, out: self.batches.append(args[0]))

    def __call__(self, run, device) -> float:
        run()
        return FIXED + PER_TOKEN * int(kept_tokens(self.batches[-1], self.max_uih).sum())


@pytest.mark.parametrize("name, kind", [("hstu", HSTUModel), ("tiny", SoftmaxModel)])
def test_the_probe_runs_the_jobs_own_model_on_its_kept_tokens(name, kind):
    cfg = job(name)
    source = build_source(cfg.data, 16)
    spec = build_model_spec(cfg, source)
    assert isinstance(spec.model, kind)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    rng = torch.get_rng_state()
    stand_in = StandIn(spec.model, 48)
    model = memory_probe.probe_memory_model(spec, source, torch.device("cpu"), "fp32", 48, 0.2, stand_in)
    assert model == MemoryModel(bytes_per_token=PER_TOKEN, fixed_bytes=FIXED, headroom=0.2)
    # One warm-up, then one and PROBE_COPIES copies of one sample at the model's cap, candidates kept.
    assert [b.batch_size for b in stand_in.batches] == [1, 1, memory_probe.PROBE_COPIES]
    assert all(b.uih_lengths.tolist() == [48] * b.batch_size for b in stand_in.batches)
    assert all(b.num_candidates.min() >= 1 for b in stand_in.batches)
    # Training is unchanged: no gradient left, the weights and the random stream as they were.
    assert all(p.grad is None for p in spec.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in spec.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_line_through_two_peaks():
    assert memory_probe.line_through([(10, 1500.0), (40, 4500.0)]) == (100.0, 500.0)
    assert memory_probe.line_through([(10, 5000.0), (40, 4000.0)]) == (1.0, 4990.0)  # never a free token
    assert memory_probe.line_through([(10, 0.0), (40, 9000.0)]) == (300.0, 0.0)  # never a negative fixed part
    with pytest.raises(ValueError, match="the second point needs more tokens"):
        memory_probe.line_through([(40, 1.0), (40, 2.0)])


@pytest.mark.parametrize(
    "spec, probed",
    [
        ("auto", True),
        ("AUTO:headroom=0.25", True),
        ("auto:bytes_per_token=1000", False),
        ("auto:headroom=0.2,fixed_bytes=1e9", False),
        ("600000", False),
        ("1.2x", False),
        (None, False),
    ],
)
def test_the_probe_runs_for_auto_without_figures_of_its_own(spec, probed):
    assert memory_probe.wants_probe(spec) is probed


def test_the_measured_figures_reach_the_balancer_as_a_budget_it_reads_back(monkeypatch):
    cfg = job("hstu", "auto:headroom=0.25")
    source = build_source(cfg.data, 16)
    spec = build_model_spec(cfg, source)
    cpu = torch.device("cpu")
    unchanged, none = memory_probe.measured_budget(cfg.balancer, spec, source, cpu, "fp32", 48)
    assert unchanged is cfg.balancer and none is None  # the CPU measures no peak: auto refuses where it is read
    monkeypatch.setitem(memory_probe.PEAK_BYTES, "cpu", StandIn(spec.model, 48))
    config, model = memory_probe.measured_budget(cfg.balancer, spec, source, cpu, "fp32", 48)
    assert model == MemoryModel(PER_TOKEN, FIXED, 0.25) and cfg.balancer.memory_budget == "auto:headroom=0.25"
    assert BudgetSpec.parse(config.memory_budget).auto == model and config.partitioner == cfg.balancer.partitioner
    given = job("hstu", "auto:bytes_per_token=7,fixed_bytes=0").balancer
    assert memory_probe.measured_budget(given, spec, source, cpu, "fp32", 48) == (given, None)


def _trainer_with_auto_budget(rank, world_size):
    from fsdata.partition import budget
    from pipelines.job import data as job_data
    from pipelines.job.trainer import Trainer
    from tests.harness import doing
    from tests.pipelines.tiny import tiny_config

    forwards = []
    hook = HSTUModel.forward
    HSTUModel.forward = lambda self, batch, **kwargs: forwards.append(batch) or hook(self, batch, **kwargs)

    class Peak:  # the stand-in device: FIXED + PER_TOKEN per kept token of the batch the model last got
        def __call__(self, run, device):
            seen = len(forwards)
            run()
            assert len(forwards) == seen + 1, "the probe's call ran no forward of the job's HSTU model"
            return FIXED + PER_TOKEN * int(kept_tokens(forwards[-1], 48).sum())

    memory_probe.PEAK_BYTES["cpu"] = Peak()
    budget.device_free_bytes = lambda device=None: 2**30
    stages = []
    balancer_stages = job_data.balancer_stages
    job_data.balancer_stages = lambda config, *a, **k: stages.append(config) or balancer_stages(config, *a, **k)
    doing("train hstu with --memory-budget auto")
    cfg = tiny_config("freescale", 3)
    cfg.model.name, cfg.model.max_uih, cfg.balancer.memory_budget = "hstu", 48, "auto"
    with Trainer(cfg.validate(), rank=rank, world_size=world_size, device=torch.device("cpu")) as trainer:
        probed = [b.batch_size for b in forwards]
        trainer.train()
        losses = [r["loss"] for r in trainer.history]
    return probed, [c.memory_budget for c in stages], losses


@pytest.mark.multiprocess
def test_the_trainer_probes_the_jobs_model_and_balances_under_its_budget():
    from tests.harness import run_ranks

    for probed, budgets, losses in run_ranks(_trainer_with_auto_budget, 2, timeout=120):
        assert probed == [1, 1, memory_probe.PROBE_COPIES]  # the HSTU model, before the first step
        assert budgets == [memory_probe.spelling(MemoryModel(PER_TOKEN, FIXED, 0.1))]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probed_line_predicts_the_peak_of_larger_batches_on_cuda():
    """The line through one and four copies at the cap predicts the peak of 16 copies of another sample, bf16, HSTU
    Triton kernel, within 10%."""
    device = torch.device("cuda")
    cfg = job("hstu")
    cfg.data.preset, cfg.data.uih_cap, cfg.model.max_uih, cfg.model.dim = "kuairand-1k", 2048, 2048, 256
    source = build_source(cfg.data, 16)
    spec = build_model_spec(cfg, source)
    spec.model.to(device)
    model = memory_probe.probe_memory_model(spec, source, device, "auto", 2048, 0.1)
    assert model.bytes_per_token > 1024  # a 256-wide model keeps kilobytes per token for its backward
    having = np.flatnonzero(source.read(0, 0, 64).uih_lengths.numpy() > 0)
    other = memory_probe.equal_length(source.read(0, int(having[1]), int(having[1]) + 1), 2048)
    batch = Batch.concat([other] * 16)
    peak = memory_probe.cuda_peak_bytes(lambda: memory_probe.step_once(spec, batch, device, "auto"), device)
    predicted = model.fixed_bytes + model.bytes_per_token * int(kept_tokens(batch, 2048).sum())
    assert predicted == pytest.approx(peak, rel=0.10), (predicted / 2**30, peak / 2**30)
