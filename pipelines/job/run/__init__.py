"""What a run records and prints: a step's record (record.py), its accounting (accounting.py) and its way to the
history, the metrics and the progress bar (step_log.py), the summary's running aggregates (aggregates.py), progress
output (progress.py), freescale's embedding-schedule probe (schedule_probe.py), the held-out evaluation (evaluation.py),
the ``--trace`` window (profiler.py) and the run summary (summary.py)."""
