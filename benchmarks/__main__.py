"""``python -m benchmarks NAME [flags]``: runs one benchmark. Each module named below exposes
``add_arguments(parser)`` and ``main(args) -> int``, as the `freescale` command's do; only the one asked for is
imported."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "kernels": ("benchmarks.kernels", "jagged kernels: Triton vs PyTorch twin vs eager loop"),
    "attention": ("benchmarks.attention", "jagged attention kernels (varlen, FlexAttention) vs padded SDPA, fwd+bwd"),
    "hstu": ("benchmarks.hstu", "jagged HSTU attention: Triton kernel vs padded twin vs generative-recommenders'"),
    "hstu-static": ("benchmarks.hstu_static", "HSTU attention's machine code per score and one-bucket tiles, no GPU"),
    "hstu-step": ("benchmarks.hstu_step", "one training step of the HSTU model: TFLOP/s and MFU, rab on and off"),
    "transport": ("benchmarks.transport", "transport latency, bandwidth and compute contention"),
    "multihost": ("benchmarks.multihost", "mixed shm+tcp against all-TCP on emulated hosts with rate-limited links"),
    "peer": ("benchmarks.peer", "the experimental copy-engine peer transport against plain peer copies (CUDA)"),
    "embedding": ("benchmarks.embedding", "exposed embedding communication: sync vs prioritized"),
    "e2e": ("benchmarks.e2e", "every train mode on the same data, bubbles side by side"),
    "host": ("benchmarks.host", "host work per step that grows with the world size, at 8-1,024 ranks"),
    "replay": ("benchmarks.replay", "freescale simulate on measured step times of the softmax model"),
    "scaling": ("benchmarks.scaling", "the scaling table and the replay cross-check from e2e and replay JSON"),
    "soak": ("benchmarks.soak", "a long CPU run of the demo's job, its resident memory read at intervals"),
}
PROG = "python -m benchmarks"


def _usage() -> str:
    width = max(map(len, BENCHES))
    names = "\n".join(f"  {name:<{width}}  {help_text}" for name, (_, help_text) in BENCHES.items())
    return f"usage: {PROG} NAME [flags]   ({PROG} NAME --help for its flags)\n\nbenchmarks:\n{names}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"{PROG}: error: unknown benchmark {name!r}; choose one of {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    module_name, help_text = BENCHES[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except (ValueError, OSError) as error:  # bad input, a missing or unreadable file: what and where, one line
        print(f"benchmarks {name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
