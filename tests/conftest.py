import os

import torch

# Triton kernels run under the interpreter where there is no GPU. Triton reads this when a
# kernel is defined, so it must be set before any eprt.kernels Triton module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
