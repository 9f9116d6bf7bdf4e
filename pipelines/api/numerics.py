"""The numerics of a training step: its compute precision and the deterministic mode.

Precision. Long-sequence recommenders train under bf16 autocast on GPUs: matmuls and attention in bf16, losses,
norms and reductions in fp32 (autocast's own lists). ``auto`` means bf16 on CUDA and fp32 on CPU, where the
tests compare against plain-torch oracles and bf16 would only be slower. The attention kernels that take low
precision only (FlashAttention, kernels.varlen) cast fp32 inputs for their call.

Deterministic mode. FreeScale promises synchronous training's numbers; a run compares bitwise only if every
kernel is reproducible. :func:`enable_determinism` switches the process to torch's deterministic algorithms and
sets cuBLAS's workspace (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS starts: call it before the first matmul on
the GPU, in every rank); :func:`check_determinism` then refuses a model whose attention kernel would not be
reproducible as set up. The softmax model picks FlexAttention in this mode (reproducible as it is, and faster
than FlashAttention's deterministic backward); what the mode costs is in BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from kernels.attention import is_deterministic
from pipelines.models.protocol import SequenceRecommender

PRECISIONS = ("auto", "bf16", "fp32")
#: cuBLAS's reproducible workspace settings (its documentation names these two).
CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of ``precision`` on ``device``, None for fp32 (no autocast)."""
    match precision:
        case "auto":
            return torch.bfloat16 if device.type == "cuda" else None
        case "bf16":
            return torch.bfloat16
        case "fp32":
            return None
        case other:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {other!r} (--precision)")


def autocast(dtype: Optional[torch.dtype], device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``'s type; a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def enable_determinism() -> None:
    """Torch's deterministic algorithms for this process, with cuBLAS's reproducible workspace. Idempotent; raises
    if ``CUBLAS_WORKSPACE_CONFIG`` already holds another value (cuBLAS would not be reproducible)."""
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACES[0])
    if workspace not in CUBLAS_WORKSPACES:
        raise ValueError(
            f"--deterministic: CUBLAS_WORKSPACE_CONFIG={workspace!r} is set; cuBLAS is reproducible "
            f"only with {' or '.join(CUBLAS_WORKSPACES)}: unset it or set one of them"
        )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def check_determinism(model: torch.nn.Module, device: torch.device) -> None:
    """Raises unless the process is in the deterministic mode and ``model``'s attention kernel (where it tells:
    pipelines.models.protocol.SequenceRecommender's ``attention_impl(device)``) is reproducible in it."""
    if not torch.are_deterministic_algorithms_enabled():
        raise ValueError(
            "--deterministic: torch's deterministic algorithms are off (call "
            "pipelines.api.numerics.enable_determinism() first)"
        )
    if device.type == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACES:
        raise ValueError(f"--deterministic: CUBLAS_WORKSPACE_CONFIG must be one of {', '.join(CUBLAS_WORKSPACES)}")
    if isinstance(model, SequenceRecommender):
        impl = model.attention_impl(device)
        if not is_deterministic(impl, device):
            raise ValueError(
                f"--deterministic: the model's attention kernel {impl.value!r} is not reproducible on "
                f"{device.type} as set up"
            )
