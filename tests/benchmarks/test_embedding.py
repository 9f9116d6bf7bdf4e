"""`python -m benchmarks embedding` end to end at toy size: every record has both modes' exposed parts (and
torchrec's two runs'), parity holds, and the fit is computed."""

from __future__ import annotations

import argparse
import json

import pytest

pytestmark = pytest.mark.multiprocess


def _toy_args(*extra: str) -> argparse.Namespace:
    from benchmarks import embedding

    parser = argparse.ArgumentParser()
    embedding.add_arguments(parser)
    return parser.parse_args(
        [
            "--nproc",
            "2",
            "--max-uih",
            "16",
            "--batch-size",
            "4",
            "--dim",
            "8",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--collisions",
            "0,0.5",
            "--device",
            "cpu",
            *extra,
        ]
    )


def test_bench_embedding_smoke(tmp_path):
    from benchmarks import embedding

    out = tmp_path / "emb.json"
    assert embedding.main(_toy_args("--json", str(out), "--torchrec")) == 0
    result = json.loads(out.read_text())
    assert len(result["records"]) == 4  # 2 collision rates + the UIH sweep's 2 shorter lengths
    for r in result["records"]:
        assert r["parity"] is True
        assert set(r["sync_exposed_ms"]) == {"ids_a2a", "emb_a2a", "grad_a2a", "total", "dense"}
        assert r["exposed_reduction"] > 0
        # torchrec's two runs on the same batches: the synchronous one trains sync's numbers to float rounding
        assert set(r["torchrec_pec_exposed_ms"]) == {"ids_a2a", "emb_a2a", "grad_a2a", "total"}
        assert r["torchrec_loss_max_diff"] < 1e-5 and r["torchrec_pec_step_ms"] > 0
    assert result["fit_vs_collision"]["prioritized"] is not None


def test_bench_embedding_rejects_bad_arguments():
    from benchmarks import embedding

    parser = argparse.ArgumentParser()
    embedding.add_arguments(parser)
    with pytest.raises(ValueError, match="nproc"):
        embedding.main(parser.parse_args(["--nproc", "1"]))
    with pytest.raises(ValueError, match="collision"):
        embedding.main(parser.parse_args(["--collisions", "0,1.5"]))
    with pytest.raises(ValueError, match="--torchrec runs on CPU only"):
        embedding.main(parser.parse_args(["--torchrec", "--device", "cuda"]))


def test_a_killed_bench_embedding_rank_is_one_line_and_leaves_no_segment(tmp_path, monkeypatch, capfd):
    from benchmarks import embedding
    from fscomm.shm import FAULT_ENV
    from tests.test_reliability_launch import _pids, _segments_of, _terminal_lines

    monkeypatch.setenv(FAULT_ENV, "exchange:1")
    monkeypatch.setenv("FREESCALE_LOG_DIR", str(tmp_path / "logs"))
    with pytest.raises(SystemExit) as ended:
        embedding.main(_toy_args("--timeout", "60"))
    assert ended.value.code == 1
    err = _terminal_lines(capfd.readouterr().err)
    assert len(err) <= 3 and "Traceback" not in "\n".join(err), err
    assert err[-1].startswith("benchmarks embedding: error: rank 1 died (signal SIGKILL)"), err
    pids = _pids(tmp_path / "logs")
    assert len(pids) == 2 and _segments_of(pids) == []
