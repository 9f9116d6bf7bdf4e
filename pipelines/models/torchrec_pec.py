"""Mode ``torchrec-pec``: torchrec's own Prioritized Embedding Communication (PEC), beside FreeScale's prioritized
updates and the ``torchrec`` baseline.

torchrec 1.8.0 ships PEC's sharded module (torchrec.modules.pec_embedding_modules.PECEmbeddingCollection, sharded
row-wise by torchrec.distributed.pec_embedding.PECEmbeddingCollectionSharder into a ShardedPECEmbeddingCollection)
but no pipeline that drives it; this step drives its phases in the order of upstream's later TrainPipelinePEC. In
step i, with batch i+1 at hand (one batch of lookahead):

    input_dist(i+1)                       the ID AllToAll of batch i+1
    overlap_dist(i+1, prev=i)             mask AllToAlls: which of i+1's ids batch i touches (forward split of
                                          i+1: overlapped / not) and which of i's ids i+1 touches (i's gradient
                                          split)
    grad_dist(i-1, not overlapped)        starts the gradient AllToAll of the rows of batch i-1 that batch i did
                                          not touch: their update lands one step late, while step i computes
    lookup(i, overlapped)                 rows i shares with i-1, after i-1's update of them; its output AllToAll
    merge(i) -> forward, loss, backward   the non-overlapped rows of i were looked up a step ahead (below); the
                                          backward starts the gradient AllToAll of i's rows that i+1 shares
    apply grad(i-1, not overlapped), apply grad(i, overlapped)    fbgemm's fused optimizer, by a second lookup
    lookup(i+1, not overlapped)           rows of i+1 that i does not touch: final already; its AllToAll stays in
                                          flight into step i+1
    dense optimizer step                  DDP (DistributedModelParallel's) all-reduced the dense part in backward

so each step runs one ID AllToAll, two mask AllToAlls, two lookups with two output AllToAlls, two gradient
AllToAlls and two more lookups to apply them (torchrec's synchronous pipeline: one of each, the gradient applied
in the backward).

Gradient division. PEC's gradient AllToAll sums what the ranks send and divides by nothing; torchrec's synchronous
one divides by the world size (torchrec.distributed.comm_ops, ``GRADIENT_DIVISION``, on by default), and DDP
averages the dense gradients. As in mode ``torchrec`` each rank backpropagates loss_sum / global label count times
the world size (DDP's division undone), and the looked-up rows' gradient is multiplied by 1 / world size before
PEC's AllToAll: the table gets the summed gradient of the global mean loss, as in every other mode (exact for a
power-of-two world size).

Features. torchrec 1.8.0's PEC applies a gradient to the wrong rows when its sharding group holds more than one
feature (tests/pipelines/test_torchrec_pec_grad_order.py names the cause). The softmax model's table is read
by one feature here (``item_ids``: the kept UIH ids, then the candidates' content ids, as ``model.item_ids``), so
it trains mode torchrec's numbers (to float rounding: fbgemm may sum a row's repeated gradients in another
order); a model of the user's (``--model``, one torchrec EmbeddingCollection among its modules, one
KeyedJaggedTensor among ``inputs(batch)``) runs as it is, and with several features it shows that fault.

What else is as in mode ``torchrec`` (pipelines.models.torchrec_baseline): CPU only, table optimizers ``sgd`` and
``rowwise_adagrad`` fused by fbgemm, no checkpoints, no evaluation, no balancing, every local batch non-empty;
the step's wall time is reported (``progress_s``) and its exchanges as not measured.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fsdata.batch import Batch, offsets_to_lengths
from fsdata.item import LoaderItem
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.softmax import SoftmaxModel
from pipelines.models.step_result import StepResult
from pipelines.models.torchrec_baseline import (
    LookedUpRows,
    fuse_optimizer,
    item_collection,
    step_result,
)

ITEM_IDS_KEY = "item_ids"  # the softmax model's one feature: every id it looks up in its item table


class _LookedUpCollection(nn.Module):
    """Stands in for the user's EmbeddingCollection: the rows PEC looked up for this batch, by feature."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: Optional[dict] = None

    def forward(self, features) -> dict:
        rows, self.rows = self.rows, None
        if rows is None or sorted(rows) != sorted(features.keys()):
            raise RuntimeError(
                f"torchrec-pec mode: the collection was called with features {list(features.keys())}, PEC looked up "
                f"{None if rows is None else list(rows)}"
            )
        return rows


