"""Export: after training, unwrap_model puts the user's own modules back with the trained tables, gathered to one
rank, and a fresh instance of the user's class loads the saved state_dict and gives the trained model's logits
bit for bit (CPU): a torchrec EmbeddingCollection model (the BYO example's) and a model of nn.Embedding tables.
`freescale train --export` of the softmax model comes back through `pipelines.load_export` alone, giving the
job's own held-out NE and AUC bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import doing, run_ranks

pytestmark = pytest.mark.multiprocess

NUM_ITEMS, DIM, STEPS = 40, 6, 4


class TableModel(nn.Module):
    """The user's model of one nn.Embedding table, looked up twice per step (history, then candidates)."""

    def __init__(self) -> None:
        super().__init__()
        self.item_emb = nn.Embedding(NUM_ITEMS, DIM)
        self.head = nn.Linear(2 * DIM + 4, 1)

    def forward(self, batch) -> torch.Tensor:
        history = torch.segment_reduce(
            self.item_emb(batch.uih_item_ids % NUM_ITEMS), "sum", lengths=batch.uih_lengths, unsafe=True
        )
        candidates = self.item_emb(_first_content(batch))
        user = torch.cat([history, batch.dense], 1).repeat_interleave(
            batch.num_candidates, 0, output_size=candidates.shape[0]
        )
        return self.head(torch.cat([candidates, user], 1))


def _first_content(batch) -> torch.Tensor:
    return batch.content_ids[batch.content_offsets[:-1]] % NUM_ITEMS


def _table_features(batch) -> dict:
    return {"item_emb": [batch.uih_item_ids % NUM_ITEMS, _first_content(batch)]}


def _source(kind: str):
    from fsdata.synthetic import SyntheticConfig, SyntheticSource

    inner = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=400, seed=1, uih_max=32))
    if kind == "torchrec":
        from examples.bring_your_own_model import WithCategories

        return WithCategories(inner)
    return inner


def _user_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "torchrec":
        from examples.bring_your_own_model import Recommender

        return Recommender(dense_dim=4, num_labels=1)
    return TableModel()


def _logits(kind: str, model: nn.Module, batch) -> torch.Tensor:
    from examples.bring_your_own_model import inputs

    with torch.no_grad():
        return model(*inputs(batch)) if kind == "torchrec" else model(batch)


def _body(rank, world_size, kind, mode, path, dst):
    from fsdata import LoaderConfig, build_loader, shutdown_loader
    from fsembed import RowWiseAdagrad
    from pipelines import TrainStep, unwrap_model, wrap_model

    source = _source(kind)
    model = _user_model(kind, seed=0)
    if kind == "torchrec":
        from examples.bring_your_own_model import inputs, loss

        wrap = wrap_model(
            model, types=["EmbeddingCollection"], mode=mode, inputs=inputs, optimizer=RowWiseAdagrad(lr=0.05)
        )
    else:  # uneven row-wise split: rank 0 holds 30 rows, rank 1 the other 10
        loss = None
        wrap = wrap_model(
            model,
            embeddings=["item_emb"],
            mode=mode,
            features=_table_features,
            optimizer=RowWiseAdagrad(lr=0.05),
            row_boundaries={"item_emb": torch.tensor([0, 30, 40])},
        )
    loader = build_loader(source, LoaderConfig(batch_size=8), rank, world_size, wrap.loader_stages(rank))
    step = TrainStep(model, loss, torch.optim.Adam(model.parameters(), lr=1e-2), wrap=wrap)
    items = iter(loader)
    doing("train")
    while step.has_next(items) and step.step < STEPS:
        step.progress(items)
    wrap.flush()
    shutdown_loader(loader)
    probe = source.read(1, 0, 12)  # the same samples on every rank: its lookups are collective
    model.eval()
    doing("wrapped logits")
    args = tuple(inputs(probe)) if kind == "torchrec" else (probe,)
    with wrap.lookup(wrap.context_of(probe, args)):  # the probe's ids, looked up synchronously (eval mode)
        trained = _logits(kind, model, probe)
    doing("unwrap")
    unwrap_model(model, wrap, dst=dst)
    state = model.state_dict()
    holds = {k: v.device.type != "meta" for k, v in state.items()}
    if rank == (dst or 0):
        torch.save(state, path)
    unwrapped = _logits(kind, model, probe) if all(holds.values()) else None
    try:
        unwrap_model(model, wrap, dst=dst)
        again = None
    except ValueError as e:
        again = str(e)
    return {
        "trained": trained,
        "unwrapped": unwrapped,
        "holds": holds,
        "again": again,
        "types": sorted({type(m).__name__ for m in model.modules()}),
    }


