"""`freescale bench embedding` end to end at toy size: every record has both modes' exposed parts, parity holds,
and the fit is computed."""

from __future__ import annotations

import argparse
import json

import pytest

pytestmark = pytest.mark.multiprocess


def test_bench_embedding_smoke(tmp_path):
    from pipelines.research.bench import embedding

    parser = argparse.ArgumentParser()
    embedding.add_arguments(parser)
    out = tmp_path / "emb.json"
    args = parser.parse_args(
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
            "--json",
            str(out),
        ]
    )
    assert embedding.main(args) == 0
    result = json.loads(out.read_text())
    assert len(result["records"]) == 4  # 2 collision rates + the UIH sweep's 2 shorter lengths
    for r in result["records"]:
        assert r["parity"] is True
        assert set(r["sync_exposed_ms"]) == {"ids_a2a", "emb_a2a", "grad_a2a", "total", "dense"}
        assert r["exposed_reduction"] > 0
    assert result["fit_vs_collision"]["prioritized"] is not None


def test_bench_embedding_rejects_bad_arguments():
    from pipelines.research.bench import embedding

    parser = argparse.ArgumentParser()
    embedding.add_arguments(parser)
    with pytest.raises(ValueError, match="nproc"):
        embedding.main(parser.parse_args(["--nproc", "1"]))
    with pytest.raises(ValueError, match="collision"):
        embedding.main(parser.parse_args(["--collisions", "0,1.5"]))
