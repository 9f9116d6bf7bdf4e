"""The sample and the jagged batch: the one data type every loader stage and step passes along.

Schema (one training sample, a user's interaction history (UIH) plus the candidates to score):

    sample_id          int64              globally unique; the balancer's exactly-once invariant is stated on it
    user_id            int64
    uih_item_ids       int64[L]           L = UIH length, oldest event first
    uih_action_types   int64[L] | absent  per-event side feature, same length as uih_item_ids
    uih_timestamps     int64[L] | absent  per-event side feature (seconds), same length
    candidate_labels   float32[C, T]      C candidates (variable per sample), T label columns (tasks)
    content_ids        jagged int64       per candidate a variable-length list; by convention the first
                                          id is the candidate item itself, then its content (tags, author...)
    dense              float32[D]         dense features

A :class:`Batch` stores B samples jagged, as values + offsets (int64 offsets, ``offsets[0] == 0``):
``uih_offsets`` [B+1] into the UIH values, ``candidate_offsets`` [B+1] into the candidate rows, and
``content_offsets`` [C_total+1] into ``content_ids`` (candidate-major, in sample order). Its lengths are
properties: ``uih_lengths`` [B], ``num_candidates`` [B], ``candidate_lengths`` [C_total] (int64), and
``num_labels`` (T). ``candidate_labels`` holds one row per candidate (sample 0's candidates first), one column
per label: [C_total, T] also for T = 1. docs/api.md has the field table.
Side features are either present for every sample or absent for all (``None``).

A user's own per-sample features travel beside the built-in ones, by name, and every stage moves them (the
balancer's shuffle included):

    extra_jagged   {name: Jagged(values [n], offsets [B+1])}   a variable-length list per sample (a category id
                                                              list, a second table's ids, ...); int64 or float32
    extra_dense    {name: Tensor[B, ...]}                     a fixed-shape value per sample; int64 or float32

Every batch of one loader carries the same names, dtypes and widths (the balancer checks it across ranks).
In the KeyedJaggedTensor form an extra jagged field is one more key, named as the field.

A batch moved from the host to a device keeps its host offsets (``host_offsets``): the sizes a model needs on
the host (how many tokens, the longest sample) then cost no device sync, which would stall the host until the
GPU drained its queue and then leave the GPU idle while the host queues the next kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from kernels.offsets import lengths_to_offsets

if TYPE_CHECKING:  # torchrec is optional: the training path must work without it.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# Keys of the KeyedJaggedTensor form, per-sample lengths for every key (KJT requires B lengths per key).
UIH_ITEM_KEY = "uih_item_ids"
UIH_ACTION_KEY = "uih_action_types"
UIH_TIME_KEY = "uih_timestamps"
CONTENT_LENGTHS_KEY = "candidate_content_lengths"  # one value per candidate: its number of content ids
CONTENT_KEY = "content_ids"  # all content ids of a sample's candidates, candidate-major
OFFSET_FIELDS = ("uih_offsets", "candidate_offsets", "content_offsets")
BUILTIN_KJT_KEYS = (UIH_ITEM_KEY, UIH_ACTION_KEY, UIH_TIME_KEY, CONTENT_LENGTHS_KEY, CONTENT_KEY)
EXTRA_DTYPES = (torch.int64, torch.float32)  # what the balancer's one-buffer exchange carries (fsdata.nodes.shuffle)


@dataclass
class Sample:
    """One sample in plain arrays (numpy or torch); see the module docstring for the schema."""

    sample_id: int
    user_id: int
    uih_item_ids: np.ndarray
    candidate_labels: np.ndarray  # [C, T]
    content_ids: list[np.ndarray]  # C arrays
    dense: np.ndarray
    uih_action_types: Optional[np.ndarray] = None
    uih_timestamps: Optional[np.ndarray] = None
    extra_jagged: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [n] values of this sample
    extra_dense: dict[str, np.ndarray] = field(default_factory=dict)  # name -> value of fixed shape

    @property
    def uih_length(self) -> int:
        return int(len(self.uih_item_ids))

    @property
    def num_candidates(self) -> int:
        return int(self.candidate_labels.shape[0])


def kjt_split(kjt: "KeyedJaggedTensor") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{key: (values, lengths)}`` of a torchrec KeyedJaggedTensor, split by hand: ``KJT.to_dict()`` fails on a
    KJT of zero samples, which an empty local batch gives."""
    keys = list(kjt.keys())
    ends = torch.tensor(kjt.length_per_key(), dtype=torch.int64).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    stride = kjt.lengths().numel() // max(len(keys), 1)
    values, lengths = kjt.values(), kjt.lengths()
    return {
        k: (values[s:e], lengths[i * stride : (i + 1) * stride]) for i, (k, s, e) in enumerate(zip(keys, starts, ends))
    }


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def _cat(parts: Sequence[np.ndarray], dtype) -> torch.Tensor:
    if not parts:
        return torch.zeros(0, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts))).to(dtype)


