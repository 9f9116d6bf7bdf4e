"""Modes torchrec (the real DistributedModelParallel + TrainPipelineSparseDist) and torchrec-pec (torchrec's PEC) on
2 gloo ranks: they train, their losses follow sync mode's on the same data (torchrec-pec's equal torchrec's bit for
bit, and freescale's equal sync's), they report what they cannot measure as None, and without torchrec they fail
with a message naming the package.

Tolerance of the loss comparison: 1e-6, relative. Both modes start from the same weights and batches, scale the
loss the same way and apply the same update rules, so they differ only in float32 summation order (fbgemm sums a
row's duplicate gradients, and DDP the dense gradients, in other orders than FreeScale's sync path): one float32
ulp of the loss, at most 6e-8 relative over 8 steps when measured. A semantic mismatch stands well above it:
without the world-size factor that undoes torchrec's gradient division (the table then learns at half its rate)
the second step's losses already part by 2.6e-5 relative.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from pipelines.cli import build_parser
from pipelines.job.config.flags import config_from_args
from tests.harness import doing, run_ranks

STEPS = 4
TOLERANCE = 1e-6


def _config(mode: str):
    from tests.pipelines.tiny import tiny_config

    cfg = tiny_config(mode, STEPS)
    cfg.balancer.partitioner = "none"  # freescale: the same local batches as sync, so the same bits
    return cfg.validate()


def _local_rows(state, key: str) -> int:
    return sum(s.tensor.shape[0] for s in state[key].local_shards())


def _train_every_mode(rank, world_size):
    from pipelines.job.trainer import Trainer

    out = {}
    for mode in ("sync", "freescale", "torchrec", "torchrec-pec"):
        doing(f"train {mode}")
        trainer = Trainer(_config(mode), rank=rank, world_size=world_size, device=torch.device("cpu"))
        trainer.train()
        out[mode] = trainer.history
        out["num_items"] = trainer.model.config.num_items
        if mode == "torchrec":
            state = trainer.step_fn.dmp.state_dict()
            out["local_rows"] = _local_rows(state, "item_collection.embeddings.item_embedding.weight")
        if mode == "torchrec-pec":
            state = trainer.step_fn.dmp.state_dict()
            out["pec_local_rows"] = _local_rows(
                state, "collection._embedding_collection.embeddings.item_embedding.weight"
            )
    return out


@pytest.mark.multiprocess
def test_torchrec_modes_train_like_sync():
    pytest.importorskip("torchrec")
    for rank_out in run_ranks(_train_every_mode, 2, timeout=180):
        sync, ref, pec = rank_out["sync"], rank_out["torchrec"], rank_out["torchrec-pec"]
        # Prioritized updates change when rows move, never the numbers; PEC is exact on the softmax model's table
        # (one feature: tests/pipelines/test_torchrec_pec_grad_order.py) and applies torchrec's update rules, to
        # float rounding: its path and torchrec's sum in orders that agree under torch's AVX2 CPU kernels and not
        # under its AVX-512 ones (the losses then differ in the eighth digit).
        assert [r["loss"] for r in rank_out["freescale"]] == [r["loss"] for r in sync]
        pec_losses, ref_losses = ([r["loss"] for r in run] for run in (pec, ref))
        torch.testing.assert_close(pec_losses, ref_losses, rtol=1e-6, atol=0.0)
        assert rank_out["pec_local_rows"] == rank_out["num_items"] // 2
        assert pec[1]["compute_s"] is None and pec[1]["exposed_s"]["emb_a2a"] is None
        assert [r["step"] for r in ref] == list(range(STEPS))
        assert [r["samples_per_rank"] for r in ref] == [r["samples_per_rank"] for r in sync]
        for a, b in zip(sync, ref):
            assert math.isfinite(b["loss"]) and abs(a["loss"] - b["loss"]) <= TOLERANCE * abs(a["loss"]), (
                a["loss"],
                b["loss"],
            )
        # Row-wise: each rank holds its half of the item table.
        assert rank_out["local_rows"] == rank_out["num_items"] // 2
        # Measured parts are numbers; the ones progress() hides are None, never 0.
        # (Step 1 hands TrainPipelineSparseDist batch 3, whose label count is all-reduced then; the last steps feed
        # none.)
        mid = ref[1]
        assert mid["step_time_s"] > 0 and mid["exposed_s"]["label_count"] > 0 and mid["data_wait_s"] >= 0
        assert all(mid["exposed_s"][p] is None for p in ("ids_a2a", "emb_a2a", "grad_a2a", "dense_allreduce"))
        assert mid["compute_s"] is None and mid["straggler_pct"] is None and mid["bubble_s"] is None


def _nan_on_rank_1_at_step_2(rank, world_size):
    from pipelines.job.run.step_log import NonFiniteLoss
    from pipelines.job.trainer import Trainer

    with Trainer(_config("torchrec"), rank=rank, world_size=world_size, device=torch.device("cpu")) as trainer:
        poison = lambda module, args, out: out * float("nan") if rank == 1 and trainer.step == 2 else out  # noqa: E731
        trainer.model.register_forward_hook(poison)
        try:
            trainer.train()
        except NonFiniteLoss as e:
            return str(e), e.root, len(trainer.history)
    return None


@pytest.mark.multiprocess
def test_a_non_finite_loss_stops_mode_torchrec_at_that_step_too():
    """The check is the trainer's, on what any step returns: the torchrec baseline's steps are checked as the
    API's are (the same line, the same step, the rank named)."""
    pytest.importorskip("torchrec")
    (msg0, root0, logged0), (msg1, root1, logged1) = run_ranks(_nan_on_rank_1_at_step_2, 2, timeout=120)
    assert msg1 == "non-finite loss at step 2 on rank 1 (its loss sum is nan): the run stops here" and root1
    assert msg0.startswith("non-finite loss at step 2 on another rank") and not root0
    assert logged0 == logged1 == 2  # steps 0 and 1, settled at once (torchrec's records wait for no block)


