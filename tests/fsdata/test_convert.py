"""Converters: small fixture logs written here -> Parquet, checked against a plain-Python cut of the events."""

import gzip
import json

import numpy as np
import pyarrow.csv as pacsv
import pytest

from fsdata.convert import convert
from fsdata.parquet import ParquetSource

# (user, item, rating, time): deliberately out of time order, with a tie, a one-event user and string-like keys
EVENTS = [
    (1, 10, 5.0, 300),
    (1, 11, 3.0, 100),
    (2, 10, 4.0, 50),
    (1, 12, 4.5, 200),
    (1, 13, 1.0, 400),
    (3, 14, 2.0, 10),
    (1, 14, 4.0, 400),
    (2, 15, 5.0, 60),
    (1, 16, 2.0, 500),
    (2, 11, 3.5, 70),
]


def plain_cut(events, k, samples_per_user, min_history=1):
    """Per user (first-appearance order): time-sorted events cut into windows of k candidates from the end."""
    users, items = {}, {}
    for u, i, *_ in events:
        users.setdefault(u, len(users))
        items.setdefault(i, len(items))
    out = []
    for u in users:
        ev = sorted([e for e in events if e[0] == u], key=lambda e: e[3])  # stable: ties keep file order
        end, taken = len(ev), 0
        while end > min_history and (samples_per_user == 0 or taken < samples_per_user):
            start = max(min_history, end - k)
            out.append(
                (
                    ev[start][3],
                    users[u],
                    start,
                    [items[e[1]] for e in ev[:start]],
                    [items[e[1]] for e in ev[start:end]],
                    [float(e[2] >= 4) for e in ev[start:end]],
                )
            )
            end, taken = start, taken + 1
    out.sort(key=lambda s: (s[0], s[1], s[2]))
    return [s[1:] for s in out]


def check(path, events, k, samples_per_user, labels_of=None):
    batch = ParquetSource(path).read(0, 0, ParquetSource(path).num_samples(0))
    got = []
    for s in batch.to_samples():
        cands = [int(c[0]) for c in s.content_ids]
        got.append(
            (int(s.user_id), len(s.uih_item_ids), s.uih_item_ids.tolist(), cands, s.candidate_labels[:, 0].tolist())
        )
        assert np.all(np.diff(s.uih_timestamps) >= 0)
        assert s.dense[0] == pytest.approx(np.log1p(len(s.uih_item_ids)))
    assert got == plain_cut(events, k, samples_per_user)
    assert batch.sample_ids.tolist() == list(range(batch.batch_size))


@pytest.mark.parametrize("samples_per_user,k", [(1, 2), (0, 2), (0, 1), (2, 3)])
def test_movielens_dat(tmp_path, samples_per_user, k):
    src = tmp_path / "ratings.dat"
    src.write_text("".join(f"{u}::{i}::{int(r) if r.is_integer() else r}::{t}\n" for u, i, r, t in EVENTS))
    report = convert(
        "movielens", [src], tmp_path / "ml.parquet", progress=False, candidates=k, samples_per_user=samples_per_user
    )
    check(tmp_path / "ml.parquet", EVENTS, k, samples_per_user)
    assert (report.events, report.users, report.items, report.skipped_users) == (10, 3, 7, 1)
    items = pacsv.read_csv(tmp_path / "ml.item_ids.csv")
    assert items.column("original").to_pylist() == [10, 11, 12, 13, 14, 15, 16] and items.column(
        "id"
    ).to_pylist() == list(range(7))


def test_movielens_csv_matches_dat(tmp_path):
    (tmp_path / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in EVENTS))
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in EVENTS)
    )
    convert("movielens", [tmp_path / "ratings.dat"], tmp_path / "a.parquet", progress=False, samples_per_user=0)
    convert("movielens", [tmp_path / "ratings.csv"], tmp_path / "b.parquet", progress=False, samples_per_user=0)
    a, b = (ParquetSource(tmp_path / f"{x}.parquet") for x in "ab")
    assert a.read(0, 0, a.num_samples(0)).equals(b.read(0, 0, b.num_samples(0)))
    assert a.read(0, 0, 1).uih_action_types.tolist()  # half-star action types present


@pytest.mark.parametrize("form", ["2018", "2023", "2018.gz"])
def test_amazon_json_lines(tmp_path, form):
    def row(u, i, r, t):
        if form.startswith("2018"):
            return {"reviewerID": f"A{u}X", "asin": f"B00{i}", "overall": r, "unixReviewTime": t, "reviewText": "ok"}
        return {"user_id": f"A{u}X", "parent_asin": f"B00{i}", "rating": r, "timestamp": t * 1000, "title": "t"}

    text = "".join(json.dumps(row(*e)) + "\n" for e in EVENTS).encode()
    src = tmp_path / ("reviews.json.gz" if form.endswith(".gz") else "reviews.jsonl")
    src.write_bytes(gzip.compress(text) if form.endswith(".gz") else text)
    convert("amazon", [src], tmp_path / "amz.parquet", progress=False, candidates=2, samples_per_user=0)
    check(tmp_path / "amz.parquet", EVENTS, 2, 0)
    users = pacsv.read_csv(tmp_path / "amz.user_ids.csv").column("original").to_pylist()
    assert users == ["A1X", "A2X", "A3X"]


