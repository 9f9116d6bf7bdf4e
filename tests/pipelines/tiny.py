"""The small CPU job the trainer tests run on gloo ranks: the tiny preset, UIH capped at 64, 8 samples per rank."""

from __future__ import annotations


def tiny_config(mode: str, steps: int):
    """A JobConfig, not yet validated (callers set what their test varies, then ``validate()``)."""
    from pipelines.job.config.sections import JobConfig

    cfg = JobConfig()
    cfg.data.preset, cfg.data.uih_cap, cfg.data.num_samples = "tiny", 64, 10_000
    cfg.model.max_uih, cfg.loader.batch_size = 64, 8
    cfg.run.mode, cfg.run.steps, cfg.run.device, cfg.run.progress = mode, steps, "cpu", False
    return cfg
