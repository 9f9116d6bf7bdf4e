"""A rank's failure report: its traceback in ``<log dir>/rank<r>.log`` and its one line in ``rank<r>.error``
(:func:`report_failure`), which the launcher reads to print the job's one line (pipelines.job.launch.failure,
docs/reliability.md). Below the launcher, the trainer and the checkpoints, so every part of a job that ends a rank (a
stalled checkpoint read's watchdog among them) reports the same way."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional

LOG_DIR_ENV = "FREESCALE_LOG_DIR"  # set by `freescale train` for its ranks: where they leave their errors
LAUNCHED_ENV = "FREESCALE_LAUNCHED"  # the ranks of `freescale train` (not torchrun's): the launcher prints the line


def _one_line(exc: BaseException) -> str:
    """The error's own message on one line. An error carried across a thread by torchdata holds the worker's
    whole traceback in its text ("Original Traceback ..."): its last line is the original error."""
    text = str(exc)
    if "Original Traceback" in text:
        text = next((line for line in reversed(text.splitlines()) if line.strip()), text)
        prefix = f"{type(exc).__name__}: "
        text = text[len(prefix) :] if text.startswith(prefix) else text
    text = " ".join(text.split())
    return text if isinstance(exc, ValueError) and text else f"{type(exc).__name__}: {text}"


def _is_root_cause(exc: BaseException) -> bool:
    """False for errors that only follow another rank's (its loss was the non-finite one, it closed the
    connection), so the launcher names the rank where the fault happened."""
    if getattr(exc, "root", True) is False:
        return False
    text = str(exc)
    return not any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def report_failure(exc: BaseException, rank: int, verbose: bool, log_dir: Optional[str]) -> str:
    """Writes the rank's traceback to its log file and its one-line error beside it; returns the line.
    (The benches' launcher reports its ranks' errors the same way.)"""
    directory = Path(log_dir or os.environ.get(LOG_DIR_ENV) or tempfile.mkdtemp(prefix="freescale-")).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / f"rank{rank}.log"
    full = "".join(traceback.format_exception(exc))
    log.write_text(full)
    line = f"rank {rank}: {_one_line(exc)} (traceback: {log})"
    (directory / f"rank{rank}.error").write_text(json.dumps({"rank": rank, "line": line, "root": _is_root_cause(exc)}))
    if verbose:
        print(full, file=sys.stderr, flush=True)
    return line