@pytest.mark.parametrize("clock", ["time_ms", "date+hourmin"])
def test_kuairand_csv(tmp_path, clock):
    header = "user_id,video_id,date,hourmin,time_ms,is_click,is_like,long_view,tab"
    lines = []
    for u, i, r, t in EVENTS:
        minutes = t  # one event per minute of a day
        lines.append(
            f"{u},{i},20220408,{minutes // 60:02d}{minutes % 60:02d},{1649376000000 + minutes * 60_000},"
            f"{int(r >= 4)},{int(r >= 5)},1,0"
        )
    if clock == "date+hourmin":
        header = header.replace(",time_ms", "")
        lines = [",".join(p for j, p in enumerate(line.split(",")) if j != 4) for line in lines]
    src = tmp_path / "log_standard.csv"
    src.write_text(header + "\n" + "\n".join(lines) + "\n")
    convert(
        "kuairand",
        [src],
        tmp_path / "kr.parquet",
        label_columns=("is_click", "is_like"),
        progress=False,
        candidates=2,
        samples_per_user=0,
    )
    check(tmp_path / "kr.parquet", EVENTS, 2, 0)
    b = ParquetSource(tmp_path / "kr.parquet").read(0, 0, 2)
    assert b.num_labels == 2
    assert int(b.uih_action_types.max()) & (1 << 6)  # long_view bit of the action bitmask


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.dat"):
        convert("movielens", [tmp_path / "missing.dat"], tmp_path / "o.parquet", progress=False)
    with pytest.raises(ValueError, match="unknown format"):
        convert("netflix", [], tmp_path / "o.parquet")
    (tmp_path / "ratings.csv").write_text("user,item,score,ts\n1,2,3,4\n")
    with pytest.raises(ValueError, match="ratings.csv: expected the header"):
        convert("movielens", [tmp_path / "ratings.csv"], tmp_path / "o.parquet", progress=False)
    (tmp_path / "r.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match="r.jsonl: JSON lines without the Amazon review fields"):
        convert("amazon", [tmp_path / "r.jsonl"], tmp_path / "o.parquet", progress=False)
    (tmp_path / "k.csv").write_text("user_id,video_id,is_click\n1,2,1\n")
    with pytest.raises(ValueError, match="k.csv: KuaiRand log lacks columns .*time_ms or date\\+hourmin"):
        convert("kuairand", [tmp_path / "k.csv"], tmp_path / "o.parquet", progress=False)
    (tmp_path / "one.dat").write_text("1::2::3::4\n")
    with pytest.raises(ValueError, match="no user has more than min_history"):
        convert("movielens", [tmp_path / "one.dat"], tmp_path / "o.parquet", progress=False)


def test_cli_convert(tmp_path, capsys):
    import argparse

    from pipelines.cli import data_convert

    src = tmp_path / "ratings.dat"
    src.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in EVENTS))
    parser = argparse.ArgumentParser()
    data_convert.add_arguments(parser)
    args = parser.parse_args(
        [
            "--format",
            "movielens",
            str(src),
            "--out",
            str(tmp_path / "o.parquet"),
            "--candidates",
            "2",
            "--samples-per-user",
            "0",
            "--no-progress",
        ]
    )
    assert data_convert.main(args) == 0
    check(tmp_path / "o.parquet", EVENTS, 2, 0)
    assert "10 events of 3 users and 7 items" in capsys.readouterr().out


