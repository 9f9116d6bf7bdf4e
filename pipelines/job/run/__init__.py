"""What a run records and prints: a step's record (record.py) and its accounting (accounting.py), the summary's
running aggregates (aggregates.py), progress output (progress.py), freescale's embedding-schedule probe
(schedule.py) and the run summary's lines (summary.py)."""
