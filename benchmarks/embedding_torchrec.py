"""bench embedding's ``--torchrec`` rows: torchrec's synchronous sharded EmbeddingCollection and its PEC
(pipelines.models.torchrec_pec) on the same batches, tables, initial weights and toy dense model as the sync and
prioritized runs (CPU; torchrec's CPU build).

The bench's two tables (items: features uih and cand; users: feature user) become one torchrec collection, sharded
row-wise, its row-wise Adagrad fused by fbgemm (the update rule of fsembed's RowWiseAdagrad). A rank's batch is one
bag per feature. Both runs give the table the summed gradient of the ranks' losses, as FreeScale's collections do:
torchrec's synchronous gradient AllToAll divides by the world size, so its loss is multiplied by it; PEC's divides
by nothing.

Exposed time per part, on the training thread: ``ids_a2a`` the input dist (PEC: and its mask AllToAlls);
``emb_a2a`` the lookup and output AllToAll (PEC: the overlapped lookup, and the wait for both partitions);
``grad_a2a`` for the synchronous run, from the last feature's gradient to the end of the backward (autograd runs
the gradient AllToAll and fbgemm's fused update there, not separable), for PEC the gradient AllToAlls and the
lookups that apply them. The losses are compared with the sync run's (``loss_max_diff``): torchrec's agree to float
rounding, PEC's part where torchrec 1.8.0 updates other rows (three features: docs/pec.md).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

PARTS = ("ids_a2a", "emb_a2a", "grad_a2a")
MODES = ("torchrec", "torchrec_pec")


def _collection(plan, init_tables: dict[str, torch.Tensor], lr: float):
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from pipelines.models.torchrec_baseline import fuse_optimizer

    # Renamed: a table named "items" would shadow the ModuleDict method the collection keeps its tables in.
    configs = [
        EmbeddingConfig(
            name=f"table_{t.name}", embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=list(t.features)
        )
        for t in plan.tables
    ]
    collection = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for name, weight in init_tables.items():
            collection.embeddings[f"table_{name}"].weight.copy_(weight)
    fuse_optimizer(collection, "rowwise_adagrad", lr)
    return collection


def _shard(collection, pec: bool):
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

    module, sharder = (
        (PECEmbeddingCollection(collection), PECEmbeddingCollectionSharder())
        if pec
        else (collection, EmbeddingCollectionSharder())
    )
    world_size = dist.get_world_size()
    plan = construct_module_sharding_plan(
        module,
        per_param_sharding={c.name: row_wise() for c in collection.embedding_configs()},
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
        sharder=sharder,
    )
    return sharder.shard(module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))


def _kjt(batch: dict[str, torch.Tensor], features: list[str]):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=features,
        values=torch.cat([batch[f] for f in features]),
        lengths=torch.tensor([batch[f].numel() for f in features]),
    )


def run(plan, init_tables, batches, dense, warmup: int, compute_ms: float, meet, loss_fn, lr: float) -> dict:
    """Both runs on this rank: per mode, its losses, per-step exposed parts and step times (timed steps only)."""
    from fscomm.timing import Timer
    from fsembed.swap import quiet_torchrec_notes
    from pipelines.models.torchrec_pec import PECDriver

    quiet_torchrec_notes()
    features = [f for t in plan.tables for f in t.features]
    kjts = [_kjt(b, features) for b in batches]
    world_size = dist.get_world_size()
    out = {}
    for mode in MODES:
        sharded = _shard(_collection(plan, init_tables, lr), pec=mode == "torchrec_pec")
        timer = Timer()
        losses, step_s, exposed = [], [], []
        driver = PECDriver(sharded, timer.span) if mode == "torchrec_pec" else None
        dist.barrier()
        for s, kjt in enumerate(kjts):
            timer.reset()
            t0 = time.perf_counter()
            if driver is not None:
                following = kjts[s + 1] if s + 1 < len(kjts) else None
                loss = driver.step(kjt, following, lambda rows: _backward(rows, dense, compute_ms, loss_fn))
            else:
                loss = _sync_step(sharded, kjt, dense, compute_ms, loss_fn, world_size, timer)
            losses.append(loss)
            meet()
            if s >= warmup:
                step_s.append(time.perf_counter() - t0)
                summary = timer.summary()
                exposed.append({p: summary.get(p, {"total_s": 0.0})["total_s"] for p in PARTS})
        parts = {p: float(np.median([e[p] for e in exposed])) for p in PARTS}
        parts["total"] = float(np.median([sum(e[p] for p in PARTS) for e in exposed]))
        out[mode] = dict(losses=torch.stack(losses), exposed=parts, step_s=float(np.median(step_s)))
    return out


def _backward(rows: dict, dense, compute_ms: float, loss_fn, scale: float = 1.0) -> torch.Tensor:
    loss = loss_fn({f: jt.values() for f, jt in rows.items()}, dense, compute_ms)
    (loss * scale).backward()
    return loss.detach()


def _sync_step(sharded, kjt, dense, compute_ms: float, loss_fn, world_size: int, timer) -> torch.Tensor:
    ctx = sharded.create_context()
    with timer.span("ids_a2a"):
        dist_input = sharded.input_dist(ctx, kjt).wait().wait()
    with timer.span("emb_a2a"):
        rows = sharded.compute_and_output_dist(ctx, dist_input).wait()
    reached: list[float] = []
    for jt in rows.values():
        jt.values().register_hook(lambda grad: reached.append(time.perf_counter()))
    # x world size: torchrec's gradient AllToAll divides by it (module docstring).
    loss = _backward(rows, dense, compute_ms, loss_fn, scale=float(world_size))
    if reached:
        timer.add("grad_a2a", time.perf_counter() - max(reached))
    return loss
