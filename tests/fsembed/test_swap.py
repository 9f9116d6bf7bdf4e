"""Module swap: a user's model with plain nn.Embedding tables, swapped by name, trains like the unsharded
model (sync) and bit for bit like its synchronous swap (prioritized)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import doing, run_ranks

pytestmark = pytest.mark.multiprocess

STEPS, LR = 4, 0.1


class UserModel(nn.Module):
    """The user's code: it knows nothing of sharding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.towers = nn.Module()
        self.towers.item_emb = nn.Embedding(40, 6)
        self.user_emb = nn.Embedding(9, 6)
        self.head = nn.Linear(6, 1)
        self.head.requires_grad_(False)

    def forward(self, items, users):
        h = self.towers.item_emb(items).sum(1) + self.user_emb(users)
        return torch.tanh(self.head(h)).square().sum()


class _Lookups:
    """The embedding wrap's part around a forward, without a step (fsembed.swap.RowSource): one lookup of every
    feature per forward, as the prioritized schedule makes it (the synchronous collection ignores the next batch's
    ids), from which the swapped modules take their rows."""

    def __init__(self):
        self.swapped, self.forward = None, None

    def rows(self, feature, ids):
        return self.forward.take(feature, ids)

    def prepare(self, features, upcoming=None, exchange=None):
        from fsembed.plan import flat_features
        from fsembed.swap import ForwardRows

        ids = flat_features(features)
        following = None if upcoming is None else flat_features(upcoming)
        self.forward = ForwardRows(ids, self.swapped.collection(exchange if exchange is not None else ids, following))

    def release(self):
        forward, self.forward = self.forward, None
        forward.finish()


def _swap(model, names, **kwargs):
    from fsembed.swap import swap_embeddings

    lookups = _Lookups()
    lookups.swapped = swap_embeddings(model, names, source=lookups, **kwargs)
    return lookups


def _data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 40, (3, 5), generator=g), torch.randint(0, 9, (3,), generator=g)


def _body(rank, world_size):
    from fsembed.optim import SGD

    out = {}
    for mode in ("sync", "prioritized"):
        doing(mode)
        model = UserModel()
        lookups = _swap(model, ["towers.item_emb", "user_emb"], schedule=mode, optimizer=SGD(lr=LR))
        losses = []
        for s in range(STEPS):
            items, users = _data(s, rank)
            nxt = None
            if s + 1 < STEPS:
                ni, nu = _data(s + 1, rank)
                nxt = {"towers.item_emb": ni.reshape(-1), "user_emb": nu}
            lookups.prepare({"towers.item_emb": items.reshape(-1), "user_emb": users}, nxt)
            loss = model(items, users)
            lookups.release()
            loss.backward()
            losses.append(loss.detach())
        out[mode] = (torch.stack(losses), lookups.swapped.collection.full_tables(), sorted(model.state_dict()))
    return out


def test_swap_matches_unsharded_model_and_prioritized_matches_sync():
    results = run_ranks(_body, 2, timeout=90)
    # Unsharded model to compare with: one model, every rank's batch, the loss summed over ranks (sparse SGD semantics).
    ref = UserModel()
    opt = torch.optim.SGD([ref.towers.item_emb.weight, ref.user_emb.weight], lr=LR)
    ref_losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses = [ref(*_data(s, r)) for r in range(2)]
        sum(losses).backward()
        opt.step()
        ref_losses.append(torch.stack([x.detach() for x in losses]))
    for rank, r in enumerate(results):
        losses, tables, keys = r["sync"]
        torch.testing.assert_close(losses, torch.stack(ref_losses)[:, rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tables["towers_item_emb"], ref.towers.item_emb.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tables["user_emb"], ref.user_emb.weight.detach(), rtol=1e-5, atol=1e-6)
        assert "fsembed_collection._extra_state" in keys
        p_losses, p_tables, _ = r["prioritized"]
        assert torch.equal(p_losses, losses) and all(torch.equal(p_tables[k], tables[k]) for k in tables)


def test_swap_rejects_unknown_module():
    from fsembed.swap import swap_embeddings

    with pytest.raises(ValueError, match="no module named"):
        swap_embeddings(UserModel(), ["nope"], source=_Lookups(), world_size=1, rank=0)
    with pytest.raises(ValueError, match="expected nn.Embedding"):
        swap_embeddings(UserModel(), ["head"], source=_Lookups(), world_size=1, rank=0)


def _torchrec_body(rank, world_size):
    import copy

    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

    from fsembed.swap import ShardedCollectionView

    torch.manual_seed(1)
    model = nn.Module()
    model.ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(name="t_items", embedding_dim=8, num_embeddings=30, feature_names=["uih", "cand"]),
            EmbeddingConfig(name="t_users", embedding_dim=8, num_embeddings=7, feature_names=["user"]),
        ],
        device=torch.device("cpu"),
    )
    original = copy.deepcopy(model.ec)
    g = torch.Generator().manual_seed(rank)
    feats = {
        "uih": torch.randint(0, 30, (9,), generator=g),
        "cand": torch.randint(0, 30, (4,), generator=g),
        "user": torch.randint(0, 7, (2,), generator=g),
    }
    kjt = KeyedJaggedTensor(
        keys=["uih", "cand", "user"],
        values=torch.cat([feats[k] for k in ("uih", "cand", "user")]),
        lengths=torch.tensor([5, 4, 1, 3, 1, 1], dtype=torch.int32),  # two samples per key
    )
    lookups = _swap(model, ["ec"])
    lookups.prepare(feats)
    got, want = model.ec(kjt), original(kjt)
    return isinstance(model.ec, ShardedCollectionView) and all(
        torch.equal(got[k].values().detach(), want[k].values().detach())
        and torch.equal(got[k].lengths(), want[k].lengths())
        for k in want
    )


