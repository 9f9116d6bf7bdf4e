"""What the launcher checks before any rank starts, so that a bad path or file is one line, not N ranks' errors."""

from __future__ import annotations

from pathlib import Path

from pipelines.job.config import JobConfig


def check_before_launch(config: JobConfig) -> None:
    """What can be checked before any rank starts, so that a bad path or file is one line, not N ranks' errors:
    the Parquet files' footers and schema, that they hold samples (and, with --drop-bad-samples, one that is kept),
    the held-out data's widths and columns against the training data's, an explicit checkpoint directory."""
    if config.data.path != "synthetic":
        from fsdata.parquet import ParquetSource

        source = ParquetSource(
            config.data.path,
            uih_cap=config.data.uih_cap,  # footers only: no data is read
            drop_bad_samples=config.data.drop_bad_samples,
        )
        if config.data.drop_bad_samples and source.first_kept_sample() is None:  # reads until a sound sample
            raise ValueError(
                f"{config.data.path}: no samples left: every one of its {source.num_samples(0)} samples "
                "has bad values, and --drop-bad-samples leaves them out"
            )
    if config.data.eval_path is not None:  # its footers and schema, and the widths and columns the model reads
        from pipelines.job.launch.data_check import check_eval_data

        check_eval_data(config.data, config.loader.batch_size * config.run.nproc * config.run.nnodes)
    resume = config.checkpoint.resume
    if resume and resume != "latest":
        from pipelines.job.checkpoint import checkpointer

        for r in range(
            checkpointer.check_complete(resume)
        ):  # weights-only reads of checked bytes: refuses unsafe files
            checkpointer.read_file(Path(resume) / f"rank{r}.pt")
    # one job per folder: a second job is refused here, before its ranks start. On several hosts rank 0 alone holds
    # it (its launcher may be on any host, so no launcher's lock can be the one rank 0 expects from its parent)
    if config.checkpoint.dir:  # loaded now, not in the seconds after a stop signal, whose line names the newest step
        from pipelines.job.checkpoint import checkpointer  # noqa: F401
    if config.checkpoint.dir and config.run.nnodes == 1:
        from pipelines.job.checkpoint import lock as checkpoint_lock

        checkpoint_lock.hold(config.checkpoint.dir, "launcher")