@dataclass
class PECTarget:
    """A model made ready for PEC: its collection taken out (torchrec's, unsharded, optimizer fused) and a stand-in
    in its place that returns what PEC looked up."""

    model: nn.Module  # the model, its collection swapped for the stand-in
    collection: nn.Module  # torchrec's EmbeddingCollection, for PECEmbeddingCollection to wrap
    args: Callable[[Batch], tuple]  # batch -> the model's arguments (once per batch)
    features: Callable[[Batch, tuple], Any]  # (batch, args) -> the collection's KeyedJaggedTensor
    feed: Callable[[dict], None]  # hands the stand-in the looked-up rows, by feature
    loss: Callable[[Any, Batch], torch.Tensor]  # (outputs, batch) -> the sum of the local per-label losses


def softmax_target(model: SoftmaxModel, optimizer_name: str, embedding_lr: float, device) -> PECTarget:
    """The softmax model, its ``item_embedding`` read by PEC as one feature (module docstring: Features)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weight = model.item_embedding.weight.detach()
    collection = item_collection(weight, optimizer_name, embedding_lr, device, features=(ITEM_IDS_KEY,))
    rows = model.item_embedding = LookedUpRows(weight.shape[1])

    def features(batch: Batch, args: tuple):
        # One "sample" per segment (a sample's kept UIH, then each sample's content ids): the ids in the order of
        # model.item_ids, which the table's rows must come back in.
        kept = batch.uih_lengths.clamp(max=model.config.max_uih)
        content = offsets_to_lengths(batch.content_offsets[batch.candidate_offsets])
        return KeyedJaggedTensor(keys=[ITEM_IDS_KEY], values=model.item_ids(batch), lengths=torch.cat([kept, content]))

    def feed(embeddings: dict) -> None:
        rows.rows = embeddings[ITEM_IDS_KEY].values()

    return PECTarget(
        model,
        collection,
        lambda batch: (batch,),
        features,
        feed,
        lambda out, batch: binary_cross_entropy_sum(out, batch.candidate_labels),
    )


def user_target(spec, optimizer_name: str, embedding_lr: float) -> PECTarget:
    """A user's model (pipelines.ModelSpec) with one torchrec EmbeddingCollection, read by the one
    KeyedJaggedTensor among its inputs; the collection's own tables and weights go to PEC."""
    from torchrec import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    found = [(name, m) for name, m in spec.model.named_modules() if isinstance(m, EmbeddingCollection)]
    if len(found) != 1:
        raise ValueError(
            f"mode torchrec-pec needs --model's model to hold one torchrec EmbeddingCollection, it holds {len(found)}"
        )
    path, collection = found[0]
    parent_path, _, attribute = path.rpartition(".")
    stand_in = _LookedUpCollection()
    setattr(spec.model.get_submodule(parent_path), attribute, stand_in)
    fuse_optimizer(collection, optimizer_name, embedding_lr)

    def features(batch: Batch, args: tuple):
        kjts = [a for a in args if isinstance(a, KeyedJaggedTensor)]
        if len(kjts) != 1:
            raise ValueError(
                f"mode torchrec-pec needs one KeyedJaggedTensor among --model's inputs(batch), got {len(kjts)}"
            )
        return kjts[0]

    def feed(embeddings: dict) -> None:
        stand_in.rows = embeddings

    args = spec.inputs if spec.inputs is not None else (lambda batch: (batch,))
    loss = (
        spec.loss
        if spec.loss is not None
        else (lambda out, batch: binary_cross_entropy_sum(out, batch.candidate_labels))
    )
    return PECTarget(spec.model, collection, lambda batch: tuple(args(batch)), features, feed, loss)


class _Dense(nn.Module):
    """The model after its lookup, and the loss: (scaled loss, [labels, BCE sum, positives]). What
    DistributedModelParallel wraps in DDP; the PEC collection beside it is only sharded, never called."""

    def __init__(self, target: PECTarget, world_size: int) -> None:
        super().__init__()
        self.model, self.world_size = target.model, world_size
        self._target = target

    def forward(self, batch: Batch, args: tuple, embeddings: dict, global_labels: float):
        for jagged in embeddings.values():
            # PEC's gradient AllToAll sums without dividing: 1 / world size here, x world size in the loss for DDP.
            jagged.values().register_hook(lambda grad: grad * (1.0 / self.world_size))
        self._target.feed(embeddings)
        labels = batch.candidate_labels
        loss = self._target.loss(self.model(*args), batch)
        scaled = (loss / max(global_labels, 1.0)) * self.world_size
        stats = torch.stack([torch.tensor(float(labels.numel())), loss.detach().cpu(), labels.sum().cpu()])
        return scaled, stats.double()


