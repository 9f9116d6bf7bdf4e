"""Runs pytest and reports what the tests left behind in the temporary folder and in /dev/shm; exit status 1 when
they left anything of FreeScale's, 0 when nothing, pytest's own status when the tests failed.

    .venv/bin/python scripts/leftovers.py tests/fscomm/test_shm.py tests/test_reliability_launch.py

The tests run with TMPDIR set to a new folder of this script's, so another job on the machine (another engineer's
tests, a run of `freescale train`) cannot show up as theirs: whatever `tempfile` made there and did not remove is
theirs (``fs-ranks-*``, ``fs-bench-*``, ``freescale-*``, anything else). Third-party caches that are kept on purpose
(``torchinductor_<user>``, pytest's own ``pytest-of-<user>``) are listed, not counted. Also counted: FreeScale's
shared-memory segments (``/dev/shm/fscomm-<pid>-*``) new since the start whose owner process has ended. Listed, not
counted (another job may have made them): names new in /tmp itself matching ``fs-*`` or ``freescale-*`` (a test
that writes a path out rather than taking it from TMPDIR). The folder goes at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KEPT_ON_PURPOSE = ("torchinductor_", "pytest-of-")  # torch's compile cache, pytest's base temp (keeps 3 runs)
SHM = Path("/dev/shm")


def _ours_in_tmp() -> set[str]:
    return {p.name for p in Path("/tmp").iterdir() if p.name.startswith(("fs-", "freescale-"))}


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("fscomm-")} if SHM.is_dir() else set()


def _owner_alive(name: str) -> bool:
    pid = name.split("-")[1]
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def main(pytest_args: list[str]) -> int:
    private = Path(tempfile.mkdtemp(prefix="fs-leftovers-"))
    tmp_before, shm_before = _ours_in_tmp() | {private.name}, _segments()
    try:
        env = {**os.environ, "TMPDIR": str(private)}
        status = subprocess.call([sys.executable, "-m", "pytest", "-q", *pytest_args], env=env)
        left = sorted(p.name for p in private.iterdir())
    finally:
        shutil.rmtree(private, ignore_errors=True)
    counted = [n for n in left if not n.startswith(KEPT_ON_PURPOSE)]
    in_tmp = sorted(_ours_in_tmp() - tmp_before)
    segments = sorted(n for n in _segments() - shm_before if not _owner_alive(n))
    for name in sorted(set(left) - set(counted)):
        print(f"leftovers: kept on purpose by a third party: $TMPDIR/{name}")
    for name in counted:
        print(f"leftovers: left in $TMPDIR: {name}")
    for name in in_tmp:
        print(f"leftovers: new in /tmp (possibly another job's): /tmp/{name}")
    for name in segments:
        print(f"leftovers: shared-memory segment of an ended process: {SHM / name}")
    found = bool(counted or segments)
    print(f"leftovers: {'some' if found else 'nothing'} left by {' '.join(pytest_args) or 'the tests'}")
    return status or int(found)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
