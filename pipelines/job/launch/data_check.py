"""The held-out data (``--eval-data``) checked against the training data before any rank starts.

The model is shaped by the training data (pipelines.job.builders.build_model: its dense layer takes the training
data's dense width, its head gives one logit per label column) and reads the side features the training data
has (the softmax model adds ``uih_action_types`` to its tokens when a batch carries them). Held-out data of
another width would fail at the first evaluation, on every rank, as a matrix-shape error naming no file; held-out
data without a side feature the model was trained with (or with one it never saw) would be evaluated silently
on other inputs than it trained on. Both are one line here, naming both sources and the column.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from fsdata.schema import CANDIDATE_LABELS, DENSE, SIDE_FEATURES

if TYPE_CHECKING:
    from fsdata.source import SampleSource
    from pipelines.job.config.sections import JobDataSection


class DataColumns(NamedTuple):
    """What the model reads of a source: the dense width D, the label count T, the side features present."""

    dense_dim: int
    num_labels: int
    side_features: tuple[str, ...]


def source_columns(source: "SampleSource") -> DataColumns:
    """A source's :class:`DataColumns`: a Parquet source's from its footers (schema and metadata, no data read)
    where they say, any other source's (synthetic, or Parquet files written without FreeScale's metadata) from
    its first sample, as the model is shaped."""
    from fsdata.parquet import ParquetSource

    if isinstance(source, ParquetSource) and source.dense_dim is not None and source.num_labels is not None:
        return DataColumns(source.dense_dim, source.num_labels, tuple(source.side_features or ()))
    probe = source.read(0, 0, min(1, source.num_samples(0)))
    present = tuple(name for name in SIDE_FEATURES if getattr(probe, name) is not None)
    return DataColumns(int(probe.dense.shape[1]), probe.num_labels, present)


def training_name(config: "JobDataSection") -> str:
    """How an error names the training data: its path, or the synthetic preset."""
    return f"synthetic preset {config.preset!r}" if config.path == "synthetic" else config.path


def check_eval_data(config: "JobDataSection", global_batch_size: int) -> None:
    """Opens ``config.eval_path`` (footers and schema) and refuses, in one ValueError naming both sources and the
    column, held-out data whose dense width, label count or side-feature columns differ from the training data's
    (``config.path``: Parquet, or the synthetic source the ranks would build with ``global_batch_size``)."""
    from fsdata.parquet import ParquetSource
    from pipelines.job.builders import build_source

    held_out = ParquetSource(config.eval_path, uih_cap=config.uih_cap, drop_bad_samples=config.drop_bad_samples)
    train = source_columns(build_source(config, global_batch_size))
    mismatch = columns_mismatch(train, source_columns(held_out), training_name(config))
    if mismatch:
        raise ValueError(f"--eval-data {config.eval_path} {mismatch}")


def columns_mismatch(train: DataColumns, held_out: DataColumns, train_name: str) -> str:
    """The first difference between the training data's columns (of the source named ``train_name``) and the
    held-out data's, as the rest of a sentence whose subject is the held-out data; "" when there is none."""
    for what, column, t, e in (
        ("dense width", DENSE, train.dense_dim, held_out.dense_dim),
        ("label count", CANDIDATE_LABELS, train.num_labels, held_out.num_labels),
    ):
        if t != e:
            return (
                f"has {what} {e} (column '{column}') but the training data ({train_name}) has {t}: the model is "
                "shaped by the training data"
            )
    missing = [c for c in SIDE_FEATURES if c in train.side_features and c not in held_out.side_features]
    if missing:
        return f"lacks {_columns(missing)}, which the training data ({train_name}) has and the model reads"
    extra = [c for c in SIDE_FEATURES if c in held_out.side_features and c not in train.side_features]
    if extra:
        return (
            f"has {_columns(extra)}, which the training data ({train_name}) lacks: the model would read "
            f"{'them' if len(extra) > 1 else 'it'} in evaluation only"
        )
    return ""


def _columns(names: list[str]) -> str:
    return f"column{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)}"
