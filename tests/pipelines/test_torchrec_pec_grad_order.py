"""torchrec 1.8.0's PEC applies a step's embedding gradient to the wrong rows when a sharding group holds more than
one feature: the minimal reproduction, on 2 gloo ranks, with torchrec's PEC phases alone.

One step of ``ShardedPECEmbeddingCollection`` (row-wise, exact SGD at lr 1), in the order of a last batch (every
id overlapped, so the whole gradient goes through the overlapped gradient AllToAll), with a loss whose gradient
for each looked-up position is a distinct integer: the table's update must be minus the sum of those integers over
the positions of each row, on every rank, exactly.

Cause (torchrec/distributed/pec_comm_ops.py): ``PECAll2AllSeqWait.backward`` selects the gradient in the order of
the input dist's buckets (``backward_ol_permute`` is pre-composed with the recat), so every rank receives it
source-rank-major, [from rank 0: f0, f1 | from rank 1: f0, f1]; ``PECGradientApply.apply`` then re-looks up
``features``, the ids after the input dist, which are feature-major, [f0: from rank 0, from rank 1 | f1: ...], and
calls ``embs.backward(grad)`` with no recat in between (the forward's output dist applies
``sparse_features_recat``; the gradient path has no counterpart). With one feature (or one rank) both orders are
the same; with two they are not, and a gradient lands on another position's row.

The two-feature cases are strict xfails: they fail today with exactly the update that pairing predicts (checked,
so a different fault fails the test outright); the day torchrec recats the received gradient they pass, which the
strict marker reports as a failure: then remove the marker. The one-feature case, which must pass, shows the
harness itself is right.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import doing, run_ranks

WORLD = 2
ROWS, DIM, BATCH = 12, 4, 3
CASES = {  # name -> tables as (table name, features)
    "one_feature": [("t0", ["f0"])],
    "two_tables": [("t0", ["f0"]), ("t1", ["f1"])],
    "one_table_two_features": [("t0", ["f0", "f1"])],
}
GRAD_ORDER_CAUSE = (
    "torchrec 1.8.0 PECGradientApply.apply pairs the received gradient (source-rank-major) with the re-looked-up ids "
    "(feature-major after the input dist) without a recat: with several features a gradient lands on another row"
)


class PECGradientOrder(Exception):
    """The update is exactly the one the source-rank-major / feature-major pairing predicts (the named cause)."""


def _ids(rank: int, features: list[str]) -> dict[str, tuple[list[int], list[int]]]:
    """Each rank's batch: feature -> (per-sample lengths, ids), fixed, so every rank knows every rank's batch."""
    g = torch.Generator().manual_seed(10 + rank)
    out = {}
    for f in features:
        lengths = torch.randint(1, 4, (BATCH,), generator=g)
        out[f] = (lengths.tolist(), torch.randint(0, ROWS, (int(lengths.sum()),), generator=g).tolist())
    return out


def _coeff(rank: int, feature: int, position: int) -> float:
    """The loss's gradient for one looked-up position (all distinct, small integers: sums are exact)."""
    return float(1 + 100 * rank + 30 * feature + position)


def _one_step(rank, world_size, tables):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed.embedding_types import KJTList
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

    features = [f for _, names in tables for f in names]
    configs = [EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=fs) for t, fs in tables]
    pec = PECEmbeddingCollection(EmbeddingCollection(tables=configs, device=torch.device("cpu")))
    sharder = PECEmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 1.0})
    plan = construct_module_sharding_plan(
        pec,
        {t: row_wise(compute_kernel="fused") for t, _ in tables},
        world_size=world_size,
        device_type="cpu",
        sharder=sharder,
    )
    sharded = sharder.shard(pec, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))

    def local_rows():
        state = sharded.state_dict()
        out = {}
        for t, _ in tables:
            (shard,) = state[f"_embedding_collection.embeddings.{t}.weight"].local_shards()
            out[t] = (shard.metadata.shard_offsets[0], shard.tensor.detach().clone())
        return out

    before = local_rows()
    mine = _ids(rank, features)
    kjt = KeyedJaggedTensor(
        keys=features,
        values=torch.tensor([i for f in features for i in mine[f][1]]),
        lengths=torch.tensor([n for f in features for n in mine[f][0]]),
    )
    doing("PEC forward")
    ctx = sharded.create_context()
    dist_input = sharded.input_dist(ctx, kjt).wait().wait()
    ((forward, _),) = [a.wait() for a in sharded.overlap_dist(ctx=ctx, dist_input=dist_input)]
    nol = sharded.compute_and_output_dist_in_partition(ctx, forward.nol_features, forward.splits, is_overlapped=False)
    ol = sharded.compute_and_output_dist_in_partition(ctx, forward.ol_features, forward.splits, is_overlapped=True)
    # As for a last batch: no next batch, every id's gradient is overlapped and applied now.
    ((_, backward),) = [a.wait() for a in sharded.overlap_dist(prev_ctx=ctx, prev_dist_input=dist_input)]
    rows = sharded.merge_partitioned_embeddings(ctx, ol, nol, [forward], [backward]).wait()
    coeffs = [
        torch.tensor([_coeff(rank, fi, p) for p in range(len(mine[f][1]))]).unsqueeze(1)
        for fi, f in enumerate(features)
    ]
    sum((rows[f].values() * c).sum() for f, c in zip(features, coeffs)).backward()
    doing("PEC gradient")
    for part, is_overlapped in ((backward.ol_features, True), (backward.nol_features, False)):
        for applied in sharded.grad_dist(ctx, KJTList([part]), is_overlapped=is_overlapped):
            applied.wait()
    after = local_rows()
    return {t: (before[t][0], before[t][1], after[t][1]) for t, _ in tables}


