"""Checkpoints of a job: job.py takes the trainer whole (Stateful) from the job's ``[checkpoint]`` section;
checkpointer.py saves and restores a step (dense model, optimizer, tables, each rank's loader state) through dcp.py
and dcp_state.py (torch.distributed.checkpoint, reading that runs no code), marks a step whole with manifest.py's
COMPLETE, opens nothing reading.py has not checked, holds one job per folder (lock.py), and writes the end-of-run
model (export.py)."""
