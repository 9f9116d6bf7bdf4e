"""`python -m benchmarks e2e --model hstu`: every case's job builds the HSTU model, the modes' NE is put beside
sync's, and a short CPU run of sync and freescale on the HSTU model gives the same NE to float rounding."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import e2e


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_case_but_long_trains_the_hstu_model_at_its_own_sizes():
    args = parse("--model", "hstu-large")
    heavy, light, long = (e2e.case_config(case, "freescale", args) for case in ("heavy", "light", "long"))
    assert (heavy.model.name, heavy.model.max_uih, heavy.data.uih_cap) == ("hstu-large", 2048, 2048)
    assert (light.model.name, light.model.max_uih, light.model.num_items) == ("hstu-large", 64, 10_000)
    assert long.model.name == "small"  # the long case keeps its model (module docstring)


def test_the_softmax_models_padded_attention_is_refused_for_hstu_before_any_run():
    with pytest.raises(SystemExit, match="--attention padded is the softmax model's; --model hstu packs"):
        e2e.main(parse("--model", "hstu", "--attention", "padded"))


def test_every_modes_ne_is_put_beside_syncs_of_the_same_run():
    rows = [
        {"case": "heavy", "mode": "sync", "repeat": 0, "ne": 0.98, "model": "hstu", "bubble_ms": 1.0},
        {"case": "heavy", "mode": "freescale", "repeat": 0, "ne": 0.98000004, "bubble_ms": 0.5},
        {"case": "heavy", "mode": "sdd", "repeat": 0, "ne": 0.97, "bubble_ms": 1.0},
        {"case": "heavy", "mode": "freescale", "repeat": 1, "ne": 0.5, "bubble_ms": 0.5},  # no sync in run 2
    ]
    for r in rows:
        r["bubble_median_ms"] = r["bubble_ms"]
    e2e.pair_with_sync(rows)
    assert [r["ne_minus_sync"] for r in rows] == pytest.approx([0.0, 4e-8, -0.01, None], abs=1e-12)
    assert e2e.ne_against_sync(rows) == [
        "NE against sync, heavy (run 1, model hstu): sync 0.980000; freescale 0.980000 (+4.0e-08), sdd 0.970000 "
        "(-1.0e-02)"
    ]


def test_the_ne_gap_reads_against_syncs_own_spread_over_runs():
    rows = [
        {"case": "heavy", "mode": "sync", "repeat": 0, "ne": 0.966},
        {"case": "heavy", "mode": "freescale", "repeat": 0, "ne": 0.981},
        {"case": "heavy", "mode": "sync", "repeat": 1, "ne": 0.977},
        {"case": "heavy", "mode": "freescale", "repeat": 1, "ne": 0.975},
        {"case": "light", "mode": "sync", "repeat": 0, "ne": 0.9},  # one sync run: no spread to read against
        {"case": "light", "mode": "freescale", "repeat": 0, "ne": 0.9},
    ]
    for r in rows:
        r["bubble_ms"] = r["bubble_median_ms"] = 1.0
    e2e.pair_with_sync(rows)
    assert e2e.ne_run_to_run(rows) == [
        "NE run to run, heavy: sync 0.966000-0.977000 over 2 runs (spread 1.1e-02); largest |mode - sync| of one "
        "run 1.5e-02"
    ]


@pytest.mark.multiprocess
def test_sync_and_freescale_train_the_hstu_model_to_the_same_ne_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["--model", "hstu", "--cases", "light", "--modes", "sync,freescale", "--steps", "5"]
    assert e2e.main(parse(*argv, "--warmup-steps", "2", "--json", str(out))) == 0
    sync, ours = json.loads(out.read_text())
    assert (sync["mode"], ours["mode"]) == ("sync", "freescale")
    assert sync["model"] == ours["model"] == "hstu" and ours["attention"] == "hstu" and ours["steps"] == 5
    assert ours["balanced_steps"] is not None  # the balancer ran in freescale
    assert ours["ne"] == pytest.approx(sync["ne"], rel=1e-5) and ours["ne_minus_sync"] == ours["ne"] - sync["ne"]
    text = capsys.readouterr().out
    assert "NE against sync, light (run 1, model hstu): sync " in text
    assert "straggler share, light (run 1, hstu attention): sync " in text
