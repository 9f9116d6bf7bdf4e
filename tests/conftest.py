"""Set-up shared by every test, before any test module is imported.

Without a GPU, Triton kernels can only run in Triton's interpreter; the variable must be set before any module
that defines a kernel is imported (the jit decorator reads it at definition time), so it is set here, first.
"""

import multiprocessing.util
import os
import shutil
import tempfile

import torch

# Every temporary folder of the run (the tests' own, pytest's tmp_path, the ranks' and launchers' folders, the
# logs a failed job keeps on purpose) lives in one folder of the session's, removed at its end, so the suite leaves
# nothing in /tmp. What the tests left in it is named in the summary (scripts/leftovers.py finds the test).
# multiprocessing's own folder (pymp-*) stays where it was: its exit handler removes it after pytest has ended.
multiprocessing.util.get_temp_dir()
_SESSION_TMP = tempfile.mkdtemp(prefix="freescale-tests-")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --- the multiprocess marker ----------------------------------------------------------------------------------
# `-m multiprocess` selects the tests that start ranks (scripts/stress_multiprocess.sh runs them over and over to
# find races), so a test that starts ranks without the marker escapes that run. Counted at run time: a process
# started through multiprocessing (tests.harness.run_ranks, mp.spawn, torch's elastic launcher in-process), or a
# command that starts ranks (torchrun, `--nproc N` with N > 1).
import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

_started = {"processes": 0}
_RANK_COMMANDS = ("torch.distributed.run", "torchrun")


def _starts_ranks(argv) -> bool:
    if isinstance(argv, (str, bytes)):
        argv = str(argv).split()
    argv = [str(a) for a in argv]
    if any(a.endswith(c) for a in argv for c in _RANK_COMMANDS):
        return True
    for flag in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
        if flag in argv[:-1] and argv[argv.index(flag) + 1] != "1":
            return True
    return False


_process_start = multiprocessing.process.BaseProcess.start
_popen_init = subprocess.Popen.__init__


def _counting_start(self, *args, **kwargs):
    _started["processes"] += 1
    return _process_start(self, *args, **kwargs)


def _counting_popen_init(self, args, *rest, **kwargs):
    if _starts_ranks(args):
        _started["processes"] += 1
    return _popen_init(self, args, *rest, **kwargs)


multiprocessing.process.BaseProcess.start = _counting_start
subprocess.Popen.__init__ = _counting_popen_init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = _started["processes"]
    result = yield
    if _started["processes"] > before and item.get_closest_marker("multiprocess") is None:
        pytest.fail(
            f"{item.nodeid} starts ranks (processes) but lacks @pytest.mark.multiprocess: the stress run "
            "(scripts/stress_multiprocess.sh, -m multiprocess) would miss it",
            pytrace=False,
        )
    return result


_OURS = ("fs-", "freescale-")


def pytest_terminal_summary(terminalreporter):
    left = sorted(n for n in os.listdir(_SESSION_TMP) if n.startswith(_OURS))
    if left:
        terminalreporter.write_line(f"temporary folders the tests left (removed now): {', '.join(left)}")


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
