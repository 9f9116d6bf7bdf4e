"""Row-wise sharded embedding collection, synchronous path: the "vanilla TorchRec" baseline.

Per embedding group (tables of one dtype and dim, see plan.py) and step:

    forward   ID AllToAll (batch-major -> shard-major) -> local lookup -> embedding AllToAll back (batch-major)
    backward  gradient AllToAll (batch-major -> shard-major) -> duplicate ids summed -> sparse row-wise update

All three exchanges sit on the critical path: their wait times are the exposed communication that
prioritized updates (prioritized.py) remove. The optimizer is fused, as in torchrec: the backward updates the
rows and returns no gradient for the tables, so a dense optimizer never sees them.

Ids come either as ``{feature: ids}`` (exchanged inside the step, the baseline) or as ``PrefetchedIds`` from
the loader's ID-prefetch stage (exchange already started).
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fscomm.timing import Timer
from fsembed.id_prefetch import PrefetchedIds, ShardedIds, start_prefetch
from fsembed.optim import SGD, RowWiseOptimizer
from fsembed.plan import GroupLayout, ShardingPlan
from fsembed.transports import EmbeddingTransports, embedding_transports
from kernels import ops

Ids = Union[PrefetchedIds, Mapping[str, torch.Tensor]]

# Timer span names: the three parts of exposed embedding communication (Figure 9).
IDS_A2A = "ids_a2a"
EMB_A2A = "emb_a2a"
GRAD_A2A = "grad_a2a"


class GroupShard:
    """This rank's rows of one group: the local weight [local_rows, dim] and its optimizer state."""

    def __init__(self, layout: GroupLayout, rank: int, weight: torch.Tensor, optimizer: RowWiseOptimizer):
        self.layout = layout
        self.base = int(layout.boundaries[rank])
        self.weight = weight
        self.state = optimizer.init_state(weight)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, local_ids)


def _init_group_weight(
    plan: ShardingPlan, layout: GroupLayout, rank: int, full: Mapping[str, torch.Tensor], seed: int, device
) -> torch.Tensor:
    """Local rows of every table of the group, stacked. Tables not in ``full`` get a seeded uniform init that is
    identical whatever the world size (the whole table is drawn, then sliced)."""
    parts = []
    for name in layout.tables:
        t = plan.table(name)
        if name in full:
            table = full[name]
            if tuple(table.shape) != (t.num_rows, t.dim):
                raise ValueError(
                    f"table {name!r}: initial values have shape {tuple(table.shape)}, expected {(t.num_rows, t.dim)}"
                )
        else:
            gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
            bound = 1.0 / t.num_rows**0.5
            table = torch.empty(t.num_rows, t.dim).uniform_(-bound, bound, generator=gen)
        rb = plan.row_boundaries[name]
        parts.append(table[int(rb[rank]) : int(rb[rank + 1])].to(t.dtype))
    return torch.cat(parts).to(device).contiguous()


class _SyncLookup(torch.autograd.Function):
    """Output: batch-major embeddings [N, D]. Backward: gradient AllToAll and the fused row update."""

    @staticmethod
    def forward(ctx, anchor, coll: "ShardedEmbeddingCollection", shard: GroupShard, sid: ShardedIds, local_ids):
        ctx.coll, ctx.shard, ctx.sid, ctx.local_ids = coll, shard, sid, local_ids
        return coll._lookup_and_return(shard, sid, local_ids)

    @staticmethod
    def backward(ctx, grad_out):
        coll, shard, sid = ctx.coll, ctx.shard, ctx.sid
        grads = coll._to_send_order(grad_out, sid)
        h = coll.backward_transport.all_to_all(grads, sid.send_splits, sid.recv_splits)
        with coll.timer.span(GRAD_A2A):
            shard_grads = h.wait()
        coll.optimizer.apply(shard.weight, shard.state, ctx.local_ids, shard_grads)
        return None, None, None, None, None


