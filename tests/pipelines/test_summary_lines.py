"""The run summary's lines that a reader could misread: samples read beyond those trained on (the loader's
read-ahead) are explained, and the embedding schedule's choice names the margin that decided it."""

from __future__ import annotations

from pipelines.job.run.summary import print_summary


def _summary(**changes) -> dict:
    summary = {
        "mode": "freescale",
        "steps": 300,
        "world_size": 2,
        "samples": 4791,
        "warmup_steps": 1,
        "drain_steps": 1,
        "data_counts": {"samples_read": 5049, "folded_ids": 0, "dropped_bad_samples": 0, "truncated_uih": 0},
        "embedding_schedule": {
            "mode": "auto",
            "choice": "sdd",
            "decided_at": 14,
            "probe_steps": 4,
            "probe_median_s": {"prioritized": 0.0903, "sdd": 0.0944},
            "margin": 0.05,
        },
    }
    return {**summary, **changes}


def test_samples_read_beyond_those_trained_on_are_explained(capsys):
    print_summary(_summary())
    lines = capsys.readouterr().out.splitlines()
    assert "  samples          4791" in lines
    assert (
        "  read ahead       258 of the 5049 samples read were not trained on: the loader reads batches ahead of the "
        "step (--prefetch-depth, lookahead), and the softmax model reads one sample per rank for its widths"
    ) in lines
    print_summary(_summary(data_counts={"samples_read": 4791}))  # nothing read ahead: nothing to explain
    assert "read ahead" not in capsys.readouterr().out


def test_the_schedule_line_names_the_margin(capsys):
    print_summary(_summary())
    assert (
        "  embedding        sdd from step 14 (probe medians: prioritized 90.3 ms, sdd 94.4 ms; prioritized 4.3% "
        "faster, kept only when at least 5% faster)"
    ) in capsys.readouterr().out.splitlines()