@pytest.mark.parametrize("held", [1, 2])
def test_held_out_split_is_each_users_last_events_and_never_trained_on(tmp_path, held):
    """Leave-last-out: a user with more than min_history + held events gets one evaluation sample of its last
    ``held`` events (UIH: every event before them); its training samples are the plain cut of the events
    before them; other users train on all their events."""
    src = tmp_path / "ratings.dat"
    src.write_text("".join(f"{u}::{i}::{int(r) if r.is_integer() else r}::{t}\n" for u, i, r, t in EVENTS))
    report = convert(
        "movielens",
        [src],
        tmp_path / "train.parquet",
        progress=False,
        candidates=2,
        samples_per_user=0,
        eval_out=str(tmp_path / "eval.parquet"),
        eval_candidates=held,
    )
    by_user = {u: sorted([e for e in EVENTS if e[0] == u], key=lambda e: e[3]) for u in (1, 2, 3)}
    kept = [e for u, ev in by_user.items() for e in (ev[:-held] if len(ev) - held > 1 else ev)]
    train = ParquetSource(tmp_path / "train.parquet").read(
        0, 0, ParquetSource(tmp_path / "train.parquet").num_samples(0)
    )
    item_id = {i: n for n, i in enumerate(dict.fromkeys(e[1] for e in EVENTS))}  # ids in order of first appearance
    user_id = {u: n for n, u in enumerate(dict.fromkeys(e[0] for e in EVENTS))}
    want = [(s[0], s[2], s[3]) for s in plain_cut(kept, 2, 0)]
    got = [(int(s.user_id), s.uih_item_ids.tolist(), [int(c[0]) for c in s.content_ids]) for s in train.to_samples()]
    # The plain cut numbers items by first appearance in its own events: map both to the raw keys.
    raw = {v: k for k, v in item_id.items()}
    ref_items = {n: i for n, i in enumerate(dict.fromkeys(e[1] for e in kept))}
    assert [(u, [raw[i] for i in h], [raw[i] for i in c]) for u, h, c in got] == [
        (u, [ref_items[i] for i in h], [ref_items[i] for i in c]) for u, h, c in want
    ]
    held_out = ParquetSource(tmp_path / "eval.parquet")
    samples = held_out.read(0, 0, held_out.num_samples(0)).to_samples()
    eligible = [u for u, ev in by_user.items() if len(ev) - held > 1]
    assert report.eval_samples == len(samples) == len(eligible)
    for s in samples:
        ev = by_user[next(u for u, n in user_id.items() if n == int(s.user_id))]
        assert [raw[int(c[0])] for c in s.content_ids] == [e[1] for e in ev[-held:]]
        assert [raw[i] for i in s.uih_item_ids.tolist()] == [e[1] for e in ev[:-held]]
        assert s.candidate_labels[:, 0].tolist() == [float(e[2] >= 4) for e in ev[-held:]]
    trained = {(int(s.user_id), raw[int(c[0])]) for s in train.to_samples() for c in s.content_ids}
    trained |= {(int(s.user_id), raw[i]) for s in train.to_samples() for i in s.uih_item_ids.tolist()}
    assert not any((int(s.user_id), raw[int(c[0])]) in trained for s in samples for c in s.content_ids)


@pytest.mark.parametrize("name", ["ratings.dat.gz", "ratings.csv.gz"])
def test_movielens_reads_gzip_files_as_the_plain_ones(tmp_path, name):
    dat = "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in EVENTS)
    csv = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in EVENTS)
    (tmp_path / name).write_bytes(gzip.compress((dat if ".dat" in name else csv).encode()))
    convert("movielens", [tmp_path / name], tmp_path / "ml.parquet", progress=False, candidates=2, samples_per_user=0)
    check(tmp_path / "ml.parquet", EVENTS, 2, 0)


def test_kuairand_reads_a_gzip_file(tmp_path):
    lines = [f"{u},{i},{1649376000000 + t * 60_000},{int(r >= 4)}" for u, i, r, t in EVENTS]
    text = "user_id,video_id,time_ms,is_click\n" + "\n".join(lines) + "\n"
    (tmp_path / "log.csv.gz").write_bytes(gzip.compress(text.encode()))
    convert(
        "kuairand", [tmp_path / "log.csv.gz"], tmp_path / "kr.parquet", progress=False, candidates=2, samples_per_user=0
    )
    check(tmp_path / "kr.parquet", EVENTS, 2, 0)


@pytest.mark.parametrize("k,samples_per_user", [(1, 1), (2, 0), (3, 1)])
def test_positive_rate_is_over_the_training_candidates_labels(tmp_path, k, samples_per_user, capsys):
    """Not over every raw event (half of EVENTS are positive): over the labels of the candidates written, those a
    model trains on; the held-out split's rate over its own candidates."""
    src = tmp_path / "ratings.dat"
    src.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in EVENTS))
    report = convert(
        "movielens", [src], tmp_path / "ml.parquet", progress=False, candidates=k, samples_per_user=samples_per_user
    )
    labels = [label for sample in plain_cut(EVENTS, k, samples_per_user) for label in sample[-1]]
    assert report.positive_rate == [pytest.approx(sum(labels) / len(labels), abs=1e-12)]
    assert report.eval_positive_rate is None
    if (k, samples_per_user) == (1, 1):
        assert report.positive_rate == [0.0]  # users' last events are negatives; the raw events' rate is 0.5


def test_cli_names_the_positive_rate_of_training_and_held_out_labels(tmp_path, capsys):
    import argparse

    from pipelines.cli import data_convert

    src = tmp_path / "ratings.dat"
    src.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in EVENTS))
    parser = argparse.ArgumentParser()
    data_convert.add_arguments(parser)
    argv = ["--format", "movielens", str(src), "--out", str(tmp_path / "o.parquet"), "--candidates", "1"]
    args = parser.parse_args([*argv, "--eval-out", str(tmp_path / "e.parquet"), "--no-progress"])
    assert data_convert.main(args) == 0
    out = capsys.readouterr().out
    rates = []
    for name in ("o", "e"):
        source = ParquetSource(tmp_path / f"{name}.parquet")
        rates.append(float(source.read(0, 0, source.num_samples(0)).candidate_labels.mean()))
    assert rates[0] != 0.5  # the raw events' rate
    assert f"positive rate {rates[0]:.4f} (of their candidates' labels)" in out
    assert f"  2 held-out samples (each user's last events, never trained on); positive rate {rates[1]:.4f}" in out
