"""Mode ``torchrec``: the real torchrec DistributedModelParallel + TrainPipelineSparseDist, as an outside baseline.

The trainer's other baselines (``sync``, ``sdd``, ``semisync``) imitate torchrec's patterns with FreeScale's own
sharded tables. This mode trains the same softmax model with torchrec itself (CPU, gloo), so their figures can
be checked against the real thing:

    item_embedding  -> a torchrec EmbeddingCollection (one table named ``item_embedding``, two features: the kept
                       UIH items ``uih_item_ids`` and the candidates' ``content_ids``), sharded row-wise by
                       DistributedModelParallel, its optimizer fused into the backward (fbgemm)
    the rest        -> data parallel: DMP wraps it in DistributedDataParallel
    the step        -> TrainPipelineSparseDist.progress(): batch i+1's input dist (the ID AllToAll) overlaps batch
                       i's forward, batch i+2 is taken from the loader; so the trainer keeps 2 batches of lookahead

It implements the API's step interface (``lookahead``, ``to_device``, ``train_on`` returning a StepResult), so
`freescale train`'s builder picks it instead of pipelines.api.step.TrainStep and the trainer drives it alike.

The model's code does not change: its ``item_embedding`` becomes a module that returns the rows the collection
looked up for this batch (the same module swap as fsembed.swap, with torchrec's collection behind it).

Matched with ``sync`` mode, so that losses and NE compare step by step:
* same initial weights (the table is a copy of the seeded ``nn.Embedding``), data, and local batches;
* loss semantics: each rank backpropagates loss_sum / global label count (counted before the batch enters
  TrainPipelineSparseDist), times the world size: DDP averages dense gradients over ranks and torchrec divides embedding
  gradients by the world size (comm_ops gradient division, on by default), so the factor gives back the summed
  gradient of the global mean loss that the other modes use (exact for a power-of-two world size);
* optimizers: dense Adam(``lr``), as the trainer's; the table's fused optimizer is fbgemm's EXACT_SGD
  (``sgd``) or EXACT_ROWWISE_ADAGRAD (``rowwise_adagrad``) at ``embedding_lr``, the update rules of fsembed's
  row-wise SGD and RowWiseAdagrad.
Not matched:
* summation order: fbgemm sums a row's duplicate gradients in another order than fsembed, and DDP reduces dense
  gradients in buckets: losses agree to float rounding, not bit for bit;
* ``--embedding-optimizer adam`` is refused: torchrec 1.8's fused Adam fails on CPU;
* no checkpoints or resume (DMP's sharded state is not wired to FreeScale's checkpoint format), CPU only
  (torchrec's CPU build is the one installed), and every local batch must hold at least one sample.

Accounting. Measured as in the other modes: step time, samples/s, data wait, the label-count all-reduce, loss,
NE. Not measured, reported as None ("n/m" in tables), never as 0: the ID AllToAll (input dist), the embedding
and gradient AllToAlls, DDP's all-reduce, and so compute alone, the straggler wait and bubbles: progress() runs
them all interleaved and exposes no timing of its parts. Reported instead: ``progress_s``, progress()'s wall
time per rank. The loss bookkeeping costs one small all-reduce per step here (``bookkeeping_s``, inside the step
time), which the other modes fold into their dense all-reduce.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fsdata.balance_measures import sparsity
from fsdata.batch import CONTENT_KEY, UIH_ITEM_KEY, Batch, offsets_to_lengths
from fsdata.item import LoaderItem
from pipelines.metrics import binary_cross_entropy_sum
from pipelines.models.softmax import SoftmaxModel
from pipelines.models.step_result import StepResult

TORCHREC_PACKAGES = ("torchrec", "fbgemm_gpu")
TABLE_NAME = "item_embedding"  # the swapped module's name, as fsembed.swap names its table
EMBEDDING_OPTIMIZERS = ("sgd", "rowwise_adagrad")
# Exposed-time parts that progress() hides (the trainer reports them as None).
UNMEASURED_PARTS = ("ids_a2a", "emb_a2a", "grad_a2a", "dense_allreduce")
# Bookkeeping all-reduce: global scalars, then per-rank slots.
_GLOBAL_FIELDS = ("labels", "loss_sum", "positives")
_PER_RANK_FIELDS = ("progress_s", "tokens", "samples", "sparsity")


def missing_packages() -> list[str]:
    """The packages of this mode that cannot be found here (cheap: nothing is imported)."""
    return [name for name in TORCHREC_PACKAGES if importlib.util.find_spec(name) is None]


def unavailable_message(missing: Sequence[str]) -> str:
    return (
        f"mode torchrec needs the package(s) {', '.join(missing)}, not importable here: it is a CPU baseline only "
        "(torchrec==1.8.0 installed with --no-deps beside fbgemm-gpu-cpu==1.8.0, as scripts/setup.sh does)"
    )


def require_torchrec() -> None:
    """Imports torchrec, or raises ImportError naming what is missing (a broken fbgemm load included)."""
    missing = missing_packages()
    if missing:
        raise ImportError(unavailable_message(missing))
    try:
        import torchrec.distributed.train_pipeline  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(f"{unavailable_message(['torchrec'])}: {error}") from error


def item_ids_kjt(model: SoftmaxModel, batch: Batch):
    """The ids the model looks up in ``item_embedding``, as a KeyedJaggedTensor with per-sample lengths.

    The same ids as ``model.item_ids(batch)``, in the same order (kept UIH items, then content ids, modulo the
    table size): the features of Batch.to_kjt after the model's truncation, which is what the table sees."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kept = batch.uih_lengths.clamp(max=model.config.max_uih)
    content_per_sample = offsets_to_lengths(batch.content_offsets[batch.candidate_offsets])
    return KeyedJaggedTensor(
        keys=[UIH_ITEM_KEY, CONTENT_KEY], values=model.item_ids(batch), lengths=torch.cat([kept, content_per_sample])
    )


