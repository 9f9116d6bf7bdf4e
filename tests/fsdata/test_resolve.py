"""A user's function named as module:function (current directory first) or path/to/file.py:function; and the one
line said at import when another distribution's package shadows one of FreeScale's top-level names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdata.resolve import load_callable

ROOT = Path(__file__).resolve().parents[2]


def test_module_form_finds_the_current_directory_first(tmp_path, monkeypatch):
    (tmp_path / "user_partitioners_cwd.py").write_text("def mine(lengths, runtime):\n    return 'from cwd'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_callable("user_partitioners_cwd:mine")(None, None) == "from cwd"


def test_file_form_loads_a_path_once(tmp_path, monkeypatch):
    sub = tmp_path / "deep"
    sub.mkdir()
    (sub / "factory.py").write_text("class Spec:\n    pass\n\ndef build(config):\n    return Spec()\n")
    by_absolute = load_callable(f"{sub / 'factory.py'}:build")
    monkeypatch.chdir(tmp_path)
    by_relative = load_callable("deep/factory.py:build")
    assert by_absolute is by_relative  # one module per file: what it defines stays one class
    assert type(by_absolute(None)).__module__ in sys.modules


@pytest.mark.parametrize(
    "spec,match",
    [
        ("no_colon", "must be written"),
        ("surely_not_a_module_xyz:f", "cannot import module"),
        ("missing/file.py:f", "no file"),
        ("fsdata.resolve:nothing_here", "has no attribute"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        load_callable(spec, "model factory")


def test_a_shadowed_top_level_name_is_said_in_one_line_naming_the_other_distribution(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    info = site / "kernels-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 9.9\n")
    (info / "RECORD").write_text("kernels/__init__.py,,\nkernels-9.9.dist-info/METADATA,,\n")
    (info / "top_level.txt").write_text("kernels\n")

    def import_fsdata(pythonpath):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
        return subprocess.run(
            [sys.executable, "-c", "import fsdata"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )

    shadowed = import_fsdata([site, ROOT])
    lines = [line for line in shadowed.stderr.splitlines() if line.startswith("freescale:")]
    assert len(lines) == 1 and "'kernels'" in lines[0] and "kernels 9.9" in lines[0], shadowed.stderr
    checkout_first = import_fsdata([ROOT, site])  # a source checkout on PYTHONPATH comes first: nothing to say
    assert checkout_first.returncode == 0 and "freescale:" not in checkout_first.stderr
