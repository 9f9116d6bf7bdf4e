"""The job `freescale train` runs around the API's step, in rooms named for what they hold:

train.py       the entry point (``freescale train``, ``torchrun -m pipelines.job.train``): one rank's job
trainer.py     the loop around the API's step
builders.py    each component built from its own config section; memory_probe.py, dims.py beside them
config/        the job's config: one section per TOML table (sections.py), the TOML file, the flags
checkpoint/    saving and resuming: the checkpointer, DCP, the COMPLETE manifest, checked reads, the folder's
               lock, the end-of-run export
launch/        starting ranks on this host or several (launcher, hosts), signals, failure lines, log folders,
               the checks made before any rank starts
run/           what a run records: per-step records and accounting, running aggregates, progress output, the
               embedding-schedule probe and the run summary's lines
"""