@dataclass
class TorchrecInput:
    """One local batch as it enters TrainPipelineSparseDist (a torchrec Pipelineable, registered at build time)."""

    item_ids: object  # KeyedJaggedTensor: what the sharded collection's input dist sends
    batch: Batch  # the dense part's input
    global_labels: float  # label count of the global batch (the loss's denominator)

    def to(self, device: torch.device, non_blocking: bool = False) -> "TorchrecInput":
        return TorchrecInput(
            self.item_ids.to(device, non_blocking=non_blocking), self.batch.to(device, non_blocking), self.global_labels
        )

    def record_stream(self, stream) -> None:
        self.item_ids.record_stream(stream)
        for tensor in self.batch.tensors().values():
            tensor.record_stream(stream)


class LookedUpRows(nn.Module):
    """Stands in for the model's ``item_embedding``: the rows the collection looked up for this batch."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.rows: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows, self.rows = self.rows, None
        if rows is None or rows.shape[0] != ids.numel():
            raise RuntimeError(
                f"torchrec mode: item_embedding called with {ids.numel()} ids, the collection looked up "
                f"{None if rows is None else rows.shape[0]} rows"
            )
        return rows.reshape(*ids.shape, self.dim)


class _DenseStep(nn.Module):
    """The model after its embedding lookup, and the loss: (scaled loss, [labels, BCE sum, positives])."""

    def __init__(self, model: SoftmaxModel, world_size: int) -> None:
        super().__init__()
        self.model, self.world_size = model, world_size

    def forward(self, inputs: TorchrecInput, embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        rows = {key: jt.values() for key, jt in embeddings.items()}  # waits for the embedding AllToAll
        self.model.item_embedding.rows = torch.cat([rows[UIH_ITEM_KEY], rows[CONTENT_KEY]])
        labels = inputs.batch.candidate_labels
        loss = binary_cross_entropy_sum(self.model(inputs.batch), labels)
        # x world size: DDP and torchrec's gradient division both divide by it (module docstring).
        scaled = (loss / max(inputs.global_labels, 1.0)) * self.world_size
        stats = torch.stack([torch.tensor(float(labels.numel())), loss.detach().cpu(), labels.sum().cpu()])
        return scaled, stats.double()


class _TorchrecSoftmaxModel(nn.Module):
    """What DMP shards and TrainPipelineSparseDist traces: the collection reads only a field of the input, so torchrec's
    tracer finds it at the top level and pipelines its input dist; ``dense`` holds no sharded module, so the
    tracer keeps it whole (a leaf)."""

    def __init__(self, collection: nn.Module, dense: _DenseStep) -> None:
        super().__init__()
        self.item_collection = collection
        self.dense = dense

    def forward(self, inputs: TorchrecInput):
        return self.dense(inputs, self.item_collection(inputs.item_ids))


def item_collection(
    weight: torch.Tensor,
    optimizer_name: str,
    embedding_lr: float,
    device: torch.device,
    features: Sequence[str] = (UIH_ITEM_KEY, CONTENT_KEY),
):
    """torchrec's EmbeddingCollection holding the model's item table (a copy of its seeded weight) looked up by
    ``features``, its optimizer fused into the backward."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    collection = EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name=TABLE_NAME,
                embedding_dim=weight.shape[1],
                num_embeddings=weight.shape[0],
                feature_names=list(features),
            )
        ],
        device=device,
    )
    with torch.no_grad():
        collection.embeddings[TABLE_NAME].weight.copy_(weight)
    fuse_optimizer(collection, optimizer_name, embedding_lr)
    return collection