class _PECModule(nn.Module):
    """What DistributedModelParallel shards: the collection (PEC once sharded, driven by PECDriver, never called)
    beside the dense part, which its forward runs."""

    def __init__(self, collection: nn.Module, dense: _Dense) -> None:
        super().__init__()
        self.collection = collection
        self.dense = dense

    def forward(self, *inputs):
        return self.dense(*inputs)


@dataclass
class _InFlight:
    """One batch in PEC's phases: what each phase left for the next."""

    ctx: Any  # PECEmbeddingCollectionContext
    dist_input: Any  # KJTList after the input dist
    forward: Any = None  # ForwardPartitionContext: its ids split by overlap with the previous batch
    backward: Any = None  # BackwardPartitionContext: its ids split by overlap with the next batch
    early_rows: Any = None  # the non-overlapped lookup's output AllToAll, started a step ahead


def _untimed(name: str) -> ContextManager:
    return contextlib.nullcontext()


class PECDriver:
    """Drives a ShardedPECEmbeddingCollection one step at a time, in the order of the module docstring. ``span(name)``
    (e.g. fscomm.timing.Timer.span) times the waits on the training thread: ``ids_a2a`` (input dist and mask
    AllToAlls), ``emb_a2a`` (the overlapped lookup and both output AllToAlls), ``grad_a2a`` (the gradient
    AllToAlls and the lookups that apply them)."""

    def __init__(self, pec, span: Callable[[str], ContextManager] = _untimed) -> None:
        self.pec, self._span = pec, span
        self._current: Optional[_InFlight] = None  # this step's batch, its phases begun in the previous step
        self._late: Optional[_InFlight] = None  # the previous batch, its non-overlapped gradient applied this step

    def _input_dist(self, features) -> _InFlight:
        ctx = self.pec.create_context()
        return _InFlight(ctx, self.pec.input_dist(ctx, features).wait().wait())

    def _lookup(self, batch: _InFlight, overlapped: bool):
        part = batch.forward.ol_features if overlapped else batch.forward.nol_features
        return self.pec.compute_and_output_dist_in_partition(batch.ctx, part, batch.forward.splits, overlapped)

    def _grad_dist(self, batch: _InFlight, overlapped: bool) -> list:
        from torchrec.distributed.embedding_types import KJTList

        part = batch.backward.ol_features if overlapped else batch.backward.nol_features
        # One sharding group: PEC shards row-wise only.
        return self.pec.grad_dist(batch.ctx, KJTList([part]), is_overlapped=overlapped)

    def step(self, features, next_features, forward_backward: Callable[[dict], Any]) -> Any:
        """One step: ``features`` (this batch's KeyedJaggedTensor; only read at the first step, later batches
        arrive as ``next_features``), ``next_features`` (None at the last step), ``forward_backward(rows)`` runs
        the model on the looked-up rows (feature -> JaggedTensor) through its backward; its result is returned."""
        if self._current is None:  # the first batch: nothing overlaps it, all its rows are looked up ahead
            with self._span("ids_a2a"):
                first = self._input_dist(features)
                ((first.forward, _),) = [a.wait() for a in self.pec.overlap_dist(first.ctx, first.dist_input)]
            first.early_rows = self._lookup(first, overlapped=False)
            self._current = first
        current = self._current
        with self._span("ids_a2a"):
            following = self._input_dist(next_features) if next_features is not None else None
            ((following_forward, current.backward),) = [
                a.wait()
                for a in self.pec.overlap_dist(
                    ctx=None if following is None else following.ctx,
                    dist_input=None if following is None else following.dist_input,
                    prev_ctx=current.ctx,
                    prev_dist_input=current.dist_input,
                )
            ]
        # The previous batch's late gradient, started now so that its AllToAll runs under this step's forward.
        late = self._grad_dist(self._late, overlapped=False) if self._late is not None else []
        with self._span("emb_a2a"):
            rows = self.pec.merge_partitioned_embeddings(
                current.ctx,
                self._lookup(current, overlapped=True),
                current.early_rows,
                [current.forward],
                [current.backward],
            ).wait()
        result = forward_backward(rows)  # PECAll2AllSeqWait.backward starts the overlapped rows' gradient AllToAll
        with self._span("grad_a2a"):
            for applied in late + self._grad_dist(current, overlapped=True):
                applied.wait()
            if following is None:  # the last batch: every row was overlapped, its late part is empty
                for applied in self._grad_dist(current, overlapped=False):
                    applied.wait()
        if following is not None:
            following.forward = following_forward
            following.early_rows = self._lookup(following, overlapped=False)
        self._late = current if following is not None else None
        self._current = following
        return result


