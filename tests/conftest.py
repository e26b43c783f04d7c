"""Settings every test shares."""
import os

import torch

# NOTE: Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before the first import of
# triton; without CUDA the kernels in tokenrouter/models/attention/triton_kernels.py then run on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
