"""The job `freescale train` runs around the API's step, in rooms named for what they hold:

train.py       the entry point (``freescale train``, ``torchrun -m pipelines.job.train``): one rank's job
trainer.py     the loop around the API's step (Stateful: its parts' state in one state_dict)
data.py        the job's sources, its model on them, and the loader with the mode's stages
builders.py    the model, the embedding wrap and the step, each from its own sections; memory_probe.py, dims.py
config/        the job's config: one section per TOML table (sections.py), the TOML file, the flags
checkpoint/    saving and resuming: the job's checkpoints (job.py: the trainer handed over whole), the
               checkpointer, DCP, the COMPLETE manifest, checked reads, the folder's lock, the end-of-run export
launch/        starting ranks on this host or several (launcher, hosts), signals, failure lines, log folders,
               the checks made before any rank starts
run/           what a run records: per-step records, accounting and log, running aggregates, progress output,
               the embedding-schedule probe, the held-out evaluation, the trace window and the run summary
"""
