"""The per-rank memory budget: the most kept tokens one rank may hold in a step, the same number on every rank.

A rank's activation memory grows with its tokens (every linear layer keeps ``[tokens, d]`` activations for the
backward), its step time with its attention work (about ``sum L^2``). A partitioner that balances only the
second can concentrate the first: VBS gives the rank of the shortest samples the most of them. The budget caps
the first while the partitioners balance the second as well as they can under it.

Tokens of a sample: ``min(uih_length, max_uih) + num_candidates + per_sample_tokens``, what the model keeps of
it (``max_uih`` None: the gathered UIH length, which the source has already cut at its own cap).

Guarantee (tested): with ``S`` the step's total tokens, ``W`` ranks and ``t_max`` the largest sample's tokens,
every built-in partitioner meets any budget ``>= S / W + t_max`` (:func:`guaranteed_tokens`). FBS and KK give
each rank one sample of every round of ``W`` consecutive samples in token order; such a rank holds at most
``t_max`` plus, per later round, the smallest sample of the round before, which is at most that round's mean:
``t_max + S / W`` in all. VBS's capped deal puts a sample only on a rank with room for it; if no rank had room,
every rank would hold more than ``budget - t_max >= S / W`` tokens, more than ``S`` in all.

The spelling of ``--memory-budget`` (:class:`BudgetSpec`): a token count (``600000``), ``Nx`` (``1.05x``: N
times the step's mean tokens per rank, a cap on memory imbalance rather than on memory), or ``auto`` (a token
count from the device's free memory through :class:`MemoryModel`, the least over the ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import numpy as np

from fsdata.partition.base import GatheredLengths, Plan

if TYPE_CHECKING:
    from fsdata.batch import Batch

FLAG = "--memory-budget"


def kept_tokens(
    lengths: Union[GatheredLengths, "Batch"], max_uih: Optional[int] = None, per_sample_tokens: int = 0
) -> np.ndarray:
    """[G] int64 tokens each sample puts on the rank that holds it: of a step's gathered lengths, or of one batch
    (the memory probe counts its probe batches so, as the budget counts them)."""
    uih = lengths.uih_lengths.numpy()
    if max_uih is not None:
        uih = np.minimum(uih, max_uih)
    return uih + lengths.num_candidates.numpy() + int(per_sample_tokens)


def guaranteed_tokens(tokens: np.ndarray, world_size: int) -> int:
    """The least budget every built-in partitioner is guaranteed to meet: ``ceil(S / W) + t_max``."""
    if tokens.size == 0:
        return 0
    return int(-(-int(tokens.sum()) // world_size) + int(tokens.max()))


@dataclass(frozen=True)
class MemoryBudget:
    """One step's budget: no rank may hold more than ``tokens`` kept tokens (``RuntimeInfo.memory_budget``)."""

    tokens: int
    max_uih: Optional[int] = None
    per_sample_tokens: int = 0

    def __post_init__(self) -> None:
        if int(self.tokens) < 1:
            raise ValueError(f"MemoryBudget.tokens must be >= 1, got {self.tokens}")
        if self.max_uih is not None and int(self.max_uih) < 0:
            raise ValueError(f"MemoryBudget.max_uih must be >= 0, got {self.max_uih}")
        if int(self.per_sample_tokens) < 0:
            raise ValueError(f"MemoryBudget.per_sample_tokens must be >= 0, got {self.per_sample_tokens}")

    def sample_tokens(self, lengths: GatheredLengths) -> np.ndarray:
        return kept_tokens(lengths, self.max_uih, self.per_sample_tokens)

    def rank_tokens(self, lengths: GatheredLengths, plan: Plan) -> np.ndarray:
        """[W] int64 tokens each rank holds under ``plan``."""
        dest = plan.destinations().numpy()
        return np.bincount(dest, weights=self.sample_tokens(lengths), minlength=plan.world_size).astype(np.int64)

    def check_fits(self, lengths: GatheredLengths, who: str = "memory budget") -> None:
        """ValueError when no plan can meet the budget: one sample over it, or the batch over the world's."""
        tokens = self.sample_tokens(lengths)
        if tokens.size and int(tokens.max()) > self.tokens:
            g = int(np.argmax(tokens))
            source = int(np.searchsorted(lengths.rank_offsets.numpy(), g, side="right")) - 1
            raise ValueError(
                f"{who}: sample {int(lengths.sample_ids[g])} (source rank {source}) keeps {int(tokens[g])} tokens, over"
                f" the budget of {self.tokens} per rank ({FLAG}); no rank can hold it, lower the source's UIH cap or"
                " raise the budget"
            )
        total, world = int(tokens.sum()), lengths.world_size
        if total > world * self.tokens:
            raise ValueError(
                f"{who}: the global batch keeps {total} tokens, over the world's budget of {world} ranks x"
                f" {self.tokens} = {world * self.tokens} ({FLAG}); raise the budget to at least"
                f" {guaranteed_tokens(tokens, world)} (guaranteed) or shrink the batch"
            )

    def check_plan(self, lengths: GatheredLengths, plan: Plan, who: str = "plan") -> None:
        """ValueError naming the first rank over the budget, its tokens and samples."""
        held = self.rank_tokens(lengths, plan)
        over = np.nonzero(held > self.tokens)[0]
        if over.size:
            r = int(over[0])
            raise ValueError(
                f"{who}: rank {r} holds {int(held[r])} tokens in {int(plan.counts()[r])} samples, over the memory"
                f" budget of {self.tokens} per rank ({FLAG}; {over.size} rank(s) over, mean {held.mean():.0f})"
            )


