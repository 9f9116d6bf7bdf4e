"""A synthetic sample source: heavy-tailed UIH lengths and a direct knob for the embedding-row collision rate.

Every value is a pure function of ``(seed, epoch, global index)`` computed by a counter-based hash
(splitmix64), never by a stateful generator, so ``read(epoch, a, c)`` equals ``read(epoch, a, b)`` followed by
``read(epoch, b, c)`` for any split, on any number of ranks, in any order.

Collision knob. Consecutive global batches (blocks of ``collision_block_size`` samples, which should equal the
global batch size B*W) share a fraction ``collision_rate`` of their embedding rows, counted on unique ids:
``|rows(k) & rows(k+1)| / |rows(k+1)|``. That is independent of how often a row repeats inside a batch, which
is what the paper's prioritized updates care about: only shared rows have to wait (section 2.3). The
construction:

* Every id drawn in block k (UIH items and candidate content ids; one vocabulary, one table) gets a *rank*
  in ``[0, n)``, where ``n`` (unique rows per block) = ``unique_fraction`` x the expected draws of a block,
  at most ``vocab_size // 2``. Draw positions of a block are permuted by an affine bijection; the first ``n``
  positions of that permutation take ranks ``0..n-1`` exactly once (so every rank occurs), the rest draw a
  Zipf-distributed rank (the within-batch duplicates; the popular rank is scattered by a second affine map).
* Rank r of block k is row slot ``start_k + r'`` of an endless line of slots, with windows
  ``start_k = floor(k * (1 - p) * n)``: consecutive windows overlap in exactly ``p * n`` slots.
* Slots map to ids by an affine bijection of ``Z_vocab``, so distinct slots of two neighbouring windows are
  distinct ids (that is why ``n <= vocab_size / 2``).

Hence the realised rate is ``p`` up to rounding, whatever the Zipf exponent or ``unique_fraction``; it drifts
only when a block draws fewer than ``n`` ids (tiny blocks). Non-neighbouring blocks share ``max(0, 1 - j(1-p))``
of their rows (temporal locality). Which rows are hot changes from block to block: there is no global hot set
(it would make ``p = 0`` impossible).

Labels. A fraction ``copy_fraction`` of candidates is an item taken from the sample's own UIH; a candidate's
label is Bernoulli(sigmoid(copy_weight * copied + dense . w_t + label_bias)), so both the sequence part
(target attention can find the item in the history) and the dense part of a model have something to learn.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from fsdata.batch import Batch

_U64 = np.uint64
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SLOT_MULT = 2654435761  # a prime: slot -> id is a bijection of Z_vocab when vocab_size is not a multiple of it
_PRIMES = (1_000_003, 999_983, 1_000_033, 999_979, 1_000_037)

# hash streams (one per independent quantity)
_S_LEN, _S_LEN2, _S_NCAND, _S_USER, _S_TIME, _S_DENSE, _S_DENSE2 = range(1, 8)
_S_CLEN, _S_COPY, _S_COPYPOS, _S_LABEL, _S_DRAW, _S_EPOCH, _S_BLOCK, _S_W = range(8, 16)
_CALIBRATION_EPOCH = -1  # skeletons of this pseudo-epoch estimate the draws per sample


def _mix_int(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _key(*parts: int) -> int:
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix_int(h ^ _mix_int(p + _GOLDEN))
    return h


def _hash(key: int, counters: np.ndarray) -> np.ndarray:
    """splitmix64 of ``key + counter * golden``: independent 64-bit words, vectorized, wrap-around uint64."""
    x = counters.astype(_U64) * _U64(_GOLDEN)
    x += _U64(key)
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def _uniform(key: int, counters: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1)."""
    return ((_hash(key, counters) >> _U64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _normal(key1: int, key2: int, counters: np.ndarray) -> np.ndarray:
    u1, u2 = _uniform(key1, counters), _uniform(key2, counters)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _coprime(modulus: int, salt: int) -> int:
    """A multiplier coprime to ``modulus`` (affine bijection of Z_modulus), varied by ``salt``."""
    for i in range(len(_PRIMES)):
        a = _PRIMES[(salt + i) % len(_PRIMES)]
        if modulus % a:
            return a % modulus if modulus > 1 else 1
    return 1


def _geometric(u: np.ndarray, mean: float) -> np.ndarray:
    """Geometric counts >= 0 with the given mean, by inversion of uniforms ``u``."""
    if mean <= 0:
        return np.zeros(u.shape, dtype=np.int64)
    return np.floor(-np.log(u) / math.log1p(1.0 / mean)).astype(np.int64)


def segment_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for every (s, l), without a Python loop."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts.astype(np.int64) - seg_starts, lengths) + np.arange(total, dtype=np.int64)


@dataclass
class SyntheticConfig:
    """What the generator draws. Lengths are lognormal: ``uih_min + LogNormal(ln(uih_median - uih_min), uih_sigma)``
    clipped at ``uih_max`` (the raw dataset's longest history) and then cut to ``uih_cap`` (the model's limit)."""

    num_samples: int = 100_000
    """Samples per epoch."""
    seed: int = 0
    uih_median: float = 12.0
    """Median raw UIH length."""
    uih_sigma: float = 0.6
    """Shape of the lognormal (sigma of log length)."""
    uih_min: int = 1
    uih_max: Optional[int] = 64
    """Clip of the raw length (None: no clip)."""
    uih_cap: int = 21_000
    """Longest UIH served; longer ones keep their most recent items and are counted (``stats()['truncated_uih']``)."""
    num_candidates_mean: float = 2.0
    num_candidates_max: int = 4
    content_length_mean: float = 1.5
    """Mean ids per candidate (the candidate item plus its content ids); >= 1."""
    content_length_max: int = 3
    vocab_size: int = 10_000
    """Ids are in [0, vocab_size); one vocabulary for UIH items and candidate content ids."""
    zipf_exponent: float = 1.05
    """Skew of within-batch popularity (duplicates); does not change the collision rate."""
    unique_fraction: float = 0.5
    """Unique rows per block / expected ids drawn per block (capped so that rows <= vocab_size / 2)."""
    collision_rate: float = 0.05
    """Fraction of a global batch's unique rows that the previous global batch also used."""
    collision_block_size: int = 128
    """Samples per global batch for the collision knob: set it to the global batch size (B x world_size)."""
    num_users: int = 1_000
    num_action_types: int = 4
    mean_gap_s: float = 600.0
    """Mean seconds between consecutive UIH events (timestamps strictly increase)."""
    side_features: bool = True
    """Emit uih_action_types and uih_timestamps."""
    num_labels: int = 1
    dense_dim: int = 4
    copy_fraction: float = 0.3
    """Share of candidates copied from the sample's own UIH (the learnable signal)."""
    copy_weight: float = 3.0
    label_bias: float = -1.5
    dense_weight: float = 1.0
    id_overflow: Optional[str] = None
    """How ids beyond a model's item table map to rows (fsdata.id_overflow): presets whose vocabulary is larger
    than the built-in models' tables declare ``modulo``; None leaves it to the job (an error by default)."""

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "SyntheticConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown synthetic preset {name!r}; choose from {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise ValueError(f"unknown SyntheticConfig fields {sorted(unknown)}")
        return cls(**{**PRESETS[name], **overrides})

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"SyntheticConfig: {what}")

        need(self.num_samples >= 0, f"num_samples must be >= 0, got {self.num_samples}")
        need(0.0 <= self.collision_rate <= 1.0, f"collision_rate must be in [0, 1], got {self.collision_rate}")
        need(self.collision_block_size >= 1, f"collision_block_size must be >= 1, got {self.collision_block_size}")
        need(
            1 <= self.uih_min <= self.uih_median,
            f"need 1 <= uih_min <= uih_median, got {self.uih_min}, {self.uih_median}",
        )
        need(self.uih_cap >= 1, f"uih_cap must be >= 1, got {self.uih_cap}")
        need(self.uih_max is None or self.uih_max >= self.uih_min, "uih_max must be >= uih_min")
        need(self.uih_sigma >= 0, "uih_sigma must be >= 0")
        need(
            1 <= self.num_candidates_mean <= self.num_candidates_max <= 65_536,
            "need 1 <= num_candidates_mean <= num_candidates_max <= 65536",
        )
        need(
            1 <= self.content_length_mean <= self.content_length_max,
            "need 1 <= content_length_mean <= content_length_max",
        )
        need(2 <= self.vocab_size <= 2**31, f"vocab_size must be in [2, 2^31], got {self.vocab_size}")
        need(self.vocab_size % _SLOT_MULT != 0, "vocab_size must not be a multiple of 2654435761")
        need(0.0 < self.unique_fraction <= 1.0, "unique_fraction must be in (0, 1]")
        need(self.zipf_exponent > 0, "zipf_exponent must be > 0")
        need(self.num_users >= 1 and self.num_action_types >= 1, "num_users and num_action_types must be >= 1")
        need(
            1 <= self.num_labels <= 64 and 0 <= self.dense_dim <= 4096,
            "need 1 <= num_labels <= 64, 0 <= dense_dim <= 4096",
        )
        need(0.0 <= self.copy_fraction <= 1.0, "copy_fraction must be in [0, 1]")
        need(self.mean_gap_s >= 0, "mean_gap_s must be >= 0")


def _lognormal_sigma(median: float, mean: float) -> float:
    return math.sqrt(2.0 * math.log(mean / median))


_KUAIRAND_1K: dict[str, Any] = dict(
    uih_median=3379.0,
    uih_sigma=_lognormal_sigma(3379.0, 5038.0),
    uih_max=49_332,
    num_candidates_mean=8.0,
    num_candidates_max=32,
    content_length_mean=3.0,
    content_length_max=8,
    vocab_size=4_000_000,
    id_overflow="modulo",
    num_users=1_000,
    num_action_types=8,
    dense_dim=8,
    num_labels=2,
)

PRESETS: dict[str, dict[str, Any]] = {
    # CI: short histories, small vocabulary, a handful of candidates.
    "tiny": dict(),
    # KuaiRand-1K as published: median 3,379, mean 5,038, max 49,332 events per user. A lognormal with that
    # median and mean has sigma = sqrt(2 ln(5038/3379)); the tail is clipped at the published max.
    "kuairand-1k": _KUAIRAND_1K,
    # KuaiRand-27K as published: median 8,591, mean 11,796, max 228,000 events per user; the same lognormal fit
    # (sigma = sqrt(2 ln(11796/8591)), about 0.80), the tail clipped at the published max. Served at the default
    # uih_cap of 21,000, the production model's max_uih (the length the paper's production setting trains on and
    # the longest case of `python -m benchmarks attention`): the lognormal puts about 13% of users above it, whose
    # most recent 21,000 events are kept; uncapped, one 228,000-event history would cost as much attention as
    # about 120 median ones, more than any one rank's step can hold at B=128.
    "kuairand-27k": dict(
        _KUAIRAND_1K,
        uih_median=8591.0,
        uih_sigma=_lognormal_sigma(8591.0, 11796.0),
        uih_max=228_000,
        uih_cap=21_000,
        num_users=27_000,
    ),
    # MovieLens-20M as published: mean 144 ratings per user, at least 20 per user. The shape (sigma = 1.0) is
    # our assumption; the median follows from it.
    "movielens-20m": dict(
        uih_min=20,
        uih_median=20.0 + 124.0 / math.exp(0.5),
        uih_sigma=1.0,
        uih_max=None,
        num_candidates_mean=4.0,
        num_candidates_max=16,
        content_length_mean=2.0,
        content_length_max=4,
        vocab_size=27_000,
        id_overflow="modulo",
        num_users=138_000,
        num_action_types=10,
        dense_dim=4,
    ),
}


class SyntheticSource:
    """Random access to synthetic samples; see the module docstring. Implements fsdata.source.SampleSource."""

    _CACHE_BLOCKS = 4

    def __init__(self, config: SyntheticConfig):
        config.validate()
        self.config = config
        self._blocks: OrderedDict[tuple[int, int], dict[str, np.ndarray]] = OrderedDict()
        self._samples_generated = 0
        self._truncated = 0
        c = config
        self._label_w = _normal(
            _key(c.seed, _S_W), _key(c.seed, _S_W, 1), np.arange(c.num_labels * c.dense_dim)
        ).reshape(c.num_labels, c.dense_dim) / math.sqrt(max(c.dense_dim, 1))
        calib = self._skeleton(_CALIBRATION_EPOCH, np.arange(8192, dtype=np.int64))
        self.draws_per_sample = float(calib["draws"].mean())
        n = int(round(c.unique_fraction * self.draws_per_sample * c.collision_block_size))
        self.rows_per_block = max(1, min(n, c.vocab_size // 2))
        # Inverse CDF of the exponential gap on a 4096-point grid: 1 + floor(Exp(mean_gap_s)) seconds.
        self._gap_table = 1 + np.floor(-np.log((np.arange(4096) + 0.5) / 4096) * c.mean_gap_s).astype(np.int64)

    # ------------------------------------------------------------------ protocol
    def num_samples(self, epoch: int) -> int:
        return self.config.num_samples

    def describe(self) -> str:
        c = self.config
        return (
            f"synthetic(seed={c.seed}, samples={c.num_samples}, uih median={c.uih_median:.0f} sigma={c.uih_sigma:.3f} "
            f"cap={c.uih_cap}, vocab={c.vocab_size}, collision_rate={c.collision_rate} per {c.collision_block_size} "
            f"samples, rows/block={self.rows_per_block})"
        )

    def stats(self) -> dict[str, int]:
        """Counters since construction: samples generated, and how many had their UIH cut to ``uih_cap``."""
        return {"samples_read": self._samples_generated, "truncated_uih": self._truncated}

    def read(self, epoch: int, start: int, stop: int) -> Batch:
        n = self.config.num_samples
        if not (0 <= start <= stop <= n):
            raise ValueError(f"synthetic source: range [{start}, {stop}) outside the epoch's [0, {n})")
        bs = self.config.collision_block_size
        parts = []
        lo = start
        while lo < stop or (not parts and lo == stop):
            block = lo // bs
            hi = min(stop, (block + 1) * bs)
            parts.append(self._read_block(epoch, block, lo, hi))
            if hi == lo:
                break
            lo = hi
        return parts[0] if len(parts) == 1 else Batch.concat(parts)

    def lengths(self, epoch: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Sizes of samples ``[start, stop)`` without generating ids (cheap: a few values per sample).

        Keys: ``uih_lengths`` (after the cap), ``raw_uih_lengths`` (before), ``num_candidates``,
        ``candidate_lengths`` (content ids per candidate, [sum num_candidates]). Equal to what :meth:`read`
        returns for the same range."""
        n = self.config.num_samples
        if not (0 <= start <= stop <= n):
            raise ValueError(f"synthetic source: range [{start}, {stop}) outside the epoch's [0, {n})")
        sk = self._skeleton(epoch, np.arange(start, stop, dtype=np.int64))
        return {
            "uih_lengths": sk["uih_len"],
            "raw_uih_lengths": sk["raw"],
            "num_candidates": sk["ncand"],
            "candidate_lengths": sk["clen"],
        }

    # ------------------------------------------------------------------ generation
    def _skeleton(self, epoch: int, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Per-sample and per-candidate sizes (no ids): cheap, so whole blocks are computed for the offsets."""
        c = self.config
        s = c.seed
        z = _normal(_key(s, epoch, _S_LEN), _key(s, epoch, _S_LEN2), idx)
        raw = c.uih_min + np.floor(np.exp(math.log(max(c.uih_median - c.uih_min, 1e-9)) + c.uih_sigma * z))
        if c.uih_min == c.uih_median:
            raw = np.full(idx.shape, float(c.uih_min))
        if c.uih_max is not None:
            raw = np.minimum(raw, c.uih_max)
        raw = raw.astype(np.int64)
        uih_len = np.minimum(raw, c.uih_cap)
        u = _uniform(_key(s, epoch, _S_NCAND), idx)
        ncand = np.minimum(1 + _geometric(u, c.num_candidates_mean - 1), c.num_candidates_max)
        cand_sample = np.repeat(np.arange(len(idx)), ncand)
        cand_j = np.arange(len(cand_sample)) - np.repeat(np.cumsum(ncand) - ncand, ncand)
        cand_key = idx[cand_sample] * 65_536 + cand_j
        u = _uniform(_key(s, epoch, _S_CLEN), cand_key)
        clen = np.minimum(1 + _geometric(u, c.content_length_mean - 1), c.content_length_max)
        copied = _uniform(_key(s, epoch, _S_COPY), cand_key) < c.copy_fraction
        draws_c = clen - copied
        draws = uih_len + np.bincount(cand_sample, weights=draws_c, minlength=len(idx)).astype(np.int64)
        return dict(raw=raw, uih_len=uih_len, ncand=ncand, cand_key=cand_key, clen=clen, copied=copied, draws=draws)

    def _block_skeleton(self, epoch: int, block: int) -> dict[str, np.ndarray]:
        key = (epoch, block)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        bs = self.config.collision_block_size
        lo, hi = block * bs, min((block + 1) * bs, self.config.num_samples)
        sk = self._skeleton(epoch, np.arange(lo, hi, dtype=np.int64))
        sk["draw_start"] = np.cumsum(sk["draws"]) - sk["draws"]
        self._blocks[key] = sk
        if len(self._blocks) > self._CACHE_BLOCKS:
            self._blocks.popitem(last=False)
        return sk

    def _ids_at(self, epoch: int, block: int, total_draws: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Item ids at draw positions ``pos`` of a block (see the module docstring), and the draws' hash words."""
        c = self.config
        h = _hash(_key(c.seed, epoch, block, _S_DRAW), pos)
        if total_draws == 0 or len(pos) == 0:
            return np.zeros(len(pos), dtype=np.int64), h
        n = max(1, min(self.rows_per_block, total_draws))
        bkey = _key(c.seed, epoch, block, _S_BLOCK)
        perm = pos * _coprime(total_draws, bkey)
        perm += bkey % total_draws
        perm %= total_draws
        # Zipf rank by the continuous inverse CDF over [1, n + 1), from the top 24 bits of the draw's hash
        # (float32: this is the hot loop of the generator).
        u = (h >> _U64(40)).astype(np.float32)
        u += np.float32(0.5)
        u *= np.float32(1.0 / 2**24)
        e = c.zipf_exponent
        if abs(e - 1.0) < 1e-6:
            x = np.power(np.float32(n + 1), u)
        else:
            u *= np.float32((n + 1.0) ** (1.0 - e) - 1.0)
            u += np.float32(1.0)
            x = np.power(u, np.float32(1.0 / (1.0 - e)))
        rank = x.astype(np.int64)
        rank -= 1
        np.clip(rank, 0, n - 1, out=rank)
        rank *= _coprime(n, bkey >> 8)
        rank += (bkey >> 16) % n
        rank %= n  # scatter the hot ranks over the window, so shared rows are as hot as the others
        offset = np.where(perm < n, perm, rank)
        epoch_base = _key(c.seed, epoch, _S_EPOCH) % c.vocab_size
        start = (epoch_base + int(math.floor(block * (1.0 - c.collision_rate) * self.rows_per_block))) % c.vocab_size
        offset += start
        offset -= np.where(offset >= c.vocab_size, c.vocab_size, 0)
        offset *= _SLOT_MULT % c.vocab_size
        offset %= c.vocab_size
        return offset, h

    def _read_block(self, epoch: int, block: int, lo: int, hi: int) -> Batch:
        c = self.config
        bs = c.collision_block_size
        sk = self._block_skeleton(epoch, block)
        total_draws = int(sk["draws"].sum())
        i0, i1 = lo - block * bs, hi - block * bs
        idx = np.arange(lo, hi, dtype=np.int64)
        uih_len, ncand, draws = sk["uih_len"][i0:i1], sk["ncand"][i0:i1], sk["draws"][i0:i1]
        draw_start = sk["draw_start"][i0:i1]
        c_lo, c_hi = int(sk["ncand"][:i0].sum()), int(sk["ncand"][:i1].sum())
        clen, copied, cand_key = sk["clen"][c_lo:c_hi], sk["copied"][c_lo:c_hi], sk["cand_key"][c_lo:c_hi]
        B, C = hi - lo, c_hi - c_lo

        # A sample's draws: its UIH first, then its candidates' content ids.
        uih_ids, uih_h = self._ids_at(epoch, block, total_draws, segment_arange(draw_start, uih_len))
        content_draws, _ = self._ids_at(
            epoch, block, total_draws, segment_arange(draw_start + uih_len, draws - uih_len)
        )
        uih_offsets = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(uih_len, out=uih_offsets[1:])

        # Candidates: copied ones take an item of their own sample's UIH as first content id.
        cand_sample = np.repeat(np.arange(B), ncand)
        content_offsets = np.zeros(C + 1, dtype=np.int64)
        np.cumsum(clen, out=content_offsets[1:])
        content = np.empty(int(content_offsets[-1]), dtype=np.int64)
        first = content_offsets[:-1]
        draw_slot = np.ones(len(content), dtype=bool)
        draw_slot[first[copied]] = False
        content[draw_slot] = content_draws
        copy_pos = np.floor(
            _uniform(_key(c.seed, epoch, _S_COPYPOS), cand_key[copied]) * uih_len[cand_sample[copied]]
        ).astype(np.int64)
        content[first[copied]] = uih_ids[uih_offsets[cand_sample[copied]] + copy_pos]

        dense = _normal(
            _key(c.seed, epoch, _S_DENSE),
            _key(c.seed, epoch, _S_DENSE2),
            (idx[:, None] * 4096 + np.arange(c.dense_dim)).reshape(-1),
        )
        dense = dense.reshape(B, c.dense_dim).astype(np.float32)
        logits = c.copy_weight * copied[:, None] + c.label_bias
        if c.dense_dim:
            logits = logits + c.dense_weight * (dense[cand_sample] @ self._label_w.T)
        u = _uniform(_key(c.seed, epoch, _S_LABEL), (cand_key[:, None] * 64 + np.arange(c.num_labels)).reshape(-1))
        labels = (u.reshape(C, c.num_labels) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)

        users = (_hash(_key(c.seed, epoch, _S_USER), idx) % _U64(c.num_users)).astype(np.int64)
        actions = timestamps = None
        if c.side_features:
            # Skewed action types (type 0 commonest) and exponential gaps, from unused bits of the draw hash.
            a = (uih_h >> _U64(24)) & _U64(0xFF)
            a *= a
            a *= _U64(c.num_action_types)
            actions = (a >> _U64(16)).astype(np.int64)
            gaps = self._gap_table[(uih_h & _U64(0xFFF)).astype(np.intp)]
            t0 = 1_500_000_000 + np.floor(_uniform(_key(c.seed, epoch, _S_TIME), idx) * 1e8).astype(np.int64)
            timestamps = np.cumsum(gaps)
            before = np.concatenate([[0], timestamps])[uih_offsets[:-1]]
            timestamps -= np.repeat(before - t0, uih_len)

        self._samples_generated += B
        self._truncated += int((sk["raw"][i0:i1] > uih_len).sum())
        t = torch.from_numpy
        cand_offsets = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(ncand, out=cand_offsets[1:])
        return Batch(
            sample_ids=t(idx + epoch * c.num_samples),
            user_ids=t(users),
            uih_offsets=t(uih_offsets),
            uih_item_ids=t(np.ascontiguousarray(uih_ids)),
            candidate_offsets=t(cand_offsets),
            candidate_labels=t(labels),
            content_offsets=t(content_offsets),
            content_ids=t(content),
            dense=t(dense),
            uih_action_types=None if actions is None else t(actions),
            uih_timestamps=None if timestamps is None else t(timestamps),
        )


def row_ids(batch: Batch) -> torch.Tensor:
    """The embedding rows a batch touches: unique ids of its UIH items and candidate content ids (one table)."""
    return torch.unique(torch.cat([batch.uih_item_ids, batch.content_ids]))


def collision_rate(previous_rows: torch.Tensor, rows: torch.Tensor) -> float:
    """Share of ``rows`` (unique ids of a global batch) that ``previous_rows`` (the batch before) also holds."""
    if rows.numel() == 0:
        return 0.0
    return float(torch.isin(rows, previous_rows).sum()) / rows.numel()
