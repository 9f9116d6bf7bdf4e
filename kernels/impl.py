"""The one vocabulary of kernel implementations, and its one resolver: every dispatch point (kernels.ops for the
jagged data ops, kernels.attention for the jagged attention, kernels.hstu for the jagged HSTU attention) names its
implementations with :class:`Impl` and picks one with :func:`resolve`, which refuses a name it does not know and an
implementation the op has not got.
"""

from __future__ import annotations

import enum
from typing import Collection, Union


class Impl(enum.Enum):
    TRITON = "triton"  # the Triton kernel (kernels/triton/)
    TORCH = "torch"  # the PyTorch twin (kernels/pytorch/): what the kernels are tested against, and the CPU path
    EAGER = "eager"  # the naive per-sample loop (kernels/pytorch/pt_eager.py): a benchmark baseline only
    VARLEN = "varlen"  # PyTorch's variable-length FlashAttention (kernels/varlen/)
    FLEX = "flex"  # FlexAttention over block masks (kernels/flex/)
    PADDED = "padded"  # SDPA over the batch padded to its longest sample: the attention's baseline


def resolve(impl: Union[Impl, str, None], *, op: str, supported: Collection[Impl], default: Impl) -> Impl:
    """``impl`` (an Impl, its name, or None for ``default``) if ``op`` has it; else a ValueError naming ``op``."""
    if impl is None:
        return default
    if isinstance(impl, str):
        try:
            impl = Impl(impl.lower())
        except ValueError:
            raise ValueError(
                f"kernels.{op}: unknown impl {impl!r}; expected one of {[i.value for i in supported]}"
            ) from None
    if not isinstance(impl, Impl):
        raise ValueError(f"kernels.{op}: impl must be an Impl, a string or None, got {type(impl).__name__}")
    if impl not in supported:
        raise ValueError(f"kernels.{op}: impl {impl.value!r} is not one of this op's: {[i.value for i in supported]}")
    return impl
