"""Set-up shared by every test, before any test module is imported.

Without a GPU, Triton kernels can only run in Triton's interpreter; the variable must be set before any module
that defines a kernel is imported (the jit decorator reads it at definition time), so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
