"""The Trainer: reads top-down like a plain training loop.

    train():       fetch batch i+1 (the step's lookahead: one batch; two for the torchrec reference) ->
                   train_step(batch i) -> log -> checkpoint
    train_step():  the step's one call, ``train_on`` (pipelines.api.step.TrainStep: forward_backward, timed as
                   compute; the stage worker starts the batch after next as the backward starts; the dense
                   buckets' all-reduces start as the backward fills them; then the last bucket with the
                   bookkeeping block, every bucket waited for, timed; the optimizer step), with what the job adds
                   coming in through the step's hooks (StepHooks: phases, the early all-reduce, this rank's slot);
                   its typed record (pipelines.job.record.StepRecord) is settled one step later (straggler wait,
                   bubbles)

The step is chosen once, by the builder (pipelines.job.builders.build_step): the API's TrainStep, or in modes
torchrec and torchrec-pec torchrec's own, which implement the same interface; the loop has no mode of its own.

Modes (``--mode``), one harness:
    replicated  data parallel, embedding tables replicated and all-reduced (the foundation's plain loop);
                balanced when ``--partitioner`` is not none
    sync        tables row-wise sharded, blocking ID/embedding/gradient AllToAlls in the step (vanilla TorchRec)
    sdd         sync, with the next batch's ID AllToAll overlapped (TorchRec's TrainPipelineSparseDist)
    semisync    next batch's embeddings prefetched before this step's update: stale rows (TrainPipelineSemiSync)
    freescale   balancer (``--partitioner``, default fbs) + prioritized embedding updates + SM-free transport
    torchrec    the real torchrec DistributedModelParallel + TrainPipelineSparseDist, CPU only: the outside
                reference (pipelines.models.torchrec_ref; the parts its progress() hides are reported as None)
    torchrec-pec  torchrec's prioritized embedding communication (PEC), CPU only (pipelines.models.torchrec_pec;
                its exchanges reported as None too)

Gradient semantics. Local batches may differ in size (the last global batch of an epoch, variable batch size
balancing), so each rank backpropagates the sum of its candidates' BCE divided by the *global* label count,
and the gradients are summed across ranks: exactly the gradient of the global mean loss however the samples
are spread. The sharded tables' gradients come from the same scaled loss, so they follow the same semantics.
The global label count comes free with the balancer's gathered lengths; without the balancer it costs one
tiny all-reduce before the forward (timed as ``label_count``).

The dense all-reduce (pipelines.api.dense_sync) runs in buckets that start while the backward still runs, as DDP's
do; its last bucket carries a bookkeeping block: the label count, the BCE sum and positives (for loss and NE),
and per-rank slots (each rank writes only its own) with tokens, samples, sparsity, and the previous step's compute
and wall times. So per-rank timings reach every rank with no extra collective, and the block needs nothing that
only the device's end of the backward tells: it is launched as soon as the backward is queued (unless
``--tuning.allreduce-start compute``), and a step's record is settled with the other ranks' compute times when the next
step's block arrives, the last step's by one all-reduce after the loop.

Straggler accounting. A rank that finishes forward+backward early idles at the all-reduce until the slowest
rank arrives: wait_r = max_q(compute_q) - compute_r. straggler % = mean_r(wait_r) / step time, the paper's
definition. Bubbles = exposed communication (IDs, embeddings, gradients, balancer waits, label count, the
all-reduce itself net of straggler wait) + straggler wait.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from fscomm.registry import close_named_transports, host_transport
from fscomm.timing import Timer
from fsdata.balance_measures import sparsity
from fsdata.balancer import balancer_stages
from fsdata.id_overflow import IdRangeSource
from fsdata.item import LoaderItem
from fsdata.loader import LoaderConfig, build_loader, release_loader, shutdown_loader
from fsdata.nodes.attention_plan import AttentionPlanStage
from fsdata.nodes.gather_lengths import StepFeedback
from pipelines.api.dense_sync import PER_RANK_FIELDS, DenseSync, gather_per_rank
from pipelines.api.evaluate import evaluate
from pipelines.api.modes import MODES
from pipelines.api.numerics import check_determinism, enable_determinism
from pipelines.api.step import StepHooks, StepResult, unwrap_model
from pipelines.job import checkpoint
from pipelines.job.accounting import StepAccounting
from pipelines.job.aggregates import RunAggregates
from pipelines.job.builders import build_model_spec, build_source, build_step, build_wrap
from pipelines.job.config import JobConfig
from pipelines.job.export import save_export
from pipelines.job.memory_probe import measured_budget
from pipelines.job.progress import paused, progress_bar
from pipelines.job.record import StepRecord
from pipelines.job.schedule import ScheduleProbe

DATA_FAULTS = ("folded_ids", "dropped_bad_samples", "truncated_uih")  # the source's counts the summary always shows
RECENT_STEPS = 256  # the step records a trainer keeps (``history``); the summary's figures are running aggregates


@dataclass
class _Fetched:
    """A loader item on the device, with where the job stood when it was fetched."""

    item: LoaderItem
    new_epoch: bool
    loader_state: dict  # the loader's state from before this batch was fetched: where a resume restarts


class NonFiniteLoss(FloatingPointError):
    """The step's global loss is NaN or infinite. ``root``: this rank's own loss is (the launcher names it)."""

    def __init__(self, message: str, root: bool) -> None:
        super().__init__(message)
        self.root = root


def _unnamed(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


class Trainer:
    config: JobConfig
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dense_sync: Optional[DenseSync]  # the step's all-reduce (None in mode torchrec, where DDP does it)
    step: int

    def __init__(self, config: JobConfig, rank: int, world_size: int, device: torch.device) -> None:
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        if config.run.deterministic:  # before the first cuBLAS call of this process (pipelines.api.numerics)
            enable_determinism()
        # The exposed parts' spans. On a GPU they are measured between events on the compute stream (fscomm.timing):
        # how long the GPU idled for a wait, not how long the host waited. A blocking exchange's host wait also
        # covers the compute queued before it (the gradients it sends are still being computed), which is not
        # communication; the events count only what the GPU spent waiting past its own queued work.
        self.timer = Timer(device)
        # The loader's stages time their waits here when they run in the worker thread: off the critical path,
        # reported beside the exposed parts, never added to them (the training thread's wait is `data`).
        self.worker_timer = Timer("cpu") if config.tuning.background_stages else self.timer
        self.feedback = StepFeedback()
        self._build_data_and_model()
        self.balancer_config = self._balancer_config()  # before the wrap swaps the model's tables
        self.wrap = build_wrap(self.spec, config.run.mode, config.embeddings, config.tuning, self.timer, device)
        # The step's phases, named in a --trace. Only then: each record_function is two profiler ops, each of which
        # gives the GIL away, and the ones between the backward and the next forward sit where the GPU idles.
        self._phase = torch.profiler.record_function if config.run.trace else _unnamed
        # The previous step's wall time and compute time, shared with the other ranks in the next step's block;
        # that step's record waits there (``_unsettled``) for the other ranks' compute times (StepRecord.settle).
        self._last_step_s = self._last_compute_s = 0.0
        self._unsettled: Optional[StepRecord] = None
        # The last step's batch, let go once this step's backward and last bucket are queued, while the host waits for
        # the device: freeing its tensors (on a GPU, an event per stream that used each, under the GIL) then sits
        # neither between two steps nor beside the backward's embedding hooks.
        self._retired: Optional[_Fetched] = None
        self.step_fn = build_step(
            self.spec,
            self.wrap,
            config.run,
            config.embeddings,
            config.tuning,
            self._hooks(),
            self.timer,
            device,
            rank,
            world_size,
        )
        self.optimizer = self.step_fn.optimizer
        self.dense_sync = self.step_fn.dense_sync
        # Batches fetched ahead of the current one: 1 (batch i+1's exchanges start during step i), 2 for torchrec.
        self.lookahead = self.step_fn.lookahead
        self.step = 0
        self.epoch, self.cursor = 0, 0  # global data position of the next step (world-size independent)
        resumed = self._load_checkpoint()
        self._first_step = self.step
        # freescale's embedding schedule per step (pipelines.job.schedule): probed anew from this process's first step
        self.schedule = (
            ScheduleProbe(config.tuning.embedding_schedule, first_step=self.step)
            if MODES[config.run.mode].switches
            else None
        )
        self.loader = self._build_loader(resumed)
        self.accounting = StepAccounting(self.timer, self.loader, self.wrap, device)
        # The latest steps' records (every step's goes to --metrics-jsonl) and the summary's running aggregates:
        # neither grows with the number of steps.
        self.history: deque[dict] = deque(maxlen=RECENT_STEPS)
        self.aggregates = RunAggregates(config.run.steps - self.step, config.run.warmup_steps, world_size, rank)
        self._metrics_file = None

    def _build_data_and_model(self) -> None:
        """The training source, the model spec (the reference model, or a user's --model factory), the held-out
        source, and the model on its device."""
        config = self.config
        self.source = build_source(config.data, config.data.batch_size * self.world_size)
        self.spec = build_model_spec(config, self.source)
        self._order_timestamps(self.source)
        if self.spec.source is not None:  # a user's model may read features of its own from the source
            self.source = self.spec.source(self.source)
        num_items = getattr(getattr(self.spec.model, "config", None), "num_items", None)
        if num_items is not None:
            # Ids past the reference model's item table are an error unless the job or the dataset declares a fold
            # (fsdata.id_overflow).
            self.source = IdRangeSource(self.source, num_items, config.data.id_overflow)
        self.eval_source = self._eval_source(num_items)  # held-out data (--eval-data), read like the training data
        self.evaluations: list[dict] = []
        self.model = self.spec.model.to(self.device)
        if config.run.deterministic:
            check_determinism(self.model, self.device)

    def _order_timestamps(self, source) -> None:
        """A Parquet source's histories out of time order (or with negative times): refused for a model that reads
        time gaps (its class declares ``reads_time_gaps``), unless --unordered-timestamps sorts or drops them;
        counted for any other. Synthetic histories are in order by construction."""
        if not hasattr(source, "set_timestamp_policy"):
            return
        reads_gaps = getattr(self.spec.model, "reads_time_gaps", False)
        source.set_timestamp_policy(self.config.data.unordered_timestamps or ("error" if reads_gaps else "count"))

    def _model_max_uih(self) -> Optional[int]:
        """The model's UIH cap, where it declares one: the memory budget counts the tokens the model keeps."""
        return getattr(getattr(self.spec.model, "config", None), "max_uih", None)

    def _balancer_config(self):
        """The balancer's section; with ``--memory-budget auto``, its memory model measured on this job's model on
        its device (pipelines.job.memory_probe), unless the flag gives the figures."""
        config = self.config.balancer
        if not self.balancing:
            return config
        args = (self.spec, self.source, self.device, self.config.run.precision, self._model_max_uih())
        config, memory = measured_budget(config, *args)
        if memory is not None and self.rank == 0:
            print(
                f"[freescale] --memory-budget auto: {memory.bytes_per_token / 1024:.1f} KiB per kept token + "
                f"{memory.fixed_bytes / 2**30:.2f} GiB, probed on {type(self.spec.model).__name__}"
            )
        return config

    def _hooks(self) -> StepHooks:
        """What the job adds around the one step: its phases in a --trace, the loader's worker started as the
        backward starts, the last batch let go of (and on a GPU the compute stream waited for, so that the compute
        time is the device's) once the backward is queued, this rank's slot of the dense all-reduce's block, and
        the block's bucket launched as soon as the backward is queued unless --tuning.allreduce-start compute."""
        return StepHooks(
            phase=self._phase,
            before_backward=lambda: release_loader(self.loader),
            after_backward=self._after_backward,
            per_rank=self._per_rank_slot,
            early_allreduce=self.config.tuning.allreduce_start == "backward",
        )

    def _after_backward(self) -> None:
        self._retired = None  # see __init__
        if self.device.type == "cuda":  # the compute stream only: not the buckets' all-reduces in flight
            torch.cuda.current_stream(self.device).synchronize()

    def _per_rank_slot(self, item: LoaderItem) -> tuple[float, ...]:
        """This rank's slot of the step's bookkeeping block, in PER_RANK_FIELDS order: its batch's tokens,
        samples and sparsity, and the previous step's compute and wall times."""
        batch = item.batch
        lengths = np.diff(batch.host_offsets("uih_offsets").numpy())  # numpy: no torch op (see dense_sync)
        slot = {
            "last_compute_s": self._last_compute_s,
            "tokens": float(lengths.sum()),
            "samples": float(batch.batch_size),
            "sparsity": sparsity(lengths),
            "last_step_s": self._last_step_s,
        }
        return tuple(slot[name] for name in PER_RANK_FIELDS)

    def _build_loader(self, resumed: Optional[dict]):
        """On a GPU the batches reach the training thread on the device already (copied by the stage worker while
        the previous step computes), or at least pinned, so _fetch only queues their copies. The stage worker starts
        the batch after next as the backward starts (TrainStep.forward_backward releases it), unless the config says
        otherwise."""
        loader_config = replace(
            self.config.loader_config(),
            pin_memory=self.config.tuning.pin_memory or self.device.type == "cuda",
            worker_start=self.config.tuning.worker_start or "backward",
        )
        loader = build_loader(
            self.source,
            loader_config,
            self.rank,
            self.world_size,
            self._loader_stages(),
            start={"epoch": self.epoch, "cursor": self.cursor},
            device=self.device,
        )
        if resumed is not None:
            loader.load_state_dict(resumed)
        return loader

    @property
    def balancing(self) -> bool:
        return MODES[self.config.run.mode].balances and self.config.balancer.partitioner != "none"

    def _loader_stages(self) -> list:
        """The balancer's stages (when balancing), then the ID-prefetch stage (sdd, freescale)."""
        stages = []
        if self.balancing:  # the loader's batches are on the CPU: the host transport carries them
            transport = host_transport("balancer")
            stages += balancer_stages(
                self.balancer_config,
                transport,
                self.rank,
                self.world_size,
                self.config.data.batch_size,
                self.feedback,
                self.worker_timer,
                device=self.device,
                max_uih=self._model_max_uih(),
            )
        if self.wrap is not None:
            stages += self.wrap.id_prefetch_stages(self.rank, self.worker_timer)
        if self.spec.plan is not None and self.device.type == "cuda":
            # The batch's attention plan (block masks) is built a batch ahead with the other stages' host work,
            # and travels to the device with it: the training thread never builds a mask.
            stages.append(lambda node: AttentionPlanStage(node, self.spec.plan))
        return stages

    # ------------------------------------------------------------------ ownership
    def close(self) -> None:
        """Ends what this trainer started: the loader's stage worker, the embedding chains' threads, and the
        process groups (with their exchange threads) made for its stages. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.accounting.close()
        shutdown_loader(self.loader)  # its stage worker and read-ahead threads
        close_named_transports()  # the chains' threads, the named transports and their groups (fscomm.registry)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def train(self) -> Optional[dict]:
        run, ckpt = self.config.run, self.config.checkpoint
        progress = self._progress_bar()
        if self.rank == 0 and run.metrics_jsonl:
            Path(run.metrics_jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = open(run.metrics_jsonl, "w")
        items = iter(self.loader)
        profiler = self._profiler()
        start = time.perf_counter()
        ahead = deque(self._fetch(items) for _ in range(min(self.lookahead, run.steps - self.step)))
        current: Optional[_Fetched] = None
        release_loader(self.loader)  # the first step's next batch need not wait for its backward
        failed = True
        try:
            while self.step < run.steps:
                self.accounting.begin()
                self._retired, current = current, ahead.popleft()
                with self._phase("freescale/data"), self.accounting.fetching():
                    if self.step + self.lookahead < run.steps:
                        ahead.append(self._fetch(items))
                upcoming = ahead[0] if ahead else None
                if self.schedule is not None:
                    self.wrap.set_schedule(self.schedule.schedule_for(self.step))
                record = self.train_step(current, list(ahead))
                self.accounting.finish(record)
                self._last_step_s = record.step_time_s
                if self.schedule is not None:
                    record.schedule = self.wrap.collection.schedule
                record.balance = current.item.report
                self.step += 1
                if current.new_epoch:
                    self.epoch, self.cursor = self.epoch + 1, 0
                self.cursor += sum(record.samples_per_rank)  # a global step consumes exactly its samples
                self._log_settled(record, progress)
                if ckpt.every and self.step % ckpt.every == 0:
                    self.save_checkpoint(upcoming)
                if run.eval_every and self.step % run.eval_every == 0 and self.step < run.steps:
                    with paused(progress):  # the progress rate is training's: evaluation time is left out
                        self.evaluate(progress)
                if profiler is not None:
                    profiler.step()
            if self._checkpointer is not None:  # an async save still in flight completes (and is checked) first
                self._checkpointer.wait()
            if self._unsettled is not None:  # the last step: no later block carries its compute times
                last = gather_per_rank((self._last_compute_s,), self.rank, self.world_size, self.device)[:, 0]
                self._log(self._unsettled.settle(last, self.rank), progress)
                self._unsettled = None
            if self.wrap is not None:
                self.wrap.flush()  # deferred exclusive gradients land before the tables are read
            self._data_counts = self._count_data_faults()
            # every rank's peak memory (one tiny all-reduce): a plan may load one rank more than the others
            peaks = gather_per_rank((float(self._peak_memory()),), self.rank, self.world_size, self.device)
            self._peak_per_rank = [int(v) for v in peaks[:, 0]]
            if self.eval_source is not None:
                with paused(progress):
                    self.evaluate(progress)
            if ckpt.export:  # the user's own modules back, with the trained tables (not in mode torchrec: config.py)
                if self.wrap is not None:
                    unwrap_model(self.model, self.wrap, dst=0)
                if self.rank == 0:  # the state dict, and PATH.json beside it: what built the model (load_export)
                    save_export(self.model, ckpt.export, self.config.model.name)
            failed = False
        finally:
            # the stage worker's item in flight completes on every rank; after a failure the rank ends, and waiting
            # for it would add its collectives' timeout to the one that failed the step
            shutdown_loader(self.loader, abandon=failed)
            self.accounting.close()
            if profiler is not None:
                profiler.stop()
            if progress is not None:
                progress.close()
            if self._metrics_file is not None:
                self._metrics_file.close()
        return self._summary(time.perf_counter() - start) if self.rank == 0 else None

    def _log_settled(self, record: StepRecord, progress) -> None:
        """Logs the step whose record is complete: this one where the step's block carries no compute times (the
        torchrec reference's: nothing to wait for); else the previous one, which this step's block completed with
        every rank's compute time (this one waits for the next block)."""
        if record.last_compute_all_s is None:
            self._log(record.settle(None, self.rank), progress)
            return
        if self._unsettled is not None:
            self._log(self._unsettled.settle(record.last_compute_all_s, self.rank), progress)
        self._unsettled = record

    def _source_stats(self) -> dict:
        """The source's read counts; a user's source (ModelSpec.source) may keep none."""
        return self.source.stats() if hasattr(self.source, "stats") else {}

    def _count_data_faults(self) -> dict[str, int]:
        """The source's read counts summed over every rank (one tiny all-reduce after the loop): samples read,
        ids folded onto the table (id_overflow), samples left out (drop_bad_samples), histories cut to the cap,
        and whatever else the source counts. Every rank's source counts the same names."""
        stats = {k: v for k, v in self._source_stats().items() if isinstance(v, (int, float))}
        for name in DATA_FAULTS:
            stats.setdefault(name, 0)
        names = sorted(stats)
        counts = torch.tensor([float(stats[n]) for n in names], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        out = {n: int(v) for n, v in zip(names, counts.tolist())}
        mine = getattr(self.source, "unordered_samples", None)
        if mine is not None and self.world_size > 1:  # distinct samples: one may reach another rank next epoch
            every: list = [None] * self.world_size
            dist.all_gather_object(every, mine())
            out["unordered_timestamps"] = len(np.unique(np.concatenate(every)))
        return out

    def _fetch(self, items: Iterator) -> _Fetched:
        """The next loader item, its batch and prefetched ids on the device (on a GPU the stage worker copied the
        batch already: fsdata.nodes.device_copy)."""
        new_epoch = False
        loader_state = self.loader.state_dict()
        try:
            item = next(items)
        except StopIteration:  # end of an epoch: every rank reaches it at the same step
            item, new_epoch = next(iter(self.loader)), True
        item = self.step_fn.to_device(item)
        return _Fetched(item, new_epoch, loader_state)

    def train_step(self, fetched: _Fetched, ahead: Sequence[_Fetched]) -> StepRecord:
        """The step's one call on ``fetched`` (``ahead``: the fetched batches after it, the step's lookahead), and
        its record. The record lacks what needs the other ranks' compute times of this step (straggler wait, the
        all-reduce's exposed part): they come in the next step's block (StepRecord.settle); its
        ``last_compute_all_s`` is the previous step's."""
        result = self.step_fn.train_on(fetched.item, *(f.item for f in ahead))
        if result.compute_s is not None:
            self.feedback.report(self.step, result.compute_s)  # read by the balancer's Stage I (autotune, cost fit)
            self._last_compute_s = result.compute_s
        if self.schedule is not None:  # the previous step's time on the slowest rank: the same on every rank
            self.schedule.observe(self.step - 1, float(result.per_rank["last_step_s"].max()))
        self._check_finite(result)
        return StepRecord.of(self.step, result)

    def _check_finite(self, result: StepResult) -> None:
        """Stops the run at a non-finite global loss, on every rank alike (every rank sees the same global sum),
        naming the rank whose own loss was non-finite."""
        if np.isfinite(result.loss_sum):
            return
        local = float(result.local_loss_sum)
        where = (
            f"on rank {self.rank} (its loss sum is {local})"
            if not np.isfinite(local)
            else f"on another rank (rank {self.rank}'s loss sum is finite)"
        )
        raise NonFiniteLoss(
            f"non-finite loss at step {self.step} {where}: the run stops here", root=not np.isfinite(local)
        )

    def _profiler(self):
        """--trace: a torch.profiler window of a few steps after warm-up, one Chrome trace per rank (Perfetto)."""
        path = self.config.run.trace
        if not path:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule

        target = Path(f"{path}.rank{self.rank}.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        steps = self.config.run.steps
        skip = max(
            0, min(self.config.run.warmup_steps - 1, steps - 3)
        )  # past the warm-up, then one profiler warm-up step
        active = max(1, min(5, steps - skip - 2))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        profiler = profile(
            activities=activities,
            schedule=schedule(wait=skip, warmup=1, active=active, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(target)),
        )
        profiler.start()
        return profiler

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, upcoming: Optional[_Fetched]) -> None:
        """``upcoming``: the batch already fetched for the next step (the lookahead): the saved loader state is
        from before it, so the resumed run fetches it again."""
        if self.wrap is not None:
            self.wrap.flush()
        if self._checkpointer is None:
            raise ValueError("save_checkpoint: the job has no --checkpoint-dir")
        self._checkpointer.save(
            self.step,
            self.model,
            self.optimizer,
            loader_state=upcoming.loader_state if upcoming is not None else self.loader.state_dict(),
            cursor={"epoch": self.epoch, "cursor": self.cursor},
        )

    def _load_checkpoint(self) -> Optional[dict]:
        """Restores model, optimizer, step and data position; returns the loader state to restore, if any."""
        cfg = self.config.checkpoint
        # At set-up, on every rank: the checkpointer's process group is made collectively.
        self._checkpointer = (
            checkpoint.Checkpointer(cfg.dir, self.rank, self.world_size, async_save=cfg.async_save)
            if cfg.dir or cfg.resume
            else None
        )
        if not cfg.resume:
            return None
        restored = self._checkpointer.restore(cfg.resume, self.model, self.optimizer)  # returns once all have loaded
        if self.rank == 0:
            incomplete = (
                checkpoint.incomplete_steps(cfg.dir, restored.directory if restored is not None else None)
                if cfg.resume == "latest"
                else []
            )
            if incomplete:  # saves interrupted before their marker: never resumed, said once
                print(f"[freescale] skipped {', '.join(incomplete)} (no {checkpoint.COMPLETE_MARKER}: a save cut off)")
            for skipped in restored.skipped if restored is not None else []:
                print(f"[freescale] skipped {skipped}")
            if restored is not None and restored.unverified:
                print(f"[freescale] {restored.unverified}")
        if restored is None:  # nothing saved yet (first launch of a job that resumes on restart)
            if self.rank == 0:
                print(f"[freescale] no checkpoint in {cfg.dir}, starting at step 0")
            return None
        self.step, self.epoch, self.cursor = restored.step, restored.epoch, restored.cursor
        if self.rank == 0:
            print(
                f"[freescale] resumed from {restored.directory} at step {self.step} (epoch {self.epoch}, sample "
                f"{self.cursor})"
                + (
                    ""
                    if restored.loader_state is not None
                    else f"; loader state rebuilt for world size {self.world_size}"
                )
            )
        return restored.loader_state

    def _peak_memory(self) -> int:
        """This rank's peak: CUDA allocator peak on GPU, the process's peak resident set on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def _kernel_variants(self) -> Optional[dict]:
        """Rank 0's compiled Triton variants per kernel (CUDA only): more than a few per kernel means sizes that
        change per step are compiling new variants mid-run (kernels.triton.common.fixed_code)."""
        if self.device.type != "cuda":
            return None
        from kernels.triton.variants import compiled_variants

        return compiled_variants()

    # ------------------------------------------------------------------ output
    def _eval_source(self, num_items: Optional[int]):
        """The held-out source (``--eval-data``): Parquet at the training data's cap, through the same wrappers as
        the training source (a user's feature reader, the item table's id range); None without one."""
        path = self.config.data.eval_path
        if path is None:
            return None
        from fsdata.parquet import ParquetSource

        source = ParquetSource(
            [Path(path)], uih_cap=self.config.data.uih_cap, drop_bad_samples=self.config.data.drop_bad_samples
        )
        self._order_timestamps(source)
        if self.spec.source is not None:
            source = self.spec.source(source)
        if num_items is not None:
            source = IdRangeSource(source, num_items, self.config.data.id_overflow)
        return source

    def evaluate(self, progress=None) -> dict:
        """One pass over the held-out data (pipelines.api.evaluate: no gradient, tables flushed, every rank's samples
        once); its NE and AUC go to the progress output, the metrics JSONL and the summary."""
        loader = build_loader(
            self.eval_source, LoaderConfig(batch_size=self.config.data.batch_size), self.rank, self.world_size
        )
        try:
            result = evaluate(
                self.model,
                loader,
                wrap=self.wrap,
                inputs=self.spec.inputs,
                device=self.device,
                precision=self.config.run.precision,
                world_size=self.world_size,
            )
        except BaseException:
            shutdown_loader(loader, abandon=True)  # the rank ends: no wait for its item in flight (as in train)
            raise
        shutdown_loader(loader)
        record = {"step": self.step, **result.as_dict()}
        self.evaluations.append(record)
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps({"step": self.step, "eval": result.as_dict()}) + "\n")
            self._metrics_file.flush()
        if self.rank == 0 and self.config.run.progress:
            line = (
                f"step {self.step}: held-out NE {result.ne:.4f}, AUC {result.auc:.4f} "
                f"({result.samples} samples, {self.config.data.eval_path})"
            )
            (progress.write if progress is not None else print)(line)
        return record

    def _progress_bar(self):
        if self.rank != 0 or not self.config.run.progress:
            return None
        return progress_bar(self.config.run.steps, self.step, f"train {self.config.run.mode} ({self.world_size} ranks)")

    def _log(self, record: StepRecord, progress) -> None:
        line = record.as_dict()
        self.history.append(line)
        self.aggregates.add(line)
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps(line) + "\n")
            self._metrics_file.flush()
        if progress is not None:
            straggler = record.straggler_pct
            progress.set_postfix(
                loss=f"{record.loss:.4f}", straggler="n/m" if straggler is None else f"{straggler:.1f}%"
            )
            progress.update(1)

    def _summary(self, wall: float) -> dict:
        """Rank 0's run summary: the steps' running aggregates (pipelines.job.aggregates) and the run's own figures;
        its size does not grow with the number of steps."""
        steps = self.aggregates.summary()
        return {
            "mode": self.config.run.mode,
            "steps": steps.pop("steps"),
            "world_size": self.world_size,
            "wall_s": wall,
            **steps,
            "embedding_schedule": self.schedule.summary() if self.schedule is not None else None,
            # held-out evaluations (--eval-data): one per --eval-every steps and one at the end, the last here too
            "eval": self.evaluations,
            "eval_ne": self.evaluations[-1]["ne"] if self.evaluations else None,
            "eval_auc": self.evaluations[-1]["auc"] if self.evaluations else None,
            "peak_memory_bytes": self._peak_memory(),  # rank 0's
            "peak_memory_bytes_per_rank": getattr(self, "_peak_per_rank", None),
            "kernel_variants": self._kernel_variants(),
            "timing": self.timer.summary(),
            "loader_worker_timing": self.worker_timer.summary() if self.worker_timer is not self.timer else None,
            "source": self.source.describe(),
            # every rank's reads summed: samples read, folded ids, dropped samples, cut UIHs, ...
            "data_counts": getattr(self, "_data_counts", None),
            "first_step": self._first_step,  # this process's first step: after a resume, the step it resumed at
            "last_step": self.step,
            "config": self.config.to_dict(),
        }