def fuse_optimizer(collection: nn.Module, optimizer_name: str, embedding_lr: float) -> None:
    """Fuses the tables' optimizer into the backward: once sharded, fbgemm's EXACT_SGD (``sgd``) or
    EXACT_ROWWISE_ADAGRAD (``rowwise_adagrad``), the update rules of fsembed's row-wise SGD and RowWiseAdagrad."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if optimizer_name == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, collection.parameters(), {"lr": embedding_lr})
    else:
        apply_optimizer_in_backward(RowWiseAdagrad, collection.parameters(), {"lr": embedding_lr, "eps": 1e-8})


def check_device_and_optimizer(mode: str, device: torch.device, optimizer_name: str) -> None:
    """What the torchrec modes can run here: CPU, and an embedding optimizer torchrec's CPU build fuses."""
    if device.type != "cpu":
        raise ValueError(f"mode {mode} is a CPU baseline only (got device {device}); pass --device cpu")
    if optimizer_name not in EMBEDDING_OPTIMIZERS:
        raise ValueError(
            f"mode {mode} supports --embedding-optimizer {' or '.join(EMBEDDING_OPTIMIZERS)}, not "
            f"{optimizer_name!r} (torchrec's fused Adam fails on CPU)"
        )


def step_result(stats: torch.Tensor, progress_s: float, batch: Batch, rank: int, world_size: int) -> StepResult:
    """A torchrec step's result from its local [labels, BCE sum, positives] and its wall time ``progress_s``: one
    SUM all-reduce of [labels, BCE sum, positives | per-rank slots] (float64: exact counts); the exchanges the
    step interleaves with its compute are reported as unmeasured."""
    t0 = time.perf_counter()
    book = torch.zeros(len(_GLOBAL_FIELDS) + world_size * len(_PER_RANK_FIELDS), dtype=torch.float64)
    book[: len(_GLOBAL_FIELDS)] = stats
    lengths = batch.uih_lengths.cpu()
    slot = len(_GLOBAL_FIELDS) + rank * len(_PER_RANK_FIELDS)
    book[slot : slot + len(_PER_RANK_FIELDS)] = torch.tensor(
        (progress_s, float(lengths.sum()), float(batch.batch_size), sparsity(lengths)), dtype=torch.float64
    )
    dist.all_reduce(book)
    bookkeeping_s = time.perf_counter() - t0
    per_rank = book[len(_GLOBAL_FIELDS) :].view(world_size, len(_PER_RANK_FIELDS))
    return StepResult(
        float(book[1] / book[0]) if book[0] > 0 else float("nan"),
        float(book[0]),
        float(book[2]),
        loss_sum=float(book[1]),
        local_loss_sum=stats[1],
        per_rank={name: per_rank[:, i].numpy() for i, name in enumerate(_PER_RANK_FIELDS)},
        unmeasured=UNMEASURED_PARTS,  # compute and the all-reduce: not separable from what the step interleaves
        extras={"progress_s": per_rank[:, 0].tolist(), "bookkeeping_s": bookkeeping_s},
    )


