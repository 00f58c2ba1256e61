"""Where the kernel tests run: compiled on CUDA, else in Triton's interpreter.

Imported by the kernel test modules before they import Triton: without a GPU it sets ``TRITON_INTERPRET=1``, which
Triton reads when it is first imported.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if HAS_CUDA else "cpu"  # where the kernels run (compiled or interpreted)
