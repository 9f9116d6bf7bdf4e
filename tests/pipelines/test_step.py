"""The public training API (pipelines.api.step) against an unsharded single-process oracle written here in plain torch.

A user's model with plain nn.Embedding tables (one of them called twice per step, with other ids each time) and a
dense head, trained by TrainStep on 2 gloo ranks in modes sync and freescale, must follow the oracle step by step:
one process, every rank's samples in one batch, the loss's global mean, torch's dense SGD, and the row-wise
optimizers' arithmetic on the rows a step looks up (SGD, row-wise Adagrad, lazy Adam with per-row step counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.harness import doing, run_ranks

STEPS, B, NUM_ITEMS, NUM_USERS, DIM, LR, DENSE_LR = 5, 3, 23, 5, 4, 0.05, 0.1


class UserModel(nn.Module):
    """The user's code: ``items`` is called twice per forward (history, then candidates)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = nn.Embedding(NUM_ITEMS, DIM)
        self.users = nn.Embedding(NUM_USERS, DIM)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, history, history_lengths, candidates, users):
        h = torch.segment_reduce(self.items(history), "sum", lengths=history_lengths, unsafe=True)
        return self.head(torch.cat([h + self.items(candidates), self.users(users)], 1))


def _step_data(step: int, rank: int):
    """Plain tensors of one rank's local batch: history ids and lengths (some empty), a candidate and a user per
    sample, a label per sample. Small tables: consecutive steps share rows."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (B,), generator=g)
    history = torch.randint(0, NUM_ITEMS, (int(lengths.sum()),), generator=g)
    candidates = torch.randint(0, NUM_ITEMS, (B,), generator=g)
    users = torch.randint(0, NUM_USERS, (B,), generator=g)
    labels = torch.randint(0, 2, (B, 1), generator=g).float()
    return history, lengths, candidates, users, labels


def _batch(step: int, rank: int):
    from fsdata.batch import Batch, lengths_to_offsets

    history, lengths, candidates, users, labels = _step_data(step, rank)
    ones = torch.ones(B, dtype=torch.int64)
    return Batch(
        sample_ids=torch.arange(B) + 100 * step + 10 * rank,
        user_ids=users,
        uih_offsets=lengths_to_offsets(lengths),
        uih_item_ids=history,
        candidate_offsets=lengths_to_offsets(ones),
        candidate_labels=labels,
        content_offsets=lengths_to_offsets(ones),
        content_ids=candidates,
        dense=torch.zeros(B, 1),
    )


def _inputs(batch):
    return batch.uih_item_ids, batch.uih_lengths, batch.content_ids, batch.user_ids


def _features(batch):  # the ids of every call of each module, in call order
    return {"items": [batch.uih_item_ids, batch.content_ids], "users": batch.user_ids}


def _optimizer(name):
    from fsembed.optim import SGD, Adam, RowWiseAdagrad

    return {"sgd": SGD(lr=LR), "rowwise_adagrad": RowWiseAdagrad(lr=LR), "adam": Adam(lr=LR)}[name]


def _train_body(rank, world_size, optimizer):
    from fsdata.item import LoaderItem
    from pipelines.api.step import TrainStep, wrap_model

    out = {}
    for mode in ("sync", "freescale"):
        doing(mode)
        model = UserModel()
        emb = wrap_model(
            model,
            embeddings=["items", "users"],
            mode=mode,
            features=_features,
            inputs=_inputs,
            optimizer=_optimizer(optimizer),
        )
        step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=DENSE_LR), wrap=emb)
        items = iter([LoaderItem(_batch(s, rank)) for s in range(STEPS)])
        losses = []
        while step.has_next(items):
            losses.append(step.progress(items).loss)
        out[mode] = (
            losses,
            emb.collection.full_tables(),
            {k: v.detach().clone() for k, v in model.head.state_dict().items()},
        )
    return out


def _oracle(optimizer: str, world_size: int):
    """One process, plain torch: the global batch of every step, the loss's global mean, dense SGD, and the
    row-wise update of the rows the step looked up."""
    model = UserModel()
    tables = {"items": model.items.weight, "users": model.users.weight}
    dense = torch.optim.SGD(model.head.parameters(), lr=DENSE_LR)
    state = {
        k: {
            "sum": torch.zeros(w.shape[0]),
            "m": torch.zeros_like(w),
            "v": torch.zeros_like(w),
            "step": torch.zeros(w.shape[0]),
        }
        for k, w in tables.items()
    }
    losses = []
    for s in range(STEPS):
        parts = [_step_data(s, r) for r in range(world_size)]
        history, lengths, candidates, users, labels = (torch.cat([p[i] for p in parts]) for i in range(5))
        for w in tables.values():
            w.grad = None
        dense.zero_grad()
        logits = model(history, lengths, candidates, users)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / labels.numel()
        loss.backward()
        losses.append(loss.item())
        dense.step()
        touched = {"items": torch.unique(torch.cat([history, candidates])), "users": torch.unique(users)}
        with torch.no_grad():
            for k, w in tables.items():
                rows, g, st = touched[k], w.grad[touched[k]], state[k]
                if optimizer == "sgd":
                    w[rows] -= LR * g
                elif optimizer == "rowwise_adagrad":
                    st["sum"][rows] += (g * g).mean(1)
                    w[rows] -= LR * g / (st["sum"][rows].sqrt() + 1e-8).unsqueeze(1)
                else:  # lazy Adam: moments and step count of the looked-up rows only
                    st["step"][rows] += 1
                    st["m"][rows] = 0.9 * st["m"][rows] + 0.1 * g
                    st["v"][rows] = 0.999 * st["v"][rows] + 0.001 * g * g
                    t = st["step"][rows].unsqueeze(1)
                    m_hat, v_hat = st["m"][rows] / (1 - 0.9**t), st["v"][rows] / (1 - 0.999**t)
                    w[rows] -= LR * m_hat / (v_hat.sqrt() + 1e-8)
    return losses, {k: w.detach() for k, w in tables.items()}, model.head.state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_train_step_follows_the_unsharded_oracle(optimizer):
    results = run_ranks(_train_body, 2, args=(optimizer,), timeout=120)
    ref_losses, ref_tables, ref_head = _oracle(optimizer, 2)
    for rank, result in enumerate(results):
        sync_losses = result["sync"][0]
        for mode, (losses, tables, head) in result.items():
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=f"{mode} losses"
            )
            for name in ref_tables:
                torch.testing.assert_close(
                    tables[name], ref_tables[name], rtol=1e-5, atol=1e-6, msg=f"{mode} table {name}"
                )
            for name in ref_head:
                torch.testing.assert_close(head[name], ref_head[name], rtol=1e-5, atol=1e-6, msg=f"{mode} head {name}")
        assert result["freescale"][0] == sync_losses  # prioritized updates: the same losses bit for bit


def _called_more_than_prepared_body(rank, world_size):
    from fsdata.item import LoaderItem
    from pipelines.api.step import TrainStep, wrap_model

    model = UserModel()
    # the candidates' ids are missing: the second call of `items` asks for ids that were never prepared
    emb = wrap_model(
        model,
        embeddings=["items", "users"],
        mode="sync",
        features=lambda b: {"items": b.uih_item_ids, "users": b.user_ids},
        inputs=_inputs,
    )
    step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=DENSE_LR), wrap=emb)
    try:
        step.progress(iter([LoaderItem(_batch(0, rank))]))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.multiprocess
def test_a_module_called_more_often_than_prepared_says_how_to_write_it():
    for message in run_ranks(_called_more_than_prepared_body, 2, timeout=60):
        assert message is not None and "more than once per step" in message and "list in call order" in message


def _hooks_body(rank, world_size):
    """One TrainStep.train_on with every hook, the all-reduce's bucket launched early and late: the calls in order,
    and what the result carries."""
    import contextlib

    from fsdata.item import LoaderItem
    from pipelines.api.dense_sync import PER_RANK_FIELDS
    from pipelines.api.step import StepHooks, TrainStep, wrap_model

    out = {}
    for early in (True, False):
        doing(f"early {early}")
        calls = []

        @contextlib.contextmanager
        def phase(name):
            calls.append(f"> {name.removeprefix('freescale/')}")
            yield
            calls.append(f"< {name.removeprefix('freescale/')}")

        def per_rank(item):
            calls.append("per_rank")
            return tuple(float(10 * rank + i) for i in range(len(PER_RANK_FIELDS)))

        hooks = StepHooks(
            phase=phase,
            before_backward=lambda: calls.append("before_backward"),
            after_backward=lambda: calls.append("after_backward"),
            per_rank=per_rank,
            early_allreduce=early,
        )
        model = UserModel()
        emb = wrap_model(model, embeddings=["items", "users"], mode="sync", features=_features, inputs=_inputs)
        step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=DENSE_LR), wrap=emb, hooks=hooks)
        result = step.train_on(LoaderItem(_batch(0, rank)))
        out[early] = (calls, {k: v.tolist() for k, v in result.per_rank.items()}, result)
    return out


@pytest.mark.multiprocess
def test_the_steps_hooks_run_in_order_and_its_result_carries_every_ranks_slot():
    """What a job adds (the trainer's phases, the early all-reduce, per-rank slots, the batch it lets go of) comes in
    through the one step's hooks, in this order; the result carries what the trainer's record is built from."""
    from pipelines.api.dense_sync import PER_RANK_FIELDS

    compute = ["> forward_backward", "> forward", "< forward", "before_backward", "> backward", "< backward"]
    early = [*compute, "per_rank", "> dense_allreduce", "< dense_allreduce", "after_backward", "< forward_backward"]
    late = [*compute, "per_rank", "after_backward", "< forward_backward", "> dense_allreduce", "< dense_allreduce"]
    for out in run_ranks(_hooks_body, 2, timeout=120):
        assert out[True][0] == [*early, "> dense_allreduce", "< dense_allreduce"]
        assert out[False][0] == late
        for calls, per_rank, result in out.values():
            assert per_rank == {name: [float(i), float(10 + i)] for i, name in enumerate(PER_RANK_FIELDS)}
            assert result.compute_s > 0 and result.allreduce_s >= 0 and result.labels == 2 * B
            assert result.loss == result.loss_sum / result.labels and float(result.local_loss_sum) > 0
        assert out[True][2].loss == out[False][2].loss  # where the bucket starts changes no number


class KjtModel(nn.Module):
    """A user's model of a torchrec EmbeddingCollection fed a KeyedJaggedTensor that its ``inputs`` builds."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingCollection, EmbeddingConfig

        torch.manual_seed(0)
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=NUM_ITEMS, feature_names=["hist"])],
            device=torch.device("cpu"),
        )
        self.head = nn.Linear(DIM, 1)

    def forward(self, kjt, num_candidates):
        jt = self.ec(kjt)["hist"]
        pooled = torch.segment_reduce(jt.values(), "sum", lengths=jt.lengths(), unsafe=True)
        return self.head(pooled).repeat_interleave(num_candidates, 0, output_size=int(num_candidates.sum()))