def test_swap_torchrec_embedding_collection_gives_its_lookups():
    pytest.importorskip("torchrec")
    assert all(run_ranks(_torchrec_body, 2, timeout=90))


def _prefetched_body(rank, world_size):
    from fsembed.optim import SGD

    model = UserModel()
    lookups = _swap(model, ["towers.item_emb", "user_emb"], optimizer=SGD(lr=LR))
    items, users = _data(0, rank)
    feats = {"towers.item_emb": items.reshape(-1), "user_emb": users}
    # started before the step, as TorchRec's TrainPipelineSparseDist does
    early = lookups.swapped.collection.exchange_ids(feats)
    lookups.prepare(feats, exchange=early)
    with_prefetch = model(items, users).detach()
    model.eval()
    with torch.no_grad():
        lookups.prepare(feats)
        plain = model(items, users)
    return with_prefetch, plain


def test_swap_prepare_with_prefetched_ids():
    for with_prefetch, plain in run_ranks(_prefetched_body, 2, timeout=60):
        assert torch.equal(with_prefetch, plain)


def _rows_check(device):
    from fsembed.swap import ForwardRows

    ids = torch.arange(6, device=device)
    rows = ForwardRows({"items": ids}, {"items": torch.ones(6, 4, device=device)})
    assert rows.take("items", ids.clone()).shape == (6, 4)  # equal values, another tensor: fine
    rows.verify()
    rows = ForwardRows({"items": ids}, {"items": torch.ones(6, 4, device=device)})
    with pytest.raises(ValueError, match="other ids"):
        rows.take("items", torch.arange(7, device=device))  # more ids than prepared: at once, on any device
    return ForwardRows({"items": ids}, {"items": torch.ones(6, 4, device=device)}), ids


def _numbered(features):
    """A forward's rows where row k of a feature is k's id as a float: which rows a call got is visible."""
    from fsembed.plan import flat_features
    from fsembed.swap import ForwardRows

    ids = flat_features(features)
    return ForwardRows(ids, {k: v.float().unsqueeze(1) for k, v in ids.items()})


def test_a_module_called_several_times_per_step_takes_its_rows_in_call_order():
    first, second = torch.tensor([3, 1, 4]), torch.tensor([1, 5])
    rows = _numbered({"items": [first, second]})
    assert rows.take("items", first).flatten().tolist() == [3, 1, 4]
    assert rows.take("items", second).flatten().tolist() == [1, 5]
    assert rows.take("items", torch.cat([first, second])).flatten().tolist() == [3, 1, 4, 1, 5]  # all again
    rows.finish()
    rows = _numbered({"items": [first, second]})
    rows.take("items", first)
    with pytest.raises(ValueError, match="only part of the ids"):
        rows.finish()  # the forward returned, the second call never came
    with pytest.raises(ValueError, match="list in call order"):
        _numbered({"items": [first, second]}).take("items", second)  # another order than features() listed


def test_a_forwards_rows_refuse_other_ids_than_prepared_on_the_cpu():
    rows, ids = _rows_check("cpu")
    with pytest.raises(ValueError, match=r"\['items'\] was called with other ids"):
        rows.take("items", ids.flip(0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_forwards_rows_check_gpu_ids_without_a_sync_and_raise_when_verified():
    rows, ids = _rows_check("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows.take("items", ids.flip(0))  # queued on the device, not read back here
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="other ids"):
        rows.verify()  # the wrap's next lookup or flush