@dataclass(frozen=True)
class MemoryModel:
    """Peak activation bytes of a step against its tokens, ``bytes_per_token * tokens + fixed_bytes``, and the
    share of free memory left unused (``headroom``: fragmentation, the allocator's rounding, the lookahead's
    extra batch).

    The defaults are the replay's memory probe (benchmarks/replay.py: peak allocated bytes of one and of
    four copies of a 21,000-event sample, through the two points) on an H200, bf16, jagged attention (varlen), model
    preset
    ``replay`` (d=256, 2 layers, 4 heads): 12.9 KiB per token and 0.83 GiB fixed (docs/bench/replay_h200_jagged.json).
    ``freescale train`` probes the job's own model instead (pipelines/job/memory_probe.py); figures given as
    ``auto:bytes_per_token=...,fixed_bytes=...,headroom=...`` replace the probe.
    """

    bytes_per_token: float = 13214.0
    fixed_bytes: float = 890_257_920.0
    headroom: float = 0.10

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bytes_per_token) and self.bytes_per_token > 0):
            raise ValueError(f"MemoryModel.bytes_per_token must be > 0, got {self.bytes_per_token} ({FLAG} auto:...)")
        if not (math.isfinite(self.fixed_bytes) and self.fixed_bytes >= 0):
            raise ValueError(f"MemoryModel.fixed_bytes must be >= 0, got {self.fixed_bytes} ({FLAG} auto:...)")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"MemoryModel.headroom must be in [0, 1), got {self.headroom} ({FLAG} auto:...)")

    def tokens_for(self, free_bytes: float) -> int:
        """The most tokens whose predicted peak fits ``(1 - headroom) * free_bytes``."""
        usable = (1.0 - self.headroom) * float(free_bytes) - self.fixed_bytes
        if usable < self.bytes_per_token:
            raise ValueError(
                f"{FLAG} auto: {free_bytes / 2**30:.2f} GiB free leave no room for one token (model: "
                f"{self.bytes_per_token:.0f} B/token + {self.fixed_bytes / 2**30:.2f} GiB,"
                f" headroom {self.headroom:.0%})"
            )
        return int(usable // self.bytes_per_token)


def device_free_bytes(device=None) -> float:
    """Bytes this process can still allocate on its CUDA device: the driver's free memory plus what torch's
    caching allocator holds unused (it reuses those before asking the driver)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{FLAG} auto needs a CUDA device (torch.cuda.mem_get_info); on CPU give a token count or Nx")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{FLAG} auto needs a CUDA device, this rank trains on {device}; give a token count or Nx")
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class BudgetSpec:
    """What ``--memory-budget`` says; exactly one of ``tokens``, ``factor``, ``auto`` is set."""

    tokens: Optional[int] = None
    factor: Optional[float] = None
    auto: Optional[MemoryModel] = None
    max_uih: Optional[int] = None
    per_sample_tokens: int = 0

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.tokens, self.factor, self.auto)) != 1:
            raise ValueError(f"{FLAG}: give exactly one of a token count, Nx or auto")
        if self.tokens is not None and int(self.tokens) < 1:
            raise ValueError(f"{FLAG} must be >= 1 token, got {self.tokens}")
        if self.factor is not None and not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"{FLAG} {self.factor}x: the factor must be >= 1 (no plan holds less than the mean)")

    @classmethod
    def parse(cls, value: Union[None, str, int, float], max_uih: Optional[int] = None) -> Optional["BudgetSpec"]:
        """``None``/``""`` (no budget), ``600000``, ``"1.05x"``, ``"auto"`` or ``"auto:bytes_per_token=B,..."``."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, bool):
            raise ValueError(f"{FLAG} must be a token count, Nx or auto, got {value!r}")
        if isinstance(value, (int, float)):
            if not math.isfinite(value) or float(value) != int(value):
                raise ValueError(f"{FLAG} must be a whole number of tokens, got {value!r}")
            return cls(tokens=int(value), max_uih=max_uih)
        text = value.strip().lower()
        try:
            if text == "auto" or text.startswith("auto:"):
                options = {}
                for part in filter(None, text[5:].split(",")):
                    key, _, number = part.partition("=")
                    if key.strip() not in {f.name for f in fields(MemoryModel)}:
                        raise ValueError(f"unknown key {key.strip()!r} (bytes_per_token, fixed_bytes, headroom)")
                    options[key.strip()] = float(number)
                return cls(auto=MemoryModel(**options), max_uih=max_uih)
            if text.endswith("x"):
                return cls(factor=float(text[:-1]), max_uih=max_uih)
            number = float(text)
            if number != int(number):
                raise ValueError("not a whole number of tokens")
            return cls(tokens=int(number), max_uih=max_uih)
        except (ValueError, OverflowError) as error:
            if str(error).startswith(FLAG):
                raise
            raise ValueError(
                f"{FLAG} must be a token count, Nx or auto[:key=value,...], got {value!r}: {error}"
            ) from None

    def rank_limit(self, device=None) -> tuple[int, float]:
        """What this rank sends in Stage I: ``(tokens, factor)``, the unused one 0. ``auto`` measures the device
        here, once: call it before the first step, when the model is on the device but no activation is."""
        if self.auto is not None:
            return self.auto.tokens_for(device_free_bytes(device)), 0.0
        return int(self.tokens or 0), float(self.factor or 0.0)

    def for_step(self, lengths: GatheredLengths, tokens: int = 0, factor: float = 0.0) -> MemoryBudget:
        """The step's budget from the least ``(tokens, factor)`` the ranks sent (or this spec's own)."""
        if not tokens and not factor:
            tokens, factor = int(self.tokens or 0), float(self.factor or 0.0)
        if not tokens:
            held = kept_tokens(lengths, self.max_uih, self.per_sample_tokens)
            tokens = max(1, math.ceil(factor * int(held.sum()) / lengths.world_size))  # 1x must fit
        return MemoryBudget(int(tokens), self.max_uih, self.per_sample_tokens)

    def __str__(self) -> str:
        if self.auto is not None:
            return "auto"
        return f"{self.factor:g}x" if self.factor is not None else str(self.tokens)


# ---------------------------------------------------------------------------------------------- meeting it
def repair(
    dest: np.ndarray,
    tokens: np.ndarray,
    limit: int,
    world_size: int,
    equal_counts: bool,
    max_moves: Optional[int] = None,
) -> np.ndarray:
    """Moves (VBS) or swaps (FBS, KK: counts kept) samples from the rank of most tokens to the rank of fewest until
    no rank is over ``limit`` or nothing helps; returns the new destinations (checked by the caller).

    For budgets below the guaranteed bound, where the partitioner's own plan may not fit; it looks at tokens only.
    """
    dest = dest.copy()
    held = np.bincount(dest, weights=tokens, minlength=world_size).astype(np.int64)
    for _ in range(max_moves or 4 * world_size):
        r, s = int(np.argmax(held)), int(np.argmin(held))
        excess, room = held[r] - limit, limit - held[s]
        if excess <= 0 or room <= 0:
            break
        mine = np.nonzero(dest == r)[0]
        if equal_counts:
            theirs = np.nonzero(dest == s)[0]
            delta = (tokens[mine][:, None] - tokens[theirs][None, :]).ravel()
        else:
            delta = tokens[mine]
        ok = (delta > 0) & (delta <= room)
        if not ok.any():
            break
        enough = ok & (delta >= excess)
        pick = (
            int(np.argmin(np.where(enough, delta, np.iinfo(np.int64).max)))
            if enough.any()
            else int(np.argmax(np.where(ok, delta, -1)))
        )
        if equal_counts:
            i, j = mine[pick // theirs.size], theirs[pick % theirs.size]
            dest[i], dest[j] = s, r
        else:
            dest[mine[pick]] = s
        held[r] -= delta[pick]
        held[s] += delta[pick]
    return dest


def fits(dest: np.ndarray, tokens: np.ndarray, limit: int, world_size: int) -> bool:
    return bool(np.bincount(dest, weights=tokens, minlength=world_size).max(initial=0) <= limit)


def token_sort_order(tokens: np.ndarray, costs: np.ndarray, lengths: GatheredLengths) -> np.ndarray:
    """Global indices by tokens, largest first; ties by cost (largest first), then sample id, then index."""
    return np.lexsort((lengths.sample_ids.numpy(), -costs, -tokens))


def honour(
    dest: np.ndarray,
    lengths: GatheredLengths,
    budget: Optional[MemoryBudget],
    costs: np.ndarray,
    alternatives: Sequence[Callable[[np.ndarray], Optional[np.ndarray]]],
    equal_counts: bool,
    who: str,
) -> np.ndarray:
    """``dest`` if it meets ``budget``; else the first of ``alternatives(tokens)`` that does; else a token repair
    of the last one tried; else a ValueError with the figures. A budget that no plan can meet fails first."""
    if budget is None:
        return dest
    tokens = budget.sample_tokens(lengths)
    world, limit = lengths.world_size, budget.tokens
    if fits(dest, tokens, limit, world):
        return dest
    budget.check_fits(lengths, who)
    last = dest
    for alternative in alternatives:
        candidate = alternative(tokens)
        if candidate is not None:
            if fits(candidate, tokens, limit, world):
                return candidate
            last = candidate
    fixed = repair(last, tokens, limit, world, equal_counts)
    if fits(fixed, tokens, limit, world):
        return fixed
    most = int(np.bincount(fixed, weights=tokens, minlength=world).max())
    raise ValueError(
        f"{who}: found no plan within the memory budget of {limit} tokens per rank ({FLAG}; best found holds {most});"
        f" budgets >= {guaranteed_tokens(tokens, world)} (mean + largest sample) are always met"
    )