def _parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_without_torchrec_the_error_names_the_package(monkeypatch):
    from pipelines.models.torchrec_baseline import require_torchrec

    monkeypatch.setitem(sys.modules, "torchrec", None)  # as where torchrec is not installed
    with pytest.raises(ValueError, match=r"torchrec.*not importable here: it is a CPU baseline only"):
        _parse("--mode", "torchrec")
    with pytest.raises(ImportError, match=r"torchrec.*CPU baseline only"):
        require_torchrec()


@pytest.mark.parametrize("mode", ["torchrec", "torchrec-pec"])
@pytest.mark.parametrize(
    "argv,match",
    [
        (["--embedding-optimizer", "adam"], "fused Adam fails on CPU"),
        (["--device", "cuda"], "CPU baseline only"),
        (["--checkpoint-every", "2", "--checkpoint-dir", "ck"], "does not checkpoint"),
        (["--eval-data", "eval.parquet"], "has no held-out evaluation"),
    ],
)
def test_torchrec_modes_refuse_what_they_cannot_match(mode, argv, match):
    pytest.importorskip("torchrec")
    with pytest.raises(ValueError, match=f"mode {mode}.*{match}|{match}"):
        _parse("--mode", mode, *argv)


def test_only_torchrec_pec_takes_a_model_factory_and_neither_the_hstu_model():
    pytest.importorskip("torchrec")
    factory = "examples/bring_your_own_model.py:build_model"
    with pytest.raises(ValueError, match="mode torchrec runs the softmax model only"):
        _parse("--mode", "torchrec", "--model", factory)
    assert _parse("--mode", "torchrec-pec", "--model", factory).run.mode == "torchrec-pec"
    with pytest.raises(ValueError, match="mode torchrec-pec does not run the HSTU model: --model hstu"):
        _parse("--mode", "torchrec-pec", "--model", "hstu")


def test_torchrec_pec_names_what_a_model_of_its_own_lacks():
    pytest.importorskip("torchrec")
    from pipelines import ModelSpec
    from pipelines.models.torchrec_pec import user_target

    with pytest.raises(ValueError, match="needs --model's model to hold one torchrec EmbeddingCollection, it holds 0"):
        user_target(ModelSpec(torch.nn.Linear(2, 1)), "sgd", 0.1)