class ShardedEmbeddingCollection(nn.Module):
    """Several tables, row-wise sharded over the ranks, looked up by feature name.

    ``forward(ids, next_ids=None) -> {feature: Tensor[n_f, dim]}`` (rows in the order of the feature's ids).
    ``grad_scale`` multiplies every gradient row before the gradient AllToAll: torchrec uses 1/world_size
    (its embedding gradients are divided by the world size); 1.0 gives the plain gradient of the loss.
    ``transport``: by default the embedding exchanges' own transports (transports.EmbeddingTransports, four
    groups); a single transport serves every exchange on CPU, but not on CUDA, where autograd's backward thread
    needs a group of its own (``backward_transport``, which then also carries the bulk exchanges).
    """

    def __init__(
        self,
        plan: ShardingPlan,
        rank: Optional[int] = None,
        *,
        transport=None,
        backward_transport=None,
        optimizer: Optional[RowWiseOptimizer] = None,
        init_tables: Optional[Mapping[str, torch.Tensor]] = None,
        seed: int = 0,
        grad_scale: float = 1.0,
        device: Union[str, torch.device] = "cpu",
        timer: Optional[Timer] = None,
    ):
        super().__init__()
        self.rank = dist.get_rank() if rank is None else rank
        if not 0 <= self.rank < plan.world_size:
            raise ValueError(
                f"ShardedEmbeddingCollection: rank {self.rank} outside the plan's world size {plan.world_size}"
            )
        if dist.is_initialized() and dist.get_world_size() != plan.world_size:
            raise ValueError(
                f"ShardedEmbeddingCollection: plan is for {plan.world_size} ranks, the job has {dist.get_world_size()}"
            )
        self.plan = plan
        self.device = torch.device(device)
        if transport is None:
            transport = embedding_transports()
        elif not isinstance(transport, EmbeddingTransports):
            back = backward_transport if backward_transport is not None else transport
            transport = EmbeddingTransports(transport, back, back)
        self.transports = transport
        self.transport = transport.forward  # exchanges issued by forwards
        self.backward_transport = transport.backward  # urgent exchanges issued by backwards
        self.bulk_transport = transport.bulk  # overlapped exchanges issued by backwards (prioritized)
        self.optimizer = optimizer if optimizer is not None else SGD()
        self.grad_scale = float(grad_scale)
        self.timer = timer if timer is not None else Timer(self.device)
        self.shards: dict[str, GroupShard] = {
            g.name: GroupShard(
                g,
                self.rank,
                _init_group_weight(plan, g, self.rank, init_tables or {}, seed, self.device),
                self.optimizer,
            )
            for g in plan.groups
        }
        # The fused optimizer updates the tables in backward; autograd only needs one leaf to reach it.
        self._anchor = torch.zeros(0, requires_grad=True)

    # ------------------------------------------------------------------ exchanges
    def exchange_ids(self, features: Mapping[str, torch.Tensor]) -> PrefetchedIds:
        """Starts the ID AllToAll of every group now (the baseline's in-step ID exchange)."""
        keyed = self.plan.stack_ids({k: v.to(self.device) for k, v in features.items()})
        return start_prefetch(keyed, self.plan.group_boundaries, self.transport, self.rank)

    def _as_prefetched(self, ids: Ids) -> PrefetchedIds:
        if isinstance(ids, PrefetchedIds):
            return ids
        with self.timer.span(IDS_A2A):
            return self.exchange_ids(ids)

    def _wait_ids(self, sid: ShardedIds, shard: GroupShard) -> torch.Tensor:
        with self.timer.span(IDS_A2A):
            return sid.wait() - shard.base

    def _to_send_order(self, grad_out: torch.Tensor, sid: ShardedIds) -> torch.Tensor:
        g = grad_out.index_select(0, sid.perm).contiguous()
        return g * self.grad_scale if self.grad_scale != 1.0 else g

    def _lookup_and_return(self, shard: GroupShard, sid: ShardedIds, local_ids: torch.Tensor) -> torch.Tensor:
        h = self.transport.all_to_all(shard.lookup(local_ids), sid.recv_splits, sid.send_splits)
        with self.timer.span(EMB_A2A):
            back = h.wait()
        return ops.ranged_combine(back, sid.perm)

    def _split(self, sid: ShardedIds, out: torch.Tensor, layout: GroupLayout) -> dict[str, torch.Tensor]:
        return dict(zip(layout.features, out.split(sid.segments)))

    # ------------------------------------------------------------------ forward
    def forward(self, ids: Ids, next_ids: Optional[Ids] = None) -> dict[str, torch.Tensor]:
        """Synchronous lookup of this step's ids; ``next_ids`` is accepted for the same call shape as the
        prioritized collection and ignored."""
        pre = self._as_prefetched(ids)
        out: dict[str, torch.Tensor] = {}
        train = self.training and torch.is_grad_enabled()
        for name, shard in self.shards.items():
            sid = pre[name]
            local = self._wait_ids(sid, shard)
            if train:
                emb = _SyncLookup.apply(self._anchor, self, shard, sid, local)
            else:
                emb = self._lookup_and_return(shard, sid, local)
            out.update(self._split(sid, emb, shard.layout))
        return out

    # ------------------------------------------------------------------ state
    def flush(self) -> None:
        """Nothing is ever deferred on the synchronous path (the prioritized collection overrides this)."""

    def tables_state(self) -> dict[str, torch.Tensor]:
        """This rank's rows and optimizer state, per group (clones)."""
        out = {}
        for name, shard in self.shards.items():
            out[f"{name}.weight"] = shard.weight.detach().clone()
            for k, v in shard.state.items():
                out[f"{name}.{k}"] = v.clone()
        return out

    def load_tables_state(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, shard in self.shards.items():
            w = state.get(f"{name}.weight")
            if w is None or w.shape != shard.weight.shape:
                raise ValueError(
                    f"rank {self.rank}: table state of group {name!r} missing or of the wrong shape (another world "
                    "size?)"
                )
            shard.weight.copy_(w)
            for k, v in shard.state.items():
                v.copy_(state[f"{name}.{k}"])

    # Through nn.Module's extra state the tables (and, for the prioritized collection, the exchange in flight)
    # ride in the user's model.state_dict() wherever the collection sits in the model.
    def get_extra_state(self) -> dict:
        """This rank's shard: no collective, no change of state (a complete checkpoint needs every rank's)."""
        return {"world_size": self.plan.world_size, "rank": self.rank, "tables": self.tables_state()}

    def set_extra_state(self, state: dict) -> None:
        if state.get("world_size") != self.plan.world_size or state.get("rank") != self.rank:
            raise ValueError(
                f"rank {self.rank}: embedding checkpoint was written by rank {state.get('rank')} of "
                f"{state.get('world_size')}, "
                f"this job is rank {self.rank} of {self.plan.world_size} (resharding needs full tables: full_tables())"
            )
        self.load_tables_state(state["tables"])

    def gather_table(self, name: str, dst: Optional[int] = 0) -> Optional[torch.Tensor]:
        """Table ``name`` whole [num_rows, dim] on rank ``dst`` (None on the others), or on every rank with
        ``dst=None``. Collective: every rank calls it, for the same tables in the same order, after ``flush()``.
        Each rank sends only its own rows, so the gathering rank holds one whole table beside its shard, never
        every table on every rank as :meth:`full_tables` does."""
        if name not in self.plan.row_boundaries:
            raise ValueError(f"gather_table: no table {name!r}; the plan has {sorted(self.plan.row_boundaries)}")
        world = self.plan.world_size
        if dst is not None and not 0 <= dst < world:
            raise ValueError(f"gather_table: dst must be a rank in [0, {world}) or None (every rank), got {dst}")
        if getattr(self, "_unflushed", False):  # its rows still lack the deferred updates of the last step
            raise ValueError(f"rank {self.rank}: gather_table after a training step needs flush() first, on every rank")
        t = self.plan.table(name)
        group = next(g for g in self.plan.groups if name in g.tables)
        rb = [int(x) for x in self.plan.row_boundaries[name]]
        base = int(group.table_base[name][self.rank] - group.boundaries[self.rank])
        # gloo moves host tensors only; NCCL (the default group of a GPU job) moves device tensors only
        wire = torch.device("cpu") if "gloo" in str(dist.get_backend()) else self.device
        mine = self.shards[group.name].weight.detach()[base : base + rb[self.rank + 1] - rb[self.rank]].to(wire)
        if dst is not None and self.rank != dst:
            if mine.shape[0]:
                dist.send(mine.contiguous(), dst)
            return None
        out = torch.empty(t.num_rows, t.dim, dtype=t.dtype, device=wire)
        for r in range(world):
            part = out[rb[r] : rb[r + 1]]  # rows of one rank: a contiguous slice, received in place
            if r == self.rank:
                part.copy_(mine)
            if not part.shape[0]:
                continue
            if dst is None:
                dist.broadcast(part, src=r)
            elif r != self.rank:
                dist.recv(part, src=r)
        return out

    def full_tables(self) -> dict[str, torch.Tensor]:
        """Every table whole, gathered on every rank (tests and small benchmarks only: AllGathers whole tables)."""
        self.flush()
        out = {}
        for gname, shard in self.shards.items():
            local = torch.arange(shard.weight.shape[0], device=self.device)
            parts = self.plan.unstack(gname, local, self.rank)
            for tname, (mask, _) in parts.items():
                t = self.plan.table(tname)
                mine = shard.weight[mask].detach().cpu().float()
                gathered = [None] * self.plan.world_size
                dist.all_gather_object(gathered, mine)
                out[tname] = torch.cat(gathered).to(t.dtype)
        return out
