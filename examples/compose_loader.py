"""Compose FreeScale's loader stages in your own script, then train your own model on balanced batches.

    torchrun --standalone --nproc-per-node 2 examples/compose_loader.py

Every stage is a torchdata.nodes node wrapping the one before it; swap, drop or add stages freely:

    SyntheticSource (or ParquetSource)       random access to the global sample sequence
    -> GlobalBatchReader (build_loader)      this rank's local batch of every global step
    -> Prefetcher                            reads ahead in a thread (no collectives there)
    -> GatherLengths, GatherCandidateLengths, PartitionStage, ShuffleSamples   (balancer_stages)
"""

import torch
import torch.distributed as dist

from fscomm import get_transport
from fscomm.groups import new_thread_group
from fsdata.balancer import BalancerConfig, balancer_stages
from fsdata.loader import LoaderConfig, build_loader, shutdown_loader
from fsdata.synthetic import SyntheticConfig, SyntheticSource


def main(steps: int = 5) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_size = 16
    source = SyntheticSource(SyntheticConfig.from_preset("kuairand-1k", num_samples=10_000, uih_cap=4_096))
    # The balancer's exchanges go through the SM-free host transport, on a process group of their own.
    transport = get_transport("host", group=new_thread_group("balancer"))
    stages = balancer_stages(BalancerConfig(partitioner="kk"), transport, rank, world, capacity=batch_size)
    loader = build_loader(source, LoaderConfig(batch_size=batch_size, prefetch_depth=2), rank, world, stages)

    for step, item in zip(range(steps), loader):
        # Every item is an fsdata.LoaderItem: `item.batch` is this rank's balanced fsdata.Batch (feed it to your
        # model here), `item.report` the balancer's report of its step.
        batch, info = item.batch, item.report
        tokens = int(batch.uih_lengths.sum())
        if rank == 0:
            print(
                f"step {step}: tokens per rank before {info['tokens_before']} -> after {info['tokens_after']} "
                f"(max/mean {info['imbalance_before']:.2f} -> {info['imbalance_after']:.2f}); rank 0 holds "
                f"{batch.batch_size} samples, {tokens} tokens"
            )
    state = loader.state_dict()  # checkpoint the loader with its state: load_state_dict(state) resumes exactly
    if rank == 0:
        print(f"loader state keys: {sorted(state)}")
    # The stage worker is already exchanging the next batch: let it finish on every rank before the groups go.
    shutdown_loader(loader)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