def _inputs_calls_body(rank, world_size):
    """How often the user's inputs() runs, per thread, in a step's three ways of getting its ids: the loader's ID
    prefetch (freescale), none (sync), and hand-made items without a loader (freescale: the step derives the next
    batch's ids itself)."""
    import threading

    from torchrec import KeyedJaggedTensor

    from fsdata import LoaderConfig, build_loader, shutdown_loader
    from fsdata.item import LoaderItem
    from fsdata.synthetic import SyntheticConfig, SyntheticSource
    from pipelines.api.step import TrainStep, wrap_model

    training = threading.get_ident()
    out = {}
    for mode, loader in (("sync", True), ("freescale", True), ("freescale", False)):
        doing(f"{mode}, loader {loader}")
        calls = {"training": 0, "loader": 0}

        def inputs(batch):
            calls["training" if threading.get_ident() == training else "loader"] += 1
            kjt = KeyedJaggedTensor(keys=["hist"], values=batch.uih_item_ids % NUM_ITEMS, lengths=batch.uih_lengths)
            return kjt, batch.num_candidates

        model = KjtModel()
        wrapped = wrap_model(model, types=["EmbeddingCollection"], mode=mode, inputs=inputs)
        source = SyntheticSource(SyntheticConfig.from_preset("tiny", num_samples=48, seed=1, uih_max=16))
        if loader:
            items = build_loader(source, LoaderConfig(batch_size=4), rank, world_size, wrapped.loader_stages(rank))
        else:
            items = [LoaderItem(source.read(0, 8 * s + 4 * rank, 8 * s + 4 * rank + 4)) for s in range(6)]
        loss = (
            lambda out, batch: nn.functional.binary_cross_entropy_with_logits(  # noqa: E731
                out, batch.candidate_labels[:, :1], reduction="sum"
            )
        )
        step = TrainStep(model, loss, torch.optim.SGD(model.parameters(), lr=DENSE_LR), wrap=wrapped)
        it, losses = iter(items), []
        while step.has_next(it):
            losses.append(step.progress(it).loss)
        if loader:
            shutdown_loader(items)
        out[(mode, loader)] = (len(losses), dict(calls), losses)
    return out