def _every_case(rank, world_size):
    return {name: _one_step(rank, world_size, tables) for name, tables in CASES.items()}


def _table_of(tables) -> dict[str, str]:
    return {f: t for t, names in tables for f in names}


def _exact_update(tables) -> dict[str, torch.Tensor]:
    """What synchronous SGD at lr 1 does: each row minus the sum of its positions' gradients, over both ranks."""
    features, table_of = [f for _, names in tables for f in names], _table_of(tables)
    delta = {t: torch.zeros(ROWS) for t, _ in tables}
    for rank in range(WORLD):
        ids = _ids(rank, features)
        for fi, f in enumerate(features):
            for p, row in enumerate(ids[f][1]):
                delta[table_of[f]][row] -= _coeff(rank, fi, p)
    return delta


def _source_rank_major_update(tables) -> dict[str, torch.Tensor]:
    """The update if every shard pairs its gradient received source-rank-major with its ids feature-major."""
    features, table_of = [f for _, names in tables for f in names], _table_of(tables)
    block = -(-ROWS // WORLD)  # row-wise: rows [k * block, (k + 1) * block) on rank k
    delta = {t: torch.zeros(ROWS) for t, _ in tables}
    batches = [_ids(rank, features) for rank in range(WORLD)]
    for shard in range(WORLD):
        on_shard = lambda rank, f: [(p, r) for p, r in enumerate(batches[rank][f][1]) if r // block == shard]  # noqa: E731
        grads = [_coeff(s, fi, p) for s in range(WORLD) for fi, f in enumerate(features) for p, _ in on_shard(s, f)]
        rows = [(table_of[f], r) for f in features for s in range(WORLD) for _, r in on_shard(s, f)]
        for grad, (table, row) in zip(grads, rows):
            delta[table][row] -= grad
    return delta


@pytest.fixture(scope="module")
def one_step_per_case():
    pytest.importorskip("torchrec")
    per_rank = run_ranks(_every_case, WORLD, timeout=120)
    return {name: [result[name] for result in per_rank] for name in CASES}


def _check(per_rank, tables) -> None:
    exact, paired = _exact_update(tables), _source_rank_major_update(tables)
    matches = {"exact": True, "paired": True}
    for result in per_rank:
        for t, (offset, before, after) in result.items():
            rows = slice(offset, offset + before.shape[0])
            # SGD at lr 1 adds an integer sum to each weight: one float32 rounding, as in ``before + delta``.
            matches["exact"] &= torch.equal(after, before + exact[t][rows].unsqueeze(1))
            matches["paired"] &= torch.equal(after, before + paired[t][rows].unsqueeze(1))
    if matches["exact"]:
        return
    if matches["paired"]:
        raise PECGradientOrder(GRAD_ORDER_CAUSE)
    raise AssertionError("PEC's update is neither synchronous SGD's nor the one the gradient-order fault predicts")


@pytest.mark.multiprocess
def test_pec_update_equals_sync_with_one_feature(one_step_per_case):
    _check(one_step_per_case["one_feature"], CASES["one_feature"])


@pytest.mark.multiprocess
@pytest.mark.xfail(raises=PECGradientOrder, strict=True, reason=GRAD_ORDER_CAUSE)
@pytest.mark.parametrize("case", ["two_tables", "one_table_two_features"])
def test_pec_update_equals_sync_with_several_features(one_step_per_case, case):
    _check(one_step_per_case[case], CASES[case])