@dataclass
class Jagged:
    """One jagged field of a batch: sample i holds ``values[offsets[i]:offsets[i+1]]``."""

    values: torch.Tensor  # [n]
    offsets: torch.Tensor  # int64 [B+1], offsets[0] == 0

    @property
    def lengths(self) -> torch.Tensor:
        return offsets_to_lengths(self.offsets)

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: Union[torch.Tensor, Sequence[int]]) -> "Jagged":
        return cls(values, lengths_to_offsets(lengths))


def _check_extras(
    extra_jagged: Mapping[str, "Jagged"], extra_dense: Mapping[str, torch.Tensor], batch_size: int
) -> None:
    for name, jt in extra_jagged.items():
        if not isinstance(jt, Jagged):
            raise ValueError(f"Batch.extra_jagged[{name!r}] must be an fsdata.batch.Jagged, got {type(jt).__name__}")
        if jt.values.dtype not in EXTRA_DTYPES or jt.values.dim() != 1:
            raise ValueError(
                f"Batch.extra_jagged[{name!r}]: values must be 1-D int64 or float32, got {jt.values.dtype} "
                f"{tuple(jt.values.shape)}"
            )
        if jt.offsets.dtype != torch.int64 or jt.offsets.shape != (batch_size + 1,):
            raise ValueError(
                f"Batch.extra_jagged[{name!r}]: offsets must be int64 [{batch_size + 1}], got {jt.offsets.dtype} "
                f"{tuple(jt.offsets.shape)}"
            )
        if name in BUILTIN_KJT_KEYS:
            raise ValueError(f"Batch.extra_jagged: {name!r} is a built-in key; name the field otherwise")
    for name, t in extra_dense.items():
        if t.dtype not in EXTRA_DTYPES or t.dim() < 1 or t.shape[0] != batch_size:
            raise ValueError(
                f"Batch.extra_dense[{name!r}] must be int64 or float32 [{batch_size}, ...], got {t.dtype} "
                f"{tuple(t.shape)}"
            )