@pytest.mark.multiprocess
def test_the_users_inputs_run_once_per_step():
    """The batch's ids are computed once: by the loader's ID prefetch (from inputs(), in its worker: once per
    batch, the model's arguments then travelling with the ids to the step) or by the step from the model's
    arguments; the wrap's lookup takes them in the step's context. So the user's inputs() runs
    once per step, whatever the mode: in the loader's worker where the ID prefetch runs, else in the training
    thread."""
    pytest.importorskip("torchrec")
    for out in run_ranks(_inputs_calls_body, 2, timeout=240):
        for (mode, loader), (steps, calls, losses) in out.items():
            assert steps == 6, (mode, loader)
            in_loader = mode == "freescale" and loader
            assert calls["loader"] == (steps if in_loader else 0), (mode, loader, calls)
            assert calls["training"] == (0 if in_loader else steps), (mode, loader, calls)
        # the same batches, the same losses: freescale's ids from the loader or from the step, sync's from the step
        assert out[("freescale", True)][2] == out[("sync", True)][2] == out[("freescale", False)][2]


def test_pooled_modules_are_refused_with_the_reason():
    from fsembed.swap import swap_embeddings

    model = nn.Module()
    model.bag = nn.EmbeddingBag(10, 4)
    with pytest.raises(ValueError, match="unpooled"):
        swap_embeddings(model, ["bag"], source=None, world_size=1, rank=0)
    with pytest.raises(ValueError, match="unpooled"):
        swap_embeddings(model, types=["EmbeddingBag"], source=None, world_size=1, rank=0)


