"""The partitioner's inputs and output: gathered lengths (Algorithm 1, Stages I and II), runtime info R, the plan.

A partitioner is a pure function ``(GatheredLengths, RuntimeInfo) -> Plan``. Every rank holds the same gathered
lengths and the same (itself gathered) runtime info, so every rank computes the same plan without talking to the
others. Plans are computed on the CPU in numpy: they are small (one int per sample) and sorting there is cheaper
than launching device kernels for a few thousand elements.

Global sample index ``g``: samples numbered in source-rank order, i.e. source rank ``r`` held global samples
``rank_offsets[r]:rank_offsets[r+1]`` in its local order. The plan speaks only in these indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[int]]


class PartitionerError(ValueError):
    """A partitioner failed at a step, or the ranks' plans for a step differ; the message names the partitioner
    (``module:function``, a class, or a built-in's name) and the step."""

    root = True  # this rank is where the fault happened (the launcher names it: pipelines.job.launch.failure)


class PeerPartitionerError(PartitionerError):
    """The partitioner failed on another rank at this step: this rank stops with it, but is not its cause."""

    root = False


def as_numpy(values: ArrayLike, dtype, name: str) -> np.ndarray:
    """A 1-D numpy view (zero-copy for CPU tensors) of ``values``; ValueError naming ``name`` if not 1-D."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    out = np.asarray(values, dtype=dtype)
    if out.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(out.shape)}")
    return out


def _int64_tensor(values: ArrayLike) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64)
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


@dataclass
class GatheredLengths:
    """What Stages I and II of Algorithm 1 gathered: the lengths of every sample of one global step.

    All tensors are int64 on the CPU (converted on construction), indexed by global sample index ``g``.
    """

    uih_lengths: torch.Tensor  # [G] UIH length of every sample
    num_candidates: torch.Tensor  # [G] number of candidates of every sample
    candidate_lengths: torch.Tensor  # [sum(num_candidates)] content length of every candidate, sample-major
    sample_ids: torch.Tensor  # [G] globally unique sample ids (the tie-breaker of every sort)
    rank_offsets: torch.Tensor  # [W+1] source rank r held samples rank_offsets[r]:rank_offsets[r+1]
    world_size: int

    def __post_init__(self) -> None:
        for name in ("uih_lengths", "num_candidates", "candidate_lengths", "sample_ids", "rank_offsets"):
            setattr(self, name, _int64_tensor(getattr(self, name)))
            if getattr(self, name).dim() != 1:
                raise ValueError(f"GatheredLengths.{name} must be 1-D, got shape {tuple(getattr(self, name).shape)}")
        w = int(self.world_size)
        if w < 1:
            raise ValueError(f"GatheredLengths.world_size must be >= 1, got {self.world_size}")
        self.world_size = w
        g = self.uih_lengths.numel()
        if self.rank_offsets.numel() != w + 1:
            raise ValueError(f"rank_offsets has {self.rank_offsets.numel()} entries, expected world_size+1 = {w + 1}")
        offs = self.rank_offsets
        if int(offs[0]) != 0 or int(offs[-1]) != g or bool((offs[1:] < offs[:-1]).any()):
            raise ValueError(f"rank_offsets must rise from 0 to G={g}, got {offs.tolist()[:8]}...")
        for name in ("num_candidates", "sample_ids"):
            if getattr(self, name).numel() != g:
                raise ValueError(f"{name} has {getattr(self, name).numel()} entries, expected G={g} (one per sample)")
        total_candidates = int(self.num_candidates.sum())
        if self.candidate_lengths.numel() != total_candidates:
            raise ValueError(
                f"candidate_lengths has {self.candidate_lengths.numel()} entries, expected sum(num_candidates)="
                f"{total_candidates}"
            )
        for name in ("uih_lengths", "num_candidates", "candidate_lengths"):
            values = getattr(self, name)
            if values.numel() and int(values.min()) < 0:
                bad = int(torch.nonzero(values < 0)[0])
                raise ValueError(f"{name}[{bad}] = {int(values[bad])} is negative")

    @property
    def num_samples(self) -> int:
        return int(self.uih_lengths.numel())

    def source_counts(self) -> torch.Tensor:
        """[W] number of samples each source rank held."""
        return self.rank_offsets[1:] - self.rank_offsets[:-1]

    def content_lengths_per_sample(self) -> np.ndarray:
        """[G] total content length of each sample's candidates (segment sum of candidate_lengths)."""
        cand = self.candidate_lengths.numpy()
        prefix = np.zeros(cand.size + 1, dtype=np.int64)
        np.cumsum(cand, out=prefix[1:])
        ends = np.cumsum(self.num_candidates.numpy())
        starts = ends - self.num_candidates.numpy()
        return prefix[ends] - prefix[starts]

    @classmethod
    def from_rank_lengths(
        cls,
        per_rank_uih_lengths: Sequence[ArrayLike],
        per_rank_num_candidates: Optional[Sequence[ArrayLike]] = None,
        candidate_lengths: Optional[ArrayLike] = None,
        sample_ids: Optional[ArrayLike] = None,
    ) -> "GatheredLengths":
        """Builds the gathered view from each rank's local lengths (tests, the simulator).

        Missing candidates default to none per sample; missing sample ids to the global index.
        """
        uih = [as_numpy(x, np.int64, f"rank {r} uih_lengths") for r, x in enumerate(per_rank_uih_lengths)]
        counts = np.array([x.size for x in uih], dtype=np.int64)
        offsets = np.zeros(len(uih) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        all_uih = np.concatenate(uih) if uih else np.zeros(0, np.int64)
        num_cands = np.zeros_like(all_uih)
        if per_rank_num_candidates is not None and len(per_rank_num_candidates):
            parts = [as_numpy(x, np.int64, f"rank {r} num_candidates") for r, x in enumerate(per_rank_num_candidates)]
            num_cands = np.concatenate(parts)
        if candidate_lengths is None:
            candidate_lengths = np.ones(int(num_cands.sum()), dtype=np.int64)
        ids = np.arange(all_uih.size, dtype=np.int64) if sample_ids is None else sample_ids
        return cls(all_uih, num_cands, candidate_lengths, ids, offsets, len(uih))


@dataclass
class RuntimeInfo:
    """Runtime execution-time info R of Algorithm 1, identical on every rank (it is gathered, never local).

    Under the loader's lookahead the plan of step ``step`` is computed while step ``step - 2`` runs, so the
    newest measurement it can see is of step ``step - 2`` or older: ``measured_step`` says which.
    """

    step: int = 0  # global step whose batch is being planned
    measured_step: int = -1  # global step that step_times measure; -1: nothing measured yet
    step_times: Optional[torch.Tensor] = None  # float64 [W] gathered per-rank compute time of measured_step (s)
    budget_shares: Optional[torch.Tensor] = None  # float64 [W] VBS autotune: share of total weight per rank
    cost_coefficients: Optional[torch.Tensor] = None  # float64 [4] fitted (a, b, c, d) of cost.OnlineCostFit
    # the most kept tokens any rank may hold this step (budget.py), the same on every rank; None: no budget
    memory_budget: Optional["PlanCheck"] = None  # a fsdata.partition.budget.MemoryBudget
    extra: dict = field(default_factory=dict)  # for custom partitioners; must be identical on every rank

    def shares(self, world_size: int) -> np.ndarray:
        """Per-rank weight shares (summing to 1): autotune's when present, equal otherwise."""
        if self.budget_shares is None:
            return np.full(world_size, 1.0 / world_size)
        shares = as_numpy(self.budget_shares, np.float64, "RuntimeInfo.budget_shares")
        if shares.size != world_size:
            raise ValueError(f"RuntimeInfo.budget_shares has {shares.size} entries for world_size {world_size}")
        if not np.all(np.isfinite(shares)) or shares.min() < 0 or shares.sum() <= 0:
            raise ValueError(f"RuntimeInfo.budget_shares must be finite, >= 0 and not all 0, got {shares[:8]}...")
        return shares / shares.sum()


@dataclass
class Plan:
    """Destination rank r receives global samples ``order[dest_offsets[r]:dest_offsets[r+1]]``, in that order.

    The built-in partitioners list each rank's samples in ascending global index, i.e. grouped by source rank
    in rank order: that is the order in which an AllToAll delivers them, so the receiver needs no permute.
    """

    order: torch.Tensor  # int64 [G]
    dest_offsets: torch.Tensor  # int64 [W+1]

    def __post_init__(self) -> None:
        self.order = _int64_tensor(self.order)
        self.dest_offsets = _int64_tensor(self.dest_offsets)

    @property
    def world_size(self) -> int:
        return int(self.dest_offsets.numel()) - 1

    def counts(self) -> torch.Tensor:
        """[W] number of samples each destination rank receives."""
        return self.dest_offsets[1:] - self.dest_offsets[:-1]

    def destinations(self) -> torch.Tensor:
        """[G] destination rank of every global sample."""
        dest = np.empty(self.order.numel(), dtype=np.int64)  # numpy: a CPU scatter there is ~5x torch's
        dest[self.order.numpy()] = np.repeat(np.arange(self.world_size, dtype=np.int64), self.counts().numpy())
        return torch.from_numpy(dest)

    def rank_samples(self, rank: int) -> torch.Tensor:
        return self.order[int(self.dest_offsets[rank]) : int(self.dest_offsets[rank + 1])]

    def validate(
        self,
        num_samples: int,
        world_size: Optional[int] = None,
        who: str = "plan",
        lengths: Optional[GatheredLengths] = None,
        budget: Optional["PlanCheck"] = None,
    ) -> None:
        """Raises ValueError unless every one of ``num_samples`` samples goes to exactly one rank and, given the
        step's ``lengths`` and a ``budget``, no rank holds more tokens than it (the message names the rank)."""
        order, offs = self.order, self.dest_offsets
        if order.dim() != 1 or offs.dim() != 1 or offs.numel() < 2:
            raise ValueError(f"{who}: order must be 1-D and dest_offsets 1-D with >= 2 entries")
        if world_size is not None and offs.numel() != world_size + 1:
            raise ValueError(
                f"{who}: dest_offsets has {offs.numel()} entries, expected world_size+1 = {world_size + 1}"
            )
        if int(offs[0]) != 0 or int(offs[-1]) != order.numel() or bool((offs[1:] < offs[:-1]).any()):
            raise ValueError(f"{who}: dest_offsets must rise from 0 to len(order)={order.numel()}, got {offs.tolist()}")
        if order.numel() != num_samples:
            raise ValueError(f"{who}: order has {order.numel()} entries for {num_samples} samples")
        if num_samples and (int(order.min()) < 0 or int(order.max()) >= num_samples):
            raise ValueError(f"{who}: order holds indices outside [0, {num_samples})")
        seen = torch.bincount(order, minlength=num_samples)
        if bool((seen != 1).any()):
            missing = torch.nonzero(seen == 0).flatten()[:5].tolist()
            repeated = torch.nonzero(seen > 1).flatten()[:5].tolist()
            raise ValueError(f"{who}: order is not a permutation (missing {missing}, repeated {repeated})")
        if budget is not None and lengths is not None:
            budget.check_plan(lengths, self, who)

    @classmethod
    def from_destinations(cls, dest: ArrayLike, world_size: int) -> "Plan":
        """The plan that sends global sample g to ``dest[g]``, each rank's samples in ascending global index."""
        d = as_numpy(dest, np.int64, "destinations")
        if d.size and (d.min() < 0 or d.max() >= world_size):
            bad = int(np.nonzero((d < 0) | (d >= world_size))[0][0])
            raise ValueError(f"destination of sample {bad} is {int(d[bad])}, outside [0, {world_size})")
        # a stable sort of small integers: numpy radix-sorts 16-bit keys (a few times faster than int64's merge)
        order = np.argsort(d.astype(np.int16) if world_size <= np.iinfo(np.int16).max else d, kind="stable")
        offsets = np.zeros(world_size + 1, dtype=np.int64)
        np.cumsum(np.bincount(d, minlength=world_size), out=offsets[1:])
        return cls(torch.from_numpy(order.astype(np.int64)), torch.from_numpy(offsets))

    @classmethod
    def identity(cls, lengths: GatheredLengths) -> "Plan":
        return cls(torch.arange(lengths.num_samples, dtype=torch.int64), lengths.rank_offsets.clone())

    def is_identity(self, lengths: GatheredLengths) -> bool:
        """True when every sample stays on its source rank, in its local order (nothing to exchange)."""
        return torch.equal(self.dest_offsets, lengths.rank_offsets) and torch.equal(
            self.order, torch.arange(lengths.num_samples, dtype=torch.int64)
        )


class PlanCheck(Protocol):
    """A constraint a plan must meet beyond exactly-once (fsdata.partition.budget.MemoryBudget: tokens per rank);
    defined here so that the plan needs no import of the constraints built on it."""

    def check_plan(self, lengths: GatheredLengths, plan: "Plan", who: str = "plan") -> None: ...


@runtime_checkable
class Partitioner(Protocol):
    """A pure, deterministic map from one step's gathered lengths (and R) to a plan."""

    def __call__(self, lengths: GatheredLengths, runtime: RuntimeInfo) -> Plan: ...


def cost_sort_order(costs: np.ndarray, lengths: GatheredLengths) -> np.ndarray:
    """Global indices sorted by cost, largest first; ties by sample id, then global index.

    The order of ``np.lexsort((sample_ids, -costs))`` (15-20 ms at 1,024 ranks x 128 samples), in 2-5 ms: a stable
    radix sort by cost (ties in index order), then the tied runs re-sorted by sample id only where their ids are
    not already ascending. Costs nearly always rise with the sample's length (UIH plus candidates), so the lengths
    are sorted first, in one 16-bit radix pass; that order is kept when the costs agree with it (never rising
    along it, and tied only where the lengths tie), else the costs' float bits are sorted in four passes.
    """
    ids = lengths.sample_ids.numpy()
    if costs.size < 2 or not bool((costs >= 0).all()):  # NaN or negative: the float bits would not order them
        return np.lexsort((ids, -costs))
    order = _length_order(costs, lengths)
    if order is None:
        order = stable_radix_order(~(costs + 0.0).view(np.uint64))  # + 0.0: -0.0 as 0.0; ~: descending
    if bool((ids[1:] >= ids[:-1]).all()):  # ids in index order: ties are already in id order
        return order
    sorted_costs, sorted_ids = costs[order], ids[order]
    tied = sorted_costs[1:] == sorted_costs[:-1]  # tied[i]: sorted positions i and i+1 cost the same
    unsorted = tied & (sorted_ids[1:] < sorted_ids[:-1])
    if not unsorted.any():
        return order
    run = np.zeros(order.size, dtype=np.int64)  # the run of equal costs each sorted position belongs to
    np.cumsum(~tied, out=run[1:])
    positions = np.nonzero(np.isin(run, run[1:][unsorted]))[0]
    order[positions] = order[positions[np.lexsort((sorted_ids[positions], run[positions]))]]
    return order


def _length_order(costs: np.ndarray, lengths: GatheredLengths) -> Optional[np.ndarray]:
    """The stable longest-first order of the samples' lengths if it is the stable descending order of ``costs``
    (the costs never rise along it, and two neighbours cost the same only where their lengths are the same),
    else None."""
    tokens = lengths.uih_lengths.numpy() + lengths.num_candidates.numpy()
    top = int(tokens.max())
    if top < 2**16:
        order = np.argsort((top - tokens).astype(np.uint16), kind="stable")
    else:
        order = stable_radix_order((top - tokens).astype(np.uint64))
    sorted_costs = costs[order]
    if not bool((sorted_costs[1:] <= sorted_costs[:-1]).all()):
        return None
    sorted_tokens = tokens[order]
    if bool(((sorted_costs[1:] == sorted_costs[:-1]) & (sorted_tokens[1:] != sorted_tokens[:-1])).any()):
        return None
    return order


def stable_radix_order(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` of uint64 keys, as LSD radix passes over 16-bit digits (numpy radix-sorts
    16-bit keys; its stable sort of 64-bit ones is a merge sort, 3-4x slower). A digit equal in every key is
    skipped."""
    digits = key.astype("<u8", copy=False).view("<u2").reshape(-1, 4)  # column 0: the least significant digit
    order = None
    for column in range(4):
        digit = digits[:, column]
        if digit.min() == digit.max():
            continue
        order = np.argsort(digit, kind="stable") if order is None else order[np.argsort(digit[order], kind="stable")]
    return np.arange(key.size) if order is None else order
