"""The Trainer: reads top-down like a plain training loop.

    train():  for each step: batch = next(loader) (timed: data wait) -> train_step(batch) -> log -> progress
    train_step():  forward_backward (timed: compute) -> sync (one all-reduce, timed) -> optimizer step

Gradient semantics. Local batches may differ in size (the last global batch of an epoch, and later variable
batch size balancing), so each rank backpropagates the *sum* of its candidates' BCE, and the gradients are
summed across ranks and divided by the global label count: exactly the gradient of the global mean loss,
however the samples are spread over ranks.

The one all-reduce of a step carries, after the flat gradients, a bookkeeping block: the label count, the BCE
sum and positives (for loss and NE), and per-rank slots (each rank writes only its own) with compute time,
tokens, samples and sparsity. So per-rank timings reach every rank with no extra collective.

Straggler accounting. A rank that finishes forward+backward early idles at the all-reduce until the slowest
rank arrives: wait_r = max_q(compute_q) - compute_r. straggler % = mean_r(wait_r) / step time, the paper's
definition (the mean idle wait across ranks relative to the iteration's duration).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fscomm import get_transport
from fscomm.groups import new_stage_group
from fscomm.timing import Timer
from fsdata.balancer import balancer_stages
from fsdata.nodes.gather_lengths import StepFeedback
from fsdata.batch import Batch
from fsdata.metrics import sparsity
from fsdata.loader import build_loader
from pipelines import checkpoint
from pipelines.builders import build_model, build_source
from pipelines.config import JobConfig
from pipelines.model import bce_sum, normalized_entropy

# Bookkeeping block of the step all-reduce: global scalars, then PER_RANK_FIELDS slots per rank.
_GLOBAL_FIELDS = ("labels", "bce_sum", "positives")
PER_RANK_FIELDS = ("compute_s", "tokens", "samples", "sparsity")


class Trainer:
    config: JobConfig
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int

    def __init__(self, config: JobConfig, rank: int, world_size: int, device: torch.device) -> None:
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.timer = Timer("cpu")  # host wall clock of the step's parts (the step synchronises on CUDA anyway)
        self.source = build_source(config.data, config.loader.batch_size * world_size)
        self.feedback = StepFeedback()
        self.model = build_model(config.model, self.source, seed=config.train.seed).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.train.lr)
        self.step = 0
        self.epoch, self.cursor = 0, 0  # global data position of the next step (world-size independent)
        resumed = self._load_checkpoint()
        self.loader = build_loader(
            self.source, config.loader, rank, world_size, self._balancer_stages(),
            start={"epoch": self.epoch, "cursor": self.cursor},
        )
        if resumed is not None:
            self.loader.load_state_dict(resumed)
        self.history: list[dict] = []
        self._metrics_file = None

    def _balancer_stages(self) -> list:
        if self.config.balancer.partitioner == "none":
            return []
        transport = get_transport(self.config.train.transport, group=new_stage_group("balancer"))
        capacity = self.config.loader.batch_size
        return balancer_stages(
            self.config.balancer, transport, self.rank, self.world_size, capacity, self.feedback, self.timer
        )

    # ------------------------------------------------------------------ the loop
    def train(self) -> Optional[dict]:
        cfg = self.config.train
        progress = self._progress_bar()
        if self.rank == 0 and cfg.metrics_jsonl:
            Path(cfg.metrics_jsonl).parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = open(cfg.metrics_jsonl, "w")
        batches = iter(self.loader)
        start = time.perf_counter()
        try:
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                batch, balance = self._next_batch(batches)
                data_wait = time.perf_counter() - t0
                record = self.train_step(batch.to(self.device, non_blocking=True))
                record["data_wait_s"] = data_wait
                if balance is not None:
                    record["balance"] = balance
                self.timer.add("data_wait", data_wait)
                record["step_time_s"] = time.perf_counter() - t0
                self.step += 1
                self._advance_cursor(batch_samples=sum(record["samples_per_rank"]))
                self._log(record, progress)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            if progress is not None:
                progress.close()
            if self._metrics_file is not None:
                self._metrics_file.close()
        return self._summary(time.perf_counter() - start) if self.rank == 0 else None

    def _next_batch(self, batches) -> tuple[Batch, Optional[dict]]:
        """The next local batch, and the balancer's metrics of its step when balancing is on."""
        try:
            item = next(batches)
        except StopIteration:  # end of an epoch: every rank reaches it at the same step
            item = next(iter(self.loader))
            self.epoch, self.cursor = self.epoch + 1, 0
        return item if isinstance(item, tuple) else (item, None)

    def forward_backward(self, batch: Batch) -> tuple[float, float, float]:
        """Backward of the local BCE *sum*; returns (label count, BCE sum, positives)."""
        labels = batch.candidate_labels
        if labels.numel() == 0:  # an empty local batch contributes nothing but still joins the all-reduce
            return 0.0, 0.0, 0.0
        loss = bce_sum(self.model(batch), labels)
        loss.backward()
        return float(labels.numel()), float(loss.detach()), float(labels.sum())

    def train_step(self, batch: Batch) -> dict:
        # Every parameter gets a gradient buffer, even one this rank's batch did not touch (an empty batch):
        # the flat all-reduce must have the same layout on every rank.
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        t0 = time.perf_counter()
        labels, bce, positives = self.forward_backward(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compute = time.perf_counter() - t0
        lengths = batch.uih_lengths.cpu()
        mine = (compute, float(lengths.sum()), float(batch.batch_size), sparsity(lengths))
        t1 = time.perf_counter()
        book = self._sync(labels, bce, positives, mine)
        sync_time = time.perf_counter() - t1
        self.feedback.report(self.step, compute)  # read by the balancer's Stage I (autotune, cost fit)
        self.timer.add("forward_backward", compute)
        self.timer.add("dense_allreduce", sync_time)
        self.optimizer.step()
        per_rank = book[len(_GLOBAL_FIELDS):].view(self.world_size, len(PER_RANK_FIELDS))
        compute_all = per_rank[:, 0]
        wait = compute_all.max() - compute_all
        step_time = compute + sync_time  # = slowest rank's compute + the exchange itself, on every rank
        return {
            "step": self.step,
            "loss": float(book[1] / book[0]) if book[0] > 0 else float("nan"),
            "labels": float(book[0]),
            "bce_sum": float(book[1]),
            "positives": float(book[2]),
            "compute_s": compute_all.tolist(),
            "tokens_per_rank": per_rank[:, 1].long().tolist(),
            "samples_per_rank": per_rank[:, 2].long().tolist(),
            "sparsity_per_rank": per_rank[:, 3].tolist(),
            "imbalance_max_over_mean": float(per_rank[:, 1].max() / per_rank[:, 1].mean().clamp(min=1)),
            "allreduce_s": sync_time,
            "straggler_wait_s": float(wait.mean()),
            "straggler_pct": 100.0 * float(wait.mean()) / max(step_time, 1e-9),
        }

    def _sync(self, labels: float, bce: float, positives: float, mine: tuple) -> torch.Tensor:
        """One SUM all-reduce of [flat gradients | bookkeeping]; grads become the global-mean gradient."""
        params = list(self.model.parameters())
        book = torch.zeros(len(_GLOBAL_FIELDS) + self.world_size * len(PER_RANK_FIELDS), dtype=torch.float64)
        book[:3] = torch.tensor([labels, bce, positives], dtype=torch.float64)
        slot = len(_GLOBAL_FIELDS) + self.rank * len(PER_RANK_FIELDS)
        book[slot : slot + len(PER_RANK_FIELDS)] = torch.tensor(mine, dtype=torch.float64)
        flat = torch.cat([p.grad.reshape(-1).float() for p in params] + [book.to(self.device, torch.float32)])
        # float64 bookkeeping travels as float32 in the buffer: exact for counts below 2^24 per step.
        dist.all_reduce(flat)
        total_labels = float(flat[-book.numel()])
        scale = 1.0 / total_labels if total_labels > 0 else 0.0
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad) * scale)
            offset += n
        return flat[offset:].double().cpu()

    # ------------------------------------------------------------------ checkpoints
    def _advance_cursor(self, batch_samples: int) -> None:
        self.cursor += batch_samples  # every global step consumes exactly its samples, whatever the balancing

    def save_checkpoint(self) -> None:
        checkpoint.save(
            self.config.train.checkpoint_dir,
            self.step,
            self.rank,
            self.world_size,
            {
                checkpoint.MODEL_KEY: self.model.state_dict(),
                checkpoint.OPTIMIZER_KEY: self.optimizer.state_dict(),
                checkpoint.LOADER_KEY: self.loader.state_dict(),
                checkpoint.CURSOR_KEY: {"epoch": self.epoch, "cursor": self.cursor},
            },
        )

    def _load_checkpoint(self) -> Optional[dict]:
        """Restores model, optimizer, step and data position; returns the loader state to restore, if any."""
        resume = self.config.train.resume
        if not resume:
            return None
        directory = checkpoint.latest(self.config.train.checkpoint_dir) if resume == "latest" else Path(resume)
        if directory is None:  # nothing saved yet (first launch of a job that resumes on restart)
            return None
        payload, same_world = checkpoint.load(directory, self.rank, self.world_size)
        self.model.load_state_dict(payload[checkpoint.MODEL_KEY])
        self.optimizer.load_state_dict(payload[checkpoint.OPTIMIZER_KEY])
        self.step = int(payload[checkpoint.STEP_KEY])
        position = payload[checkpoint.CURSOR_KEY]
        self.epoch, self.cursor = int(position["epoch"]), int(position["cursor"])
        if self.rank == 0:
            print(f"[freescale] resumed from {directory} at step {self.step} (epoch {self.epoch}, sample {self.cursor})"
                  + ("" if same_world else f"; loader state rebuilt for world size {self.world_size}"))
        return payload[checkpoint.LOADER_KEY] if same_world else None

    # ------------------------------------------------------------------ output
    def _progress_bar(self):
        if self.rank != 0 or not self.config.train.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.config.train.steps, desc=f"train ({self.world_size} ranks)", unit="step")

    def _log(self, record: dict, progress) -> None:
        self.history.append(record)
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps(record) + "\n")
            self._metrics_file.flush()
        if progress is not None:
            progress.set_postfix(loss=f"{record['loss']:.4f}", straggler=f"{record['straggler_pct']:.1f}%")
            progress.update(1)

    def _summary(self, wall: float) -> dict:
        h = self.history
        samples = sum(sum(r["samples_per_rank"]) for r in h)
        tail = h[len(h) // 2 :] or h
        labels = sum(r["labels"] for r in tail)
        timed = h[1:] or h  # the first step pays for warm-up
        step_times = [r["step_time_s"] for r in timed]
        return {
            "steps": len(h),
            "world_size": self.world_size,
            "samples": samples,
            "wall_s": wall,
            "samples_per_s": sum(sum(r["samples_per_rank"]) for r in timed) / max(sum(step_times), 1e-9),
            "loss": (sum(r["bce_sum"] for r in tail) / labels) if labels else float("nan"),
            "loss_first_step": h[0]["loss"] if h else float("nan"),
            "ne": normalized_entropy(sum(r["bce_sum"] for r in tail), sum(r["positives"] for r in tail), labels),
            "straggler_pct": sum(r["straggler_pct"] for r in timed) / max(len(timed), 1),
            "step_time_s": sum(step_times) / max(len(step_times), 1),
            "per_rank_compute_s": [
                sum(r["compute_s"][q] for r in timed) / max(len(timed), 1) for q in range(self.world_size)
            ],
            "timing": self.timer.summary(),
            "source": self.source.describe(),
            "config": self.config.to_dict(),
        }