@dataclass
class Batch:
    """B samples in jagged form. Field order and meaning: see the module docstring."""

    sample_ids: torch.Tensor  # int64[B]
    user_ids: torch.Tensor  # int64[B]
    uih_offsets: torch.Tensor  # int64[B+1]
    uih_item_ids: torch.Tensor  # int64[N]
    candidate_offsets: torch.Tensor  # int64[B+1]
    candidate_labels: torch.Tensor  # float32[C_total, T]
    content_offsets: torch.Tensor  # int64[C_total+1]
    content_ids: torch.Tensor  # int64[M]
    dense: torch.Tensor  # float32[B, D]
    uih_action_types: Optional[torch.Tensor] = None  # int64[N]
    uih_timestamps: Optional[torch.Tensor] = None  # int64[N]
    extra_jagged: dict[str, Jagged] = field(default_factory=dict)  # the user's jagged features, by name
    extra_dense: dict[str, torch.Tensor] = field(default_factory=dict)  # the user's per-sample values [B, ...]

    def __post_init__(self) -> None:
        if self.extra_jagged or self.extra_dense:
            _check_extras(self.extra_jagged, self.extra_dense, int(self.sample_ids.numel()))

    # ------------------------------------------------------------------ sizes
    @property
    def batch_size(self) -> int:
        return int(self.sample_ids.numel())

    def __len__(self) -> int:
        return self.batch_size

    @property
    def uih_lengths(self) -> torch.Tensor:
        return offsets_to_lengths(self.uih_offsets)

    @property
    def num_candidates(self) -> torch.Tensor:
        return offsets_to_lengths(self.candidate_offsets)

    @property
    def candidate_lengths(self) -> torch.Tensor:
        """Content length of every candidate, [C_total] (Algorithm 1's candidate_lens)."""
        return offsets_to_lengths(self.content_offsets)

    @property
    def num_labels(self) -> int:
        return int(self.candidate_labels.shape[1])

    @property
    def device(self) -> torch.device:
        return self.uih_item_ids.device

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_samples(cls, samples: Sequence[Sample], num_labels: int = 1, dense_dim: int = 0) -> "Batch":
        """Packs samples into one batch. ``num_labels``/``dense_dim`` size an empty batch."""
        if samples:
            num_labels = int(samples[0].candidate_labels.shape[1])
            dense_dim = int(np.asarray(samples[0].dense).shape[0])
        has_actions = bool(samples) and samples[0].uih_action_types is not None
        has_times = bool(samples) and samples[0].uih_timestamps is not None
        for s in samples:
            if (s.uih_action_types is not None) != has_actions or (s.uih_timestamps is not None) != has_times:
                raise ValueError(f"sample {s.sample_id}: side features must be present in all samples or none")
        uih_lengths = torch.tensor([s.uih_length for s in samples], dtype=torch.int64)
        num_cands = torch.tensor([s.num_candidates for s in samples], dtype=torch.int64)
        content_parts = [c for s in samples for c in s.content_ids]
        content_lengths = torch.tensor([len(c) for c in content_parts], dtype=torch.int64)
        jagged_names = sorted(samples[0].extra_jagged) if samples else []
        dense_names = sorted(samples[0].extra_dense) if samples else []
        for s in samples:
            if sorted(s.extra_jagged) != jagged_names or sorted(s.extra_dense) != dense_names:
                raise ValueError(
                    f"sample {s.sample_id}: extra features {sorted(s.extra_jagged)} / {sorted(s.extra_dense)} "
                    f"differ from the first sample's {jagged_names} / {dense_names}"
                )
        extra_jagged = {}
        for name in jagged_names:
            parts = [np.asarray(s.extra_jagged[name]) for s in samples]
            values = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)))
            values = values.to(torch.float32 if values.is_floating_point() else torch.int64)
            extra_jagged[name] = Jagged.from_lengths(values, [len(p) for p in parts])
        extra_dense = {}
        for name in dense_names:
            t = torch.from_numpy(np.ascontiguousarray(np.stack([np.asarray(s.extra_dense[name]) for s in samples])))
            extra_dense[name] = t.to(torch.float32 if t.is_floating_point() else torch.int64)
        return cls(
            sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
            user_ids=torch.tensor([s.user_id for s in samples], dtype=torch.int64),
            uih_offsets=lengths_to_offsets(uih_lengths),
            uih_item_ids=_cat([s.uih_item_ids for s in samples], torch.int64),
            candidate_offsets=lengths_to_offsets(num_cands),
            candidate_labels=(_cat([s.candidate_labels for s in samples], torch.float32).reshape(-1, num_labels)),
            content_offsets=lengths_to_offsets(content_lengths),
            content_ids=_cat(content_parts, torch.int64),
            dense=(
                torch.from_numpy(np.stack([np.asarray(s.dense, dtype=np.float32) for s in samples]))
                if samples
                else torch.zeros(0, dense_dim, dtype=torch.float32)
            ),
            uih_action_types=_cat([s.uih_action_types for s in samples], torch.int64) if has_actions else None,
            uih_timestamps=_cat([s.uih_timestamps for s in samples], torch.int64) if has_times else None,
            extra_jagged=extra_jagged,
            extra_dense=extra_dense,
        )

    def to_samples(self) -> list[Sample]:
        """Unpacks into per-sample arrays (tests and tooling; not on the hot path)."""
        b = self.to("cpu")
        uo, co, xo = b.uih_offsets.tolist(), b.candidate_offsets.tolist(), b.content_offsets.tolist()
        out = []
        for i in range(b.batch_size):
            u0, u1, c0, c1 = uo[i], uo[i + 1], co[i], co[i + 1]
            out.append(
                Sample(
                    sample_id=int(b.sample_ids[i]),
                    user_id=int(b.user_ids[i]),
                    uih_item_ids=b.uih_item_ids[u0:u1].numpy(),
                    candidate_labels=b.candidate_labels[c0:c1].numpy(),
                    content_ids=[b.content_ids[xo[c] : xo[c + 1]].numpy() for c in range(c0, c1)],
                    dense=b.dense[i].numpy(),
                    uih_action_types=None if b.uih_action_types is None else b.uih_action_types[u0:u1].numpy(),
                    uih_timestamps=None if b.uih_timestamps is None else b.uih_timestamps[u0:u1].numpy(),
                    extra_jagged={
                        k: jt.values[int(jt.offsets[i]) : int(jt.offsets[i + 1])].numpy()
                        for k, jt in b.extra_jagged.items()
                    },
                    extra_dense={k: t[i].numpy() for k, t in b.extra_dense.items()},
                )
            )
        return out

    @classmethod
    def concat(cls, batches: Sequence["Batch"]) -> "Batch":
        """Concatenates batches in order (samples of batches[0] first)."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]

        def cat_offsets(name: str) -> torch.Tensor:
            lengths = [offsets_to_lengths(getattr(b, name)) for b in batches]
            return lengths_to_offsets(torch.cat(lengths))

        def cat_opt(name: str) -> Optional[torch.Tensor]:
            vals = [getattr(b, name) for b in batches]
            if all(v is None for v in vals):
                return None
            if any(v is None for v in vals):
                raise ValueError(f"Batch.concat: {name} present in some batches and absent in others")
            return torch.cat(vals)

        names = (sorted(batches[0].extra_jagged), sorted(batches[0].extra_dense))
        if any((sorted(b.extra_jagged), sorted(b.extra_dense)) != names for b in batches):
            raise ValueError("Batch.concat: the batches carry different extra features")
        extra_jagged = {
            k: Jagged(
                torch.cat([b.extra_jagged[k].values for b in batches]),
                lengths_to_offsets(torch.cat([b.extra_jagged[k].lengths for b in batches])),
            )
            for k in names[0]
        }
        return cls(
            sample_ids=torch.cat([b.sample_ids for b in batches]),
            user_ids=torch.cat([b.user_ids for b in batches]),
            uih_offsets=cat_offsets("uih_offsets"),
            uih_item_ids=torch.cat([b.uih_item_ids for b in batches]),
            candidate_offsets=cat_offsets("candidate_offsets"),
            candidate_labels=torch.cat([b.candidate_labels for b in batches]),
            content_offsets=cat_offsets("content_offsets"),
            content_ids=torch.cat([b.content_ids for b in batches]),
            dense=torch.cat([b.dense for b in batches]),
            uih_action_types=cat_opt("uih_action_types"),
            uih_timestamps=cat_opt("uih_timestamps"),
            extra_jagged=extra_jagged,
            extra_dense={k: torch.cat([b.extra_dense[k] for b in batches]) for k in names[1]},
        )

    # ------------------------------------------------------------------ movement
    def _map(self, fn) -> "Batch":
        def one(v):
            if v is None:
                return None
            if isinstance(v, dict):
                return {
                    k: Jagged(fn(x.values), fn(x.offsets)) if isinstance(x, Jagged) else fn(x) for k, x in v.items()
                }
            return fn(v)

        return dataclasses.replace(self, **{f.name: one(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def to(self, device, non_blocking: bool = False) -> "Batch":
        moved = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        if moved.device.type != "cpu":
            # not a field: what the batch carries besides its tensors, dropped by _map and on the way back to the host
            moved._host_offsets = (
                getattr(self, "_host_offsets", None)
                if self.device.type != "cpu"
                else {n: getattr(self, n) for n in OFFSET_FIELDS}
            )
        return moved

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())

    def host_offsets(self, name: str) -> torch.Tensor:
        """The offsets field ``name`` (one of ``OFFSET_FIELDS``) on the host, with no device sync when the batch
        was moved here from the host (``to``); otherwise copied back (a sync)."""
        if name not in OFFSET_FIELDS:
            raise ValueError(f"Batch.host_offsets: {name!r} is not an offsets field {OFFSET_FIELDS}")
        cached = getattr(self, "_host_offsets", None)
        if cached is not None:
            return cached[name]
        offsets = getattr(self, name)
        return offsets if offsets.device.type == "cpu" else offsets.cpu()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors (absent side features omitted; extras as ``extra_jagged.<name>.values`` / ``.offsets``
        and ``extra_dense.<name>``): for checksums, state and transport."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v
        for k, jt in self.extra_jagged.items():
            out[f"extra_jagged.{k}.values"], out[f"extra_jagged.{k}.offsets"] = jt.values, jt.offsets
        out.update({f"extra_dense.{k}": t for k, t in self.extra_dense.items()})
        return out

    def equals(self, other: "Batch") -> bool:
        """Exact equality of every field (dtype, shape and values)."""
        a, b = self.tensors(), other.tensors()
        return a.keys() == b.keys() and all(
            a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu()) for k in a
        )

    # ------------------------------------------------------------------ torchrec interop
    def to_kjt(self) -> "KeyedJaggedTensor":
        """The sparse part as torchrec's KeyedJaggedTensor (per-sample lengths for every key).

        ``CONTENT_LENGTHS_KEY`` carries one value per candidate (its content length), so the jagged-of-jagged
        candidate content survives the round trip; labels, dense features and ids travel beside the KJT,
        as in torchrec's own ``Batch(dense_features, sparse_features, labels)``.
        """
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        uih_len = self.uih_lengths
        content_per_sample = offsets_to_lengths(self.content_offsets[self.candidate_offsets])
        keys, values, lengths = [UIH_ITEM_KEY], [self.uih_item_ids], [uih_len]
        for key, side in ((UIH_ACTION_KEY, self.uih_action_types), (UIH_TIME_KEY, self.uih_timestamps)):
            if side is not None:
                keys.append(key), values.append(side), lengths.append(uih_len)
        keys += [CONTENT_LENGTHS_KEY, CONTENT_KEY]
        values += [self.candidate_lengths, self.content_ids]
        lengths += [self.num_candidates, content_per_sample]
        for name in sorted(self.extra_jagged):  # a KJT holds one values dtype: the extras must be ids here
            jt = self.extra_jagged[name]
            if jt.values.dtype != torch.int64:
                raise ValueError(
                    f"Batch.to_kjt: extra jagged field {name!r} is {jt.values.dtype}; a KJT carries int64 ids only"
                )
            keys.append(name), values.append(jt.values), lengths.append(jt.lengths)
        return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))

    @classmethod
    def from_kjt(
        cls,
        kjt: "KeyedJaggedTensor",
        *,
        sample_ids: torch.Tensor,
        user_ids: torch.Tensor,
        candidate_labels: torch.Tensor,
        dense: torch.Tensor,
        extra_dense: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> "Batch":
        """Inverse of :meth:`to_kjt`: keys other than the built-in ones become ``extra_jagged`` fields."""
        keys = list(kjt.keys())
        missing = {UIH_ITEM_KEY, CONTENT_LENGTHS_KEY, CONTENT_KEY} - set(keys)
        if missing:
            raise ValueError(f"KeyedJaggedTensor lacks FreeScale keys {sorted(missing)} (has {keys})")
        b = int(sample_ids.numel())
        if kjt.lengths().numel() != b * len(keys):
            raise ValueError(
                f"KeyedJaggedTensor has {kjt.lengths().numel()} lengths for {len(keys)} keys x {b} samples"
            )
        jt = kjt_split(kjt)
        uih_values, uih_lengths = jt[UIH_ITEM_KEY]
        cand_values, cand_lengths = jt[CONTENT_LENGTHS_KEY]
        return cls(
            sample_ids=sample_ids,
            user_ids=user_ids,
            uih_offsets=lengths_to_offsets(uih_lengths),
            uih_item_ids=uih_values,
            candidate_offsets=lengths_to_offsets(cand_lengths),
            candidate_labels=candidate_labels,
            content_offsets=lengths_to_offsets(cand_values),
            content_ids=jt[CONTENT_KEY][0],
            dense=dense,
            uih_action_types=jt[UIH_ACTION_KEY][0] if UIH_ACTION_KEY in jt else None,
            uih_timestamps=jt[UIH_TIME_KEY][0] if UIH_TIME_KEY in jt else None,
            extra_jagged={k: Jagged.from_lengths(v, n) for k, (v, n) in jt.items() if k not in BUILTIN_KJT_KEYS},
            extra_dense=dict(extra_dense or {}),
        )
