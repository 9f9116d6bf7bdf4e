"""The Trainer: reads top-down like a plain training loop.

    train():       fetch batch i+1 (the step's lookahead: one batch; two for the torchrec baseline) ->
                   train_step(batch i) -> log -> checkpoint
    train_step():  the step's one call, ``train_on`` (pipelines.api.step.TrainStep, or in modes torchrec and
                   torchrec-pec torchrec's own behind the same interface, chosen once by
                   pipelines.job.builders.build_step), with what the job adds coming in through the step's hooks
                   (StepHooks: phases, the early all-reduce, this rank's slot of the bookkeeping block); its typed
                   record (pipelines.job.run.record) is settled one step later, when the next step's block brings
                   every rank's compute time (straggler wait, bubbles)

Gradient semantics: each rank backpropagates the sum of its candidates' BCE divided by the *global* label count and
the gradients are summed across ranks, so however the balancer spreads the samples the step's gradient is the
global mean loss's (pipelines.api.step).

What is not the loop lives with its owner: the data, the model and the loader are built by pipelines.job.data, the
checkpoints are pipelines.job.checkpoint.job's (the trainer is Stateful: ``state_dict`` gathers its parts, and a
checkpoint takes the trainer whole) and the export pipelines.job.checkpoint.export's, the held-out evaluation, the
trace window, the step's log, the run's totals and its summary are pipelines.job.run's; the trainer only says when.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import torch

from fscomm.registry import close_named_transports
from fscomm.timing import Timer
from fsdata.loader import release_loader, shutdown_loader
from fsdata.nodes.gather_lengths import StepFeedback
from pipelines.api.dense_sync import DenseSync
from pipelines.api.modes import MODES
from pipelines.api.numerics import enable_determinism
from pipelines.api.step import StepHooks
from pipelines.job import data
from pipelines.job.builders import build_step, build_wrap
from pipelines.job.checkpoint.export import export_trained
from pipelines.job.checkpoint.job import LOADER, MODEL, OPTIMIZER, POSITION, STEP, JobCheckpoints
from pipelines.job.config import JobConfig
from pipelines.job.run import summary
from pipelines.job.run.accounting import StepAccounting
from pipelines.job.run.aggregates import RunAggregates
from pipelines.job.run.evaluation import HeldOut
from pipelines.job.run.progress import paused
from pipelines.job.run.record import StepRecord
from pipelines.job.run.schedule_probe import ScheduleProbe
from pipelines.job.run.step_log import check_finite, log_record, log_settled, rank_slot, run_outputs, settle_last
from pipelines.models.step_protocol import Lookahead

RECENT_STEPS = 256  # the step records a trainer keeps (``history``); the summary's figures are running aggregates


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
        # how long the GPU idled for a wait, not how long the host waited, past its own queued work.
        self.timer = Timer(device)
        # The loader's stages time their waits here when they run in the worker thread: off the critical path,
        # reported beside the exposed parts, never added to them (the training thread's wait is `data`).
        self.worker_timer = Timer("cpu") if config.loader.background_stages else self.timer
        self.feedback = StepFeedback()
        job = data.build_data_and_model(config, world_size, device)
        self.source, self.spec, self.model, self.eval_source = job.source, job.spec, job.model, job.eval_source
        self.held_out = HeldOut.of(job.eval_source, config, rank, world_size)  # None without --eval-data
        # before the wrap swaps the model's tables
        balancer = data.build_balancer_config(config.balancer, config.run, job, device, rank)
        self.wrap = build_wrap(self.spec, config.run.mode, config.embeddings, self.timer, device)
        self._stages = data.LoaderStages.of(
            config.run, balancer, self.wrap, self.spec, self.feedback, self.worker_timer
        )
        # The step's phases, named in a --trace. Only then: each record_function is two profiler ops, each of which
        # gives the GIL away, and the ones between the backward and the next forward sit where the GPU idles.
        self._phase = torch.profiler.record_function if config.run.trace else contextlib.nullcontext
        # The previous step's wall time and compute time, shared with the other ranks in the next step's block;
        # that step's record waits there (``_unsettled``) for the other ranks' compute times (StepRecord.settle).
        self._last_step_s = self._last_compute_s = 0.0
        self._unsettled: Optional[StepRecord] = None
        # The last step's batch, let go once this step's backward and last bucket are queued, while the host waits for
        # the device: freeing its tensors (on a GPU, an event per stream that used each, under the GIL) then sits
        # neither between two steps nor beside the backward's embedding hooks.
        self._retired: Optional[data.Fetched] = None
        sections = (config.run, config.embeddings, config.dense_sync)
        self.step_fn = build_step(self.spec, self.wrap, *sections, self._hooks(), self.timer, device, rank, world_size)
        self.optimizer = self.step_fn.optimizer
        self.dense_sync = self.step_fn.dense_sync
        # Batches fetched ahead of the current one: 1 (batch i+1's exchanges start during step i), 2 for torchrec.
        self.lookahead = self.step_fn.lookahead
        self.step = 0
        self.epoch, self.cursor = 0, 0  # global data position of the next step (world-size independent)
        self.loader = None
        self._next_loader_state: Optional[dict] = None  # see save_checkpoint
        self._checkpointer = JobCheckpoints(config.checkpoint, rank, world_size)
        if not self._checkpointer.resume(self):
            self.loader = self._build_loader(None)
        self.first_step = self.step
        # freescale's embedding schedule per step (pipelines.job.run.schedule_probe): probed anew from this process's
        # 1st step
        self.schedule_probe = (
            ScheduleProbe(config.embeddings.schedule, first_step=self.step) if MODES[config.run.mode].switches else None
        )
        self.accounting = StepAccounting(self.timer, self.loader, self.wrap, device)
        # The latest steps' records (every step's goes to --metrics-jsonl) and the summary's running aggregates:
        # neither grows with the number of steps.
        self.history: deque[dict] = deque(maxlen=RECENT_STEPS)
        self.aggregates = RunAggregates(config.run.steps - self.step, config.run.warmup_steps, world_size, rank)
        self._metrics_file = None

    def _build_loader(self, state: Optional[dict]):
        """The loader from the job's data position (and, on a resume at the same world size, its saved state)."""
        stages = data.loader_stages(
            self._stages, self.rank, self.world_size, self.config.loader.batch_size, self.device
        )
        position = {"epoch": self.epoch, "cursor": self.cursor}
        args = (self.source, self.config.loader, stages, self.rank, self.world_size, position, state, self.device)
        return data.build_job_loader(*args)

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict:
        """The job's parts by their checkpoint keys (pipelines.job.checkpoint.job): the model and the optimizer
        themselves, the steps done, the data position, and the loader's state the next step starts from."""
        loader = self._next_loader_state
        if loader is None and self.loader is not None:
            loader = self.loader.state_dict()
        position = {"epoch": self.epoch, "cursor": self.cursor}
        return {MODEL: self.model, OPTIMIZER: self.optimizer, STEP: self.step, POSITION: position, LOADER: loader}

    def load_state_dict(self, state: dict) -> None:
        """Restores the steps done and the data position, and builds the loader from them (from its saved state
        where there is one); the model and the optimizer are loaded in place through :meth:`state_dict`'s."""
        self.step = int(state[STEP])
        self.epoch, self.cursor = int(state[POSITION]["epoch"]), int(state[POSITION]["cursor"])
        if self.loader is not None:
            shutdown_loader(self.loader)
        self.loader = self._build_loader(state.get(LOADER))

    def save_checkpoint(self, upcoming: Optional[data.Fetched]) -> None:
        """``upcoming``: the batch already fetched for the next step (the lookahead): the saved loader state is
        from before it, so the resumed run fetches it again."""
        if self.wrap is not None:
            self.wrap.flush()
        self._next_loader_state = upcoming.loader_state if upcoming is not None else None
        try:
            self._checkpointer.save(self)
        finally:
            self._next_loader_state = None

    # ------------------------------------------------------------------ the step's hooks
    def _hooks(self) -> StepHooks:
        """What the job adds around the one step: its phases in a --trace, the loader's worker started as the
        backward starts, the last batch let go of (and on a GPU the compute stream waited for, so that the compute
        time is the device's) once the backward is queued, this rank's slot of the dense all-reduce's block, and
        the block's bucket launched as soon as the backward is queued unless --dense-sync.allreduce-start compute."""
        return StepHooks(
            phase=self._phase,
            before_backward=lambda: release_loader(self.loader),
            after_backward=self._after_backward,
            per_rank=lambda item: rank_slot(item, self._last_compute_s, self._last_step_s),
            early_allreduce=self.config.dense_sync.allreduce_start == "backward",
        )

    def _after_backward(self) -> None:
        self._retired = None  # see __init__
        if self.device.type == "cuda":  # the compute stream only: not the buckets' all-reduces in flight
            torch.cuda.current_stream(self.device).synchronize()

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
        """The steps from this process's first to ``--steps``, then the run's end (:meth:`_finish`); rank 0's run
        summary (None on the other ranks)."""
        run = self.config.run
        outputs = run_outputs(run, self.rank, self.step, self.world_size, self.device)
        with outputs as (progress, self._metrics_file, profiler):
            items = iter(self.loader)
            start = time.perf_counter()
            # the step's one lookahead loop, fed by this job's fetch (epochs, loader state) within the steps left
            fetch = partial(data.fetch, self.loader, self.step_fn.to_device)
            fetched = Lookahead(fetch, self.lookahead, limit=run.steps - self.step)
            fetched.fill(items)
            release_loader(self.loader)  # the first step's next batch need not wait for its backward
            failed = True
            try:
                self._loop(fetched, items, progress, profiler)
                totals = self._finish(progress)
                failed = False
            finally:
                # the stage worker's item in flight completes on every rank; after a failure the rank ends, and
                # waiting for it would add its collectives' timeout to the one that failed the step
                shutdown_loader(self.loader, abandon=failed)
                self.accounting.close()
        return summary.run_summary(self, time.perf_counter() - start, totals) if self.rank == 0 else None

    def _loop(self, fetched: Lookahead, items: Iterator, progress, profiler) -> None:
        run, ckpt = self.config.run, self.config.checkpoint
        current: Optional[data.Fetched] = None
        while self.step < run.steps:
            self.accounting.begin()
            self._retired = current
            current, ahead = fetched.advance(items, fetching=self._fetching)
            upcoming = ahead[0] if ahead else None
            if self.schedule_probe is not None:
                self.wrap.set_schedule(self.schedule_probe.schedule_for(self.step))
            record = self.train_step(current, ahead)
            self.accounting.finish(record)
            self._last_step_s = record.step_time_s
            if self.schedule_probe is not None:
                record.schedule = self.wrap.collection.schedule
            record.balance = current.item.report
            self.step += 1
            if current.new_epoch:
                self.epoch, self.cursor = self.epoch + 1, 0
            self.cursor += sum(record.samples_per_rank)  # a global step consumes exactly its samples
            self._unsettled = log_settled(record, self._unsettled, self.rank, self._logger(progress))
            if ckpt.every and self.step % ckpt.every == 0:
                self.save_checkpoint(upcoming)
            if run.eval_every and self.step % run.eval_every == 0 and self.step < run.steps:
                self.evaluate(progress)
            if profiler is not None:
                profiler.step()

    def _finish(self, progress) -> dict:
        """The run's end, on every rank in this order (each part's collectives meet the other ranks'); returns the
        run's totals (pipelines.job.run.summary.run_totals)."""
        self._checkpointer.wait()  # an async save still in flight completes (and is checked) first
        settle_last(
            self._unsettled, self._last_compute_s, self.rank, self.world_size, self.device, self._logger(progress)
        )
        self._unsettled = None
        if self.wrap is not None:
            self.wrap.flush()  # deferred exclusive gradients land before the tables are read
        totals = summary.run_totals(self.source, self.rank, self.world_size, self.device)
        if self.held_out is not None:
            self.evaluate(progress)
        export_trained(self.model, self.wrap, self.config.checkpoint.export, self.config.model.name, self.rank)
        return totals

    @contextlib.contextmanager
    def _fetching(self) -> Iterator[None]:
        """Around the loop's fetch of the step's next lookahead batch: its trace phase and its timing."""
        with self._phase("freescale/data"), self.accounting.fetching():
            yield

    def train_step(self, fetched: data.Fetched, ahead: Sequence[data.Fetched]) -> StepRecord:
        """The step's one call on ``fetched`` (``ahead``: the fetched batches after it, the step's lookahead), and
        its record. The record lacks what needs the other ranks' compute times of this step (straggler wait, the
        all-reduce's exposed part): they come in the next step's block (StepRecord.settle); its
        ``last_compute_all_s`` is the previous step's."""
        result = self.step_fn.train_on(fetched.item, [f.item for f in ahead])
        if result.compute_s is not None:
            self.feedback.report(self.step, result.compute_s)  # read by the balancer's Stage I (autotune, cost fit)
            self._last_compute_s = result.compute_s
        if self.schedule_probe is not None:  # the previous step's time on the slowest rank: the same on every rank
            self.schedule_probe.observe(self.step - 1, float(result.per_rank["last_step_s"].max()))
        check_finite(result, self.step, self.rank)
        return StepRecord.of(self.step, result)

    def _logger(self, progress) -> Callable[[StepRecord], None]:
        """A settled record's way to the history, the aggregates, the metrics file and ``progress``."""
        return lambda record: log_record(record, self.history, self.aggregates, self._metrics_file, progress)

    def evaluate(self, progress=None) -> dict:
        """One pass over the held-out data (pipelines.job.run.evaluation); the progress rate is training's, so its
        time is left out of ``progress``."""
        args = (self.step, self.model, self.wrap, self.spec.inputs, self.device, self.config.run.precision)
        with paused(progress):
            return self.held_out.evaluate(*args, self._metrics_file, progress, show=self.config.run.progress)
