"""Bring your own model: a torchrec EmbeddingCollection model trained by FreeScale, its code unchanged.

    # sync; freescale with and without balancer:
    torchrun --standalone --nproc-per-node 2 examples/bring_your_own_model.py
    torchrun --standalone --nproc-per-node 2 examples/bring_your_own_model.py --partitioner none
    torchrun --standalone --nproc-per-node 2 examples/bring_your_own_model.py --export model.pt
    freescale train --nproc 2 --steps 5 --model examples/bring_your_own_model.py:build_model --export model.pt

The model is the user's: two tables (items, shared by the history and the candidates features; categories, looked
up by an extra jagged feature of the batch), a KeyedJaggedTensor input and a dense tower of its own. The script
trains it on the same synthetic data in mode sync (tables sharded, blocking exchanges, no balancing), in mode
freescale (balancer, ID prefetch, prioritized updates) and in mode freescale without the balancer, and prints one
JSON line last: "parity" is true when every per-step loss of freescale equals sync's within rtol 1e-5 with the
balancer (which changes the order of the sums) and bit for bit without it; the loss lists follow.

``--export PATH``: after the freescale run, ``unwrap_model`` puts the trained tables back into the model's own
EmbeddingCollection and rank 0 saves ``model.state_dict()``: the state of a plain ``Recommender``, which a fresh
instance loads with ``load_state_dict(torch.load(PATH))``, no FreeScale needed.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from fsdata import BalancerConfig, Batch, Jagged, LoaderConfig, balancer_stages, build_loader, shutdown_loader
from fsdata.synthetic import SyntheticConfig, SyntheticSource
from fsembed import RowWiseAdagrad
from pipelines import ModelSpec, TrainStep, data_dims, host_transport, unwrap_model, wrap_model

NUM_ITEMS, NUM_CATEGORIES, DIM = 1000, 50, 8


class Recommender(nn.Module):
    """The user's model: knows torchrec, not FreeScale."""

    def __init__(self, dense_dim: int, num_labels: int) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item_table",
                    embedding_dim=DIM,
                    num_embeddings=NUM_ITEMS,
                    feature_names=["history", "candidates"],
                ),
                EmbeddingConfig(
                    name="category_table",
                    embedding_dim=DIM,
                    num_embeddings=NUM_CATEGORIES,
                    feature_names=["category_ids"],
                ),
            ],
            device=torch.device("cpu"),
        )
        self.tower = nn.Sequential(nn.Linear(3 * DIM + dense_dim, 32), nn.ReLU(), nn.Linear(32, num_labels))

    def forward(self, kjt: KeyedJaggedTensor, num_candidates: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        out = self.ec(kjt)  # {feature: JaggedTensor of its rows}
        history, categories = (
            torch.segment_reduce(out[f].values(), "sum", lengths=out[f].lengths(), unsafe=True)
            for f in ("history", "category_ids")
        )
        candidates = out["candidates"].values()
        user = torch.cat([history, categories, dense], 1).repeat_interleave(
            num_candidates, 0, output_size=candidates.shape[0]
        )
        return self.tower(torch.cat([candidates, user], 1))


def inputs(batch: Batch) -> tuple:
    """The batch as the model's inputs: one KJT (history, first content id of each candidate, categories)."""
    first_content = batch.content_ids[batch.content_offsets[:-1]] % NUM_ITEMS
    categories = batch.extra_jagged["category_ids"]
    kjt = KeyedJaggedTensor(
        keys=["history", "candidates", "category_ids"],
        values=torch.cat([batch.uih_item_ids % NUM_ITEMS, first_content, categories.values]),
        lengths=torch.cat([batch.uih_lengths, batch.num_candidates, categories.lengths]),
    )
    return kjt, batch.num_candidates, batch.dense


def loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, batch.candidate_labels, reduction="sum")


class WithCategories:
    """The user's source: synthetic samples plus an extra jagged feature (category ids) the balancer moves too."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def num_samples(self, epoch: int) -> int:
        return self.inner.num_samples(epoch)

    def describe(self) -> str:
        return f"{self.inner.describe()} + category_ids"

    def read(self, epoch: int, start: int, stop: int) -> Batch:
        batch = self.inner.read(epoch, start, stop)
        lengths = batch.sample_ids % 3
        values = (batch.sample_ids.repeat_interleave(lengths) * 7 + torch.arange(int(lengths.sum()))) % NUM_CATEGORIES
        batch.extra_jagged = {"category_ids": Jagged.from_lengths(values, lengths)}
        return batch


def build_model(config) -> ModelSpec:
    """The factory of `freescale train --model examples/bring_your_own_model.py:build_model`: gets the job's config,
    returns the model, how a batch becomes its inputs, its loss, which modules to swap, and (here) the source
    with the extra feature the model reads."""
    dims = data_dims(config)  # the job's data: its dense width and label count
    torch.manual_seed(config.run.seed)
    return ModelSpec(
        Recommender(dense_dim=dims.dense_dim, num_labels=dims.num_labels),
        inputs=inputs,
        loss=loss,
        types=["EmbeddingCollection"],
        source=WithCategories,
    )


def train(mode: str, partitioner: str, steps: int, rank: int, world: int, export: Optional[str] = None) -> list[float]:
    source = WithCategories(SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=2000, seed=1, uih_max=64)))
    torch.manual_seed(0)
    model = Recommender(dense_dim=4, num_labels=1)
    wrap = wrap_model(model, types=["EmbeddingCollection"], mode=mode, inputs=inputs, optimizer=RowWiseAdagrad(lr=0.05))
    stages = []
    if mode == "freescale" and partitioner != "none":
        stages += balancer_stages(BalancerConfig(partitioner), host_transport("balancer"), rank, world, capacity=16)
    stages += wrap.loader_stages(rank)
    loader = build_loader(source, LoaderConfig(batch_size=16), rank, world, stages)
    step = TrainStep(model, loss, torch.optim.Adam(model.parameters(), lr=1e-2), wrap=wrap)
    items, losses = iter(loader), []
    while len(losses) < steps and step.has_next(items):
        losses.append(step.progress(items).loss)
    wrap.flush()
    shutdown_loader(loader)
    if export is not None:  # the user's own modules back, the trained tables gathered to rank 0
        unwrap_model(model, wrap, dst=0)
        if rank == 0:
            torch.save(model.state_dict(), export)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitioner", default="fbs", help="the balancer's partitioner in mode freescale (none: off)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--export", metavar="PATH", help="save the freescale run's model (a plain Recommender) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {"sync": train("sync", "none", args.steps, rank, world)}
    runs["freescale"] = train("freescale", args.partitioner, args.steps, rank, world, args.export)
    if args.partitioner != "none":  # and without the balancer: then the losses must be equal bit for bit
        runs["freescale_partitioner_none"] = train("freescale", "none", args.steps, rank, world)
    balanced = args.partitioner != "none"
    sync, fs = runs["sync"], runs["freescale"]
    report = {"partitioner": args.partitioner, "steps": args.steps}
    report["parity_balanced" if balanced else "parity_bit_for_bit"] = len(sync) == len(fs) == args.steps and all(
        abs(a - b) <= 1e-5 * abs(a) if balanced else a == b for a, b in zip(sync, fs)
    )
    if balanced:
        report["parity_bit_for_bit"] = runs["freescale_partitioner_none"] == sync
    report["parity"] = all(v for k, v in report.items() if k.startswith("parity_"))
    if rank == 0:
        print(json.dumps({"parity": report.pop("parity"), **report, **runs}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