def test_torchrec_embedding_bag_collection_is_refused_with_the_reason():
    torchrec = pytest.importorskip("torchrec")
    from fsembed.swap import swap_embeddings

    model = nn.Module()
    model.ebc = torchrec.EmbeddingBagCollection(
        tables=[torchrec.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="EmbeddingBagCollection.*pooled.*unpooled"):
        swap_embeddings(model, ["ebc"], source=None, world_size=1, rank=0)


def test_find_embeddings_by_type_takes_the_outermost_modules():
    from fsembed.swap import find_embeddings

    model = nn.Module()
    model.tower = UserModel()
    assert find_embeddings(model, ["Embedding"]) == ["tower.items", "tower.users"]
    assert find_embeddings(model, [nn.Embedding]) == ["tower.items", "tower.users"]
    with pytest.raises(ValueError, match="no module of type"):
        find_embeddings(nn.Linear(2, 2), ["Embedding"])
    with pytest.raises(ValueError, match="cannot be swapped"):
        find_embeddings(model, ["Linear"])


def test_wrap_model_needs_features_or_a_kjt_input():
    from pipelines.api.step import wrap_model

    with pytest.raises(ValueError, match="give features"):
        wrap_model(UserModel(), embeddings=["items"])


def test_model_and_partitioner_factories_in_toml_build_the_users_model(tmp_path):
    """`[model] name` and `[balancer] partitioner` take the same two forms as the flags; a factory gets the job's
    config and its ModelSpec goes through the same wrap as the softmax model."""
    from pipelines.cli import build_parser
    from pipelines.job.builders import build_model_spec, build_source
    from pipelines.job.config.flags import config_from_args

    (tmp_path / "my_model.py").write_text(
        "import torch\nfrom pipelines import ModelSpec\n\n"
        "def build(config):\n"
        "    torch.manual_seed(config.run.seed)\n"
        "    return ModelSpec(torch.nn.Embedding(7, 2), embeddings=['items'])\n"
    )
    root = Path(__file__).resolve().parents[2]
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'[model]\nname = "{tmp_path}/my_model.py:build"\n'
        f'[balancer]\npartitioner = "{root}/examples/custom_partitioner.py:round_robin_longest"\n'
    )
    config = config_from_args(build_parser().parse_args(["train", "--config", str(toml)])).validate()
    spec = build_model_spec(config, build_source(config.data, 2))
    assert isinstance(spec.model, nn.Embedding) and spec.embeddings == ["items"]
    from fsdata.partition import get_partitioner

    assert callable(get_partitioner(config.balancer.partitioner))
    config.model.name = f"{tmp_path}/my_model.py:nothing"
    with pytest.raises(ValueError, match="has no attribute 'nothing'"):
        build_model_spec(config, build_source(config.data, 2))


