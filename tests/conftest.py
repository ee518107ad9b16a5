import os

import torch

# The Triton kernels run on the CPU interpreter when no GPU is present; the flag must be set before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
