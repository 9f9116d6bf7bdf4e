"""A job's checkpoints, built from its ``[checkpoint]`` section: the job hands over one Stateful object (the trainer),
whose ``state_dict()`` gives its parts by these keys, and gets them back through its ``load_state_dict()``.

    MODEL, OPTIMIZER   the model and its optimizer themselves (Stateful): their tensors go to DCP, the sharded tables
                       as row-wise chunks (dcp_state.py), and come back into them in place
    STEP               the steps done
    POSITION           ``{epoch, cursor}``: where the next step's samples start (world-size independent)
    LOADER             this rank's loader state from before the next step's batch was fetched (None after a resume
                       on another world size: the loader then restarts from POSITION)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

from pipelines.job.checkpoint import checkpointer
from pipelines.job.config.sections import JobCheckpointSection

MODEL, OPTIMIZER, STEP, POSITION, LOADER = "model", "optimizer", "step", "position", "loader"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class JobCheckpoints:
    """Saves and resumes a job (``[checkpoint]``: dir, every, resume, async_save). Made on every rank at set-up:
    the checkpointer's process group is made collectively."""

    def __init__(self, section: JobCheckpointSection, rank: int, world_size: int) -> None:
        self.section, self.rank = section, rank
        self.checkpointer = (
            checkpointer.Checkpointer(section.dir, rank, world_size, async_save=section.async_save)
            if section.dir or section.resume
            else None
        )
        self.world_size = world_size

    def due(self, step: int) -> bool:
        return bool(self.section.every) and step % self.section.every == 0

    def save(self, job: Stateful) -> Path:
        """Every rank at the same step."""
        if self.checkpointer is None:
            raise ValueError("save_checkpoint: the job has no --checkpoint-dir")
        state = job.state_dict()
        return self.checkpointer.save(
            state[STEP], state[MODEL], state[OPTIMIZER], loader_state=state[LOADER], cursor=state[POSITION]
        )

    def wait(self) -> None:
        """Completes an async save still in flight (and checks it)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def resume(self, job: Stateful) -> bool:
        """Restores ``job`` from ``[checkpoint] resume`` (model and optimizer in place, then ``load_state_dict``);
        False where there is nothing to resume. Returns once every rank has loaded."""
        resume = self.section.resume
        if not resume:
            return False
        state = job.state_dict()
        restored = self.checkpointer.restore(resume, state[MODEL], state[OPTIMIZER])
        if self.rank == 0:
            self._report(restored)
        if restored is None:  # nothing saved yet (first launch of a job that resumes on restart)
            return False
        position = {"epoch": restored.epoch, "cursor": restored.cursor}
        job.load_state_dict({STEP: restored.step, POSITION: position, LOADER: restored.loader_state})
        return True

    def _report(self, restored: Optional[checkpointer.Restored]) -> None:
        """Rank 0's lines: the steps skipped (cut off, unloadable), a marker that predates checksums, where the job
        resumes."""
        directory = self.section.dir
        if self.section.resume == "latest":
            incomplete = checkpointer.incomplete_steps(directory, restored.directory if restored else None)
            if incomplete:  # saves interrupted before their marker: never resumed, said once
                marker = checkpointer.COMPLETE_MARKER
                print(f"[freescale] skipped {', '.join(incomplete)} (no {marker}: a save cut off)")
        for skipped in restored.skipped if restored is not None else []:
            print(f"[freescale] skipped {skipped}")
        if restored is None:
            print(f"[freescale] no checkpoint in {directory}, starting at step 0")
            return
        if restored.unverified:
            print(f"[freescale] {restored.unverified}")
        rebuilt = (
            "" if restored.loader_state is not None else f"; loader state rebuilt for world size {self.world_size}"
        )
        print(
            f"[freescale] resumed from {restored.directory} at step {restored.step} (epoch {restored.epoch}, sample "
            f"{restored.cursor})" + rebuilt
        )