class TorchrecPEC:
    """Trains ``target`` with torchrec's PEC (module docstring), one ``train_on`` per step; the interface of
    TorchrecBaseline (``lookahead``, ``to_device``, ``train_on``, ``optimizer``, ``dense_sync``)."""

    lookahead = 1  # batch i+1's ids are split by overlap with batch i's before step i's forward
    dense_sync = None  # DDP all-reduces the dense gradients in the backward

    def __init__(
        self,
        target: PECTarget,
        *,
        lr: float,
        device: torch.device,
        global_labels: Callable[[Batch], float],
        phase: Optional[Callable[[str], ContextManager]] = None,
    ) -> None:
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.target = target
        self.dmp = shard_pec(_PECModule(target.collection, _Dense(target, self.world_size)), device)
        self.driver = PECDriver(self.dmp.module.collection)
        self.optimizer = torch.optim.Adam([p for _, p in in_backward_optimizer_filter(self.dmp.named_parameters())], lr)
        self.global_labels = global_labels
        self._phase: Callable[[str], Any] = phase if phase is not None else _untimed
        self._inputs: dict[int, tuple] = {}  # step -> (its model arguments, its KeyedJaggedTensor, global labels)
        self.step = 0

    def to_device(self, item: LoaderItem) -> LoaderItem:
        """The item as it is: a CPU baseline, its batches are where the model is."""
        return item

    def _prepare(self, step: int, batch: Batch) -> tuple:
        """The batch's model arguments (once per batch), its ids, and its global label count."""
        if step not in self._inputs:
            if batch.batch_size == 0:
                raise ValueError(
                    f"mode torchrec-pec: rank {self.rank} got an empty local batch at step {step}; the model's "
                    "empty-batch path skips dense parameters that DDP's static graph expects"
                )
            args = self.target.args(batch)
            self._inputs[step] = (args, self.target.features(batch, args), self.global_labels(batch))
        return self._inputs[step]

    def train_on(self, item: LoaderItem, upcoming: Sequence[LoaderItem] = ()) -> StepResult:
        """One step on ``item``; ``upcoming``: the next batch (none at the end)."""
        batch = item.batch
        t0 = time.perf_counter()
        with self._phase("freescale/torchrec_pec_step"):
            args, features, global_labels = self._prepare(self.step, batch)
            following = self._prepare(self.step + 1, upcoming[0].batch)[1] if upcoming else None

            def forward_backward(rows: dict) -> torch.Tensor:
                self.optimizer.zero_grad()
                scaled, stats = self.dmp(batch, args, rows, global_labels)
                scaled.backward()
                return stats

            stats = self.driver.step(features, following, forward_backward)
            self.optimizer.step()
        progress_s = time.perf_counter() - t0
        del self._inputs[self.step]
        self.step += 1
        return step_result(stats, progress_s, batch, self.rank, self.world_size)


def shard_pec(module: nn.Module, device: torch.device):
    """DistributedModelParallel around ``module``, whose ``collection`` (an EmbeddingCollection) becomes torchrec's
    PEC, sharded row-wise by PECEmbeddingCollectionSharder; the rest goes to DDP. The collection's optimizer must
    be fused already (fuse_optimizer)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

    world_size = dist.get_world_size()
    collection = module.collection
    pec = module.collection = PECEmbeddingCollection(collection)
    sharder = PECEmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(
        pec,
        per_param_sharding={config.name: row_wise() for config in collection.embedding_configs()},
        local_size=world_size,
        world_size=world_size,
        device_type=device.type,
        sharder=sharder,
    )
    return DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"collection": plan}),
        device=device,
        sharders=[sharder],
    )