def _check_export(kind, mode, tmp_path, dst=0):
    path = tmp_path / "model.pt"
    results = run_ranks(_body, 2, args=(kind, mode, str(path), dst), timeout=180)
    fresh = _user_model(kind, seed=123)  # other initial weights: every value must come from the file
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    fresh.load_state_dict(torch.load(path, weights_only=True))  # strict: the keys are the user's class's
    assert sorted(torch.load(path, weights_only=True)) == sorted(before)
    fresh.eval()
    probe = _source(kind).read(1, 0, 12)
    got = _logits(kind, fresh, probe)
    for r, res in enumerate(results):
        assert "ShardedEmbeddingCollection" not in res["types"] and "PrioritizedEmbeddingCollection" not in res["types"]
        assert torch.equal(res["trained"], results[0]["trained"])
        assert "already unswapped" in res["again"]
    assert torch.equal(got, results[0]["trained"])  # bit for bit: the trained tables, restored
    assert torch.equal(results[0]["unwrapped"], got)
    return results


def test_export_of_a_torchrec_model_loads_into_a_fresh_instance(tmp_path):
    pytest.importorskip("torchrec")
    results = _check_export("torchrec", "freescale", tmp_path)
    assert all(results[0]["holds"].values())
    tables = {k for k in results[1]["holds"] if k.startswith("ec.")}
    assert tables and not any(results[1]["holds"][k] for k in tables)  # rank 1: the tables' shapes, no values
    assert all(v for k, v in results[1]["holds"].items() if k not in tables)  # its dense tower is whole


def test_export_of_nn_embedding_tables_with_uneven_shards(tmp_path):
    results = _check_export("tables", "sync", tmp_path, dst=None)
    assert all(all(r["holds"].values()) for r in results)  # dst=None: every rank holds the tables
    assert torch.equal(results[1]["unwrapped"], results[0]["unwrapped"])


def test_load_export_of_freescale_train_gives_the_jobs_held_out_figures_bit_for_bit(tmp_path):
    """The job evaluates its trained, sharded model on the held-out file at the end, then exports it. The model
    load_export rebuilds, run over the same batches in the order the job gathered them (rank 0's, then rank 1's),
    must give the same logits: the same NE and AUC to the last bit."""
    import itertools
    import json
    import subprocess
    import sys

    from fsdata import LoaderConfig, ParquetSource, SyntheticConfig, SyntheticSource, build_loader, shutdown_loader
    from fsdata.schema import write_parquet
    from pipelines import evaluate, load_export
    from pipelines.job.checkpoint.export import SOFTMAX_MODEL
    from pipelines.models.softmax import SoftmaxConfig, SoftmaxModel

    write_parquet(
        SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=40, seed=7)).read(0, 0, 40),
        str(tmp_path / "held.parquet"),
        row_group_size=16,
    )
    argv = ["--nproc", "2", "--steps", "4", "--batch-size", "8", "--num-samples", "256", "--device", "cpu"]
    argv += ["--process.threads", "1"]  # the same intra-op threads as the comparison below, whatever the cores
    files = ["--eval-data", "held.parquet", "--export", "out/model.pt", "--summary-json", "s.json"]
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "train", *argv, *files],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "samples read were not trained on: the loader reads batches ahead of the step" in proc.stdout
    described = json.loads((tmp_path / "out/model.pt.json").read_text())
    assert described["model"] == SOFTMAX_MODEL and described["config"]["num_items"] == 20_000
    model = load_export(tmp_path / "out/model.pt")
    assert isinstance(model, SoftmaxModel) and not model.training
    torch.manual_seed(0)  # the job's seed: the initial weights, which training changed
    assert not torch.equal(SoftmaxModel(SoftmaxConfig(**described["config"])).head[0].weight, model.head[0].weight)
    held = ParquetSource(tmp_path / "held.parquet")
    loaders = [build_loader(held, LoaderConfig(batch_size=8), rank, 2) for rank in (0, 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = evaluate(model, itertools.chain(*loaders), world_size=1)
    finally:
        torch.set_num_threads(threads)
        for loader in loaders:
            shutdown_loader(loader)
    job = json.loads((tmp_path / "s.json").read_text())["eval"][-1]
    assert (result.ne, result.auc, result.samples) == (job["ne"], job["auc"], 40)