def _both_paths_body(rank, world_size, mutate):
    """The API's loop and `freescale train`'s trainer on the same rank, optionally with a bug injected into the
    one step implementation (TrainStep.forward_backward: the loss scaled by twice the global label count)."""
    from fsdata.item import LoaderItem
    from pipelines.api import step as step_module
    from pipelines.api.step import TrainStep, wrap_model
    from tests.pipelines.test_train import _tiny_trainer

    if mutate:
        original = step_module.TrainStep.forward_backward
        step_module.TrainStep.forward_backward = lambda self, item, upcoming, total: original(
            self, item, upcoming, 2 * total
        )
    doing("api")
    model = UserModel()
    emb = wrap_model(model, embeddings=["items", "users"], mode="freescale", features=_features, inputs=_inputs)
    step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=DENSE_LR), wrap=emb)
    items = iter([LoaderItem(_batch(s, rank)) for s in range(STEPS)])
    api = []
    while step.has_next(items):
        api.append(step.progress(items).loss)
    doing("trainer")
    trainer = _tiny_trainer(rank, world_size, "freescale", 4)
    with trainer:
        trainer.train()
        job = [r["loss"] for r in trainer.history]
    return api, job


@pytest.mark.multiprocess
def test_one_step_implementation_serves_the_api_and_the_trainer():
    """A bug in the shared step shows in both paths: there is no second copy that would hide it."""
    clean = run_ranks(_both_paths_body, 2, args=(False,), timeout=180)
    buggy = run_ranks(_both_paths_body, 2, args=(True,), timeout=180)
    for (api, job), (api_bug, job_bug) in zip(clean, buggy):
        assert api[0] == api_bug[0] and job[0] == job_bug[0]  # the first loss is computed before any update
        assert api[1:] != api_bug[1:] and job[1:] != job_bug[1:]  # the halved gradients change every later step
