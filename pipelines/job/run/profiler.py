"""``--trace``: a torch.profiler window of a few steps past the warm-up, one Chrome trace per rank (Perfetto; read by
``freescale trace``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch


def trace_window(path: Optional[str], rank: int, steps: int, warmup_steps: int, device: torch.device):
    """The started profiler (the loop calls its ``step()`` once a step and ``stop()`` at the end), None without
    ``path``. Rank r writes ``PATH.rank{r}.json``."""
    if not path:
        return None
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import schedule as profiled_steps

    target = Path(f"{path}.rank{rank}.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    skip = max(0, min(warmup_steps - 1, steps - 3))  # past the warm-up, then one profiler warm-up step
    active = max(1, min(5, steps - skip - 2))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(
        activities=activities,
        schedule=profiled_steps(wait=skip, warmup=1, active=active, repeat=1),  # torch's name for its step window
        on_trace_ready=lambda p: p.export_chrome_trace(str(target)),
    )
    profiler.start()
    return profiler
