import os

import torch

# Triton kernels run under the interpreter where there is no GPU. Triton reads this when a
# kernel is defined, so it must be set before any eprt.kernels Triton module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests marked `cuda` (tests/test_cuda.py) need a GPU: `make gpu-check` runs them there. Without
# one they are deselected (counted as such in pytest's summary), never skipped or passed.
def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; deselected without one (make gpu-check runs it)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    deselected = [item for item in items if item.get_closest_marker("cuda")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return "no CUDA: tests marked `cuda` are deselected (make gpu-check runs them on a GPU)"
