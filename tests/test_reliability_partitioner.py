"""A user's partitioner that raises, or that returns different plans on different ranks, ends `freescale train` in
one line naming the partitioner and the step, from the rank where the fault happened (docs/reliability.md)."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.test_reliability_cli import FAST, freescale, one_line_error

PARTITIONERS = textwrap.dedent(
    """
    import numpy as np
    import torch.distributed as dist


    def raises_on_rank_1(lengths, runtime):
        if runtime.step == 2 and dist.get_rank() == 1:
            raise RuntimeError("no plan for this step")
        return np.arange(lengths.num_samples) % lengths.world_size


    def differs(lengths, runtime):
        dest = np.arange(lengths.num_samples) % lengths.world_size
        return (dest + dist.get_rank()) % lengths.world_size if runtime.step == 2 else dest
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "raises_on_rank_1",
            r"freescale train: error: rank 1: partitioner part.py:raises_on_rank_1 raised RuntimeError at step 2: no "
            r"plan for this step \(traceback: ",
        ),
        # Every rank finds the plans differ and says so alike: the launcher prints the first report it has (the
        # other rank may be stopped by it before writing its own).
        (
            "differs",
            r"freescale train: error: rank [01]: partitioner part.py:differs returned different plans on ranks 0 and 1 "
            r"at step 2 \(a plan must be a pure function of the gathered lengths\) \(traceback: ",
        ),
    ],
)
def test_a_partitioner_fault_is_the_launchers_one_line_naming_partitioner_and_step(tmp_path, name, expected):
    (tmp_path / "part.py").write_text(PARTITIONERS)
    proc = freescale(
        tmp_path, "train", *FAST, "--steps", "4", "--partitioner", f"part.py:{name}", "--log-dir", "logs", timeout=180
    )
    line = one_line_error(proc)
    assert re.match(expected, line), line
    assert "CollectiveError" not in line and "PeerLostError" not in line
