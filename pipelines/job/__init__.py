"""The job `freescale train` runs around the API's step: the launcher (train.py), the trainer (trainer.py: the
loop, accounting.py: the per-step parts), its configuration (config.py) and components (builders.py),
checkpoints (checkpoint.py, dcp.py, dcp_state.py), the embedding-schedule probe (schedule.py), progress output."""