class TorchrecBaseline:
    """Trains ``model`` (whose ``item_embedding`` it swaps) through torchrec: DMP + TrainPipelineSparseDist, one
    ``train_on`` per step. ``global_labels(batch)``: the global batch's label count (the trainer's timed
    all-reduce); ``phase(name)``: a context named around progress() (the trainer's, in a trace)."""

    lookahead = 2  # batches TrainPipelineSparseDist holds beyond the current one: i+1 in input dist, i+2 loaded
    dense_sync = None  # DDP all-reduces the dense gradients inside progress()

    def __init__(
        self,
        model: SoftmaxModel,
        *,
        optimizer_name: str,
        embedding_lr: float,
        lr: float,
        device: torch.device,
        global_labels: Callable[[Batch], float],
        phase: Optional[Callable[[str], ContextManager]] = None,
    ) -> None:
        require_torchrec()
        from fsembed.swap import quiet_torchrec_notes

        quiet_torchrec_notes()
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
        from torchrec.distributed.types import ShardingEnv, ShardingPlan
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.streamable import Pipelineable

        check_device_and_optimizer("torchrec", device, optimizer_name)
        Pipelineable.register(TorchrecInput)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model = model
        weight = model.item_embedding.weight.detach()
        collection = item_collection(weight, optimizer_name, embedding_lr, device)
        model.item_embedding = LookedUpRows(weight.shape[1])
        plan = construct_module_sharding_plan(
            collection,
            per_param_sharding={TABLE_NAME: row_wise()},
            local_size=self.world_size,
            world_size=self.world_size,
            device_type=device.type,
        )
        self.dmp = DistributedModelParallel(
            _TorchrecSoftmaxModel(collection, _DenseStep(model, self.world_size)),
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            plan=ShardingPlan({"item_collection": plan}),
            device=device,
            sharders=[EmbeddingCollectionSharder()],
        )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.dmp.named_parameters())), lambda ps: torch.optim.Adam(ps, lr=lr)
        )
        self.optimizer = CombinedOptimizer([self.dmp.fused_optimizer, dense])
        self.sparse_dist = TrainPipelineSparseDist(self.dmp, self.optimizer, device)
        self.global_labels = global_labels
        self._phase: Callable[[str], Any] = phase if phase is not None else (lambda name: contextlib.nullcontext())
        self._feed: deque[TorchrecInput] = deque()  # batches handed over, not yet taken by sparse_dist
        self._in_flight: deque[Batch] = deque()  # batches taken, in step order: what each progress() trains on
        self._fed_steps = 0  # steps whose batch was handed over
        self.step = 0

    def _next_input(self):
        """TrainPipelineSparseDist's data iterator: only batches the trainer fetched (it never reads the loader itself).

        A fresh iterator for every progress(): torchrec never calls next() again on an iterator it saw exhausted."""
        while self._feed:
            yield self._feed.popleft()

    def to_device(self, item: LoaderItem) -> LoaderItem:
        """The item as it is: a CPU baseline, its batches are where the model is."""
        return item

    def _feed_new(self, batches: list[Batch]) -> None:
        """Hands TrainPipelineSparseDist the batches it has not had yet, each with its global label count
        (counted now, before it takes them)."""
        for offset, batch in enumerate(batches):
            if self.step + offset >= self._fed_steps:
                if batch.batch_size == 0:
                    raise ValueError(
                        f"mode torchrec: rank {self.rank} got an empty local batch at step {self.step + offset}; "
                        "the model's empty-batch path skips dense parameters that DDP's static graph expects"
                    )
                self._feed.append(TorchrecInput(item_ids_kjt(self.model, batch), batch, self.global_labels(batch)))
                self._in_flight.append(batch)
                self._fed_steps += 1

    def train_on(self, item: LoaderItem, upcoming: Sequence[LoaderItem] = ()) -> StepResult:
        """One ``progress()``: trains on ``item``; ``upcoming`` are the ``lookahead`` items after it (fewer at the
        end), handed to TrainPipelineSparseDist as it needs them."""
        self._feed_new([item.batch, *(u.batch for u in upcoming)])
        t0 = time.perf_counter()
        with self._phase("freescale/torchrec_progress"):
            stats = self.sparse_dist.progress(self._next_input())
        progress_s = time.perf_counter() - t0
        if not self.dmp.module.item_collection.is_pipelined:  # torchrec would only log it and run unpipelined
            raise RuntimeError("mode torchrec: TrainPipelineSparseDist did not pipeline the item collection")
        batch = self._in_flight.popleft()
        self.step += 1
        return step_result(stats, progress_s, batch, self.rank, self.world_size)
