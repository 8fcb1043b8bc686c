"""The data-free export's memory plan (eprt.hf.export_plan) holds what quantizing a weight really
uses: each data-free format's figures (`export_working_bytes` an element, `export_worker_bytes` of
chunk buffers a thread keeps) are at least the peak resident-set growth of its `quantize` on one
weight, measured in a process of its own; and the check of the written output, which the plan
leaves out, holds a scale tensor at a time, not the shard whose scales it reads. (The plan counts
no library for the compressed-tensors layout: its export imports none,
tests/oracles/test_compressed_tensors_export.py.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from eprt.quant.formats import weight_format
from eprt.quant.run.datafree import data_free_formats
from eprt.storage.safetensors_io import SafetensorsWriter

ROWS, COLS = 2048, 4096  # a bf16 weight of 8M elements: 1 byte an element is 8 MiB of growth
# What a process allocates besides the weight's own (the interpreter's objects, torch's dispatch):
# below a tenth of a byte an element of this weight, so a figure short by that much fails.
SLACK = 2**19
# A just-written NVFP4 shard of 36 MiB for the check to read: MODULES Linears, each a packed weight
# [SHARD_ROWS, SHARD_COLS / 2] beside its E4M3 block scales [SHARD_ROWS, SHARD_COLS / 16].
MODULES, SHARD_ROWS, SHARD_COLS = 64, 512, 2048

# Peak growth of the resident set (VmHWM, reset through clear_refs) over each format's `quantize` of
# one bf16 weight, on one thread: `cold` the first weight of that size (its chunk buffers grow to a
# chunk), `warm` the next (they are kept). A tiny weight first takes the kernels' one-time set-up
# out of the figures. MALLOC_MMAP_THRESHOLD_ (in the environment) gives every large temporary back
# to the system when it is freed, so one measurement does not start on the last one's free pages.
MEASURE = """
import json, sys, torch
from eprt.quant.formats import weight_format
torch.set_num_threads(1)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

def growth(fmt, w, scale, mse=False):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident set now
    before = status("VmRSS:")
    out = fmt.quantize(w, scale, mse)
    peak = status("VmHWM:") - before
    del out
    return peak

from pathlib import Path
from eprt.hf.check_files import read_tensors

export, rows, cols, found, problems = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), {}, []
read_tensors(export, problems)  # the first read's one-time set-up out of the figure
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
found["tensors"] = len(read_tensors(export, problems)) - len(problems)
found["check"] = status("VmHWM:") - before
for name in sys.argv[4:]:
    fmt = weight_format(name)
    w = torch.randn(rows, cols).to(torch.bfloat16)
    scale = fmt.scale(w.float().abs().amax())
    fmt.quantize(w[:16], scale, False)
    found[name] = {"cold": growth(fmt, w, scale), "warm": growth(fmt, w, scale)}
    if "mse" in fmt.algorithms and name != "nvfp4_a16":  # NVFP4's search: 126 candidates, slow here
        found[name]["mse"] = growth(fmt, w, scale, True)
print(json.dumps(found))
"""


def nvfp4_export(directory) -> str:
    """A single-file NVFP4 export's weights, just written by the export's own writer, so that its
    pages lie in the page cache as the export's do when its check reads them."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(MODULES):
        m = f"model.layers.{i}.mlp.down_proj"
        tensors[f"{m}.weight"] = torch.randint(0, 256, (SHARD_ROWS, SHARD_COLS // 2), generator=g, dtype=torch.uint8)
        tensors[f"{m}.weight_scale"] = torch.rand(SHARD_ROWS, SHARD_COLS // 16, generator=g).to(torch.float8_e4m3fn)
        tensors[f"{m}.weight_scale_2"] = torch.tensor(1e-3)
    w = SafetensorsWriter(
        os.path.join(directory, "model.safetensors"), [(n, t.dtype, t.shape) for n, t in tensors.items()]
    )
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    return str(directory)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**16)}
    export = nvfp4_export(tmp_path_factory.mktemp("export"))
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, export, str(ROWS), str(COLS), *data_free_formats()],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", data_free_formats())
def test_figures_hold_the_measured_peak_of_quantizing_a_weight(measured, name):
    fmt, elements = weight_format(name), ROWS * COLS
    per_element = elements * fmt.export_working_bytes
    got = measured[name]
    assert got["warm"] <= per_element + SLACK, (
        f"{name} grew {got['warm'] / elements:.2f} bytes an element, planned {fmt.export_working_bytes:.2f}"
    )
    assert got["cold"] <= per_element + fmt.export_worker_bytes + SLACK, (
        f"{name} grew {got['cold'] / 2**20:.1f} MiB on its first weight, planned "
        f"{(per_element + fmt.export_worker_bytes) / 2**20:.1f} MiB with its chunk buffers"
    )
    if "mse" in got:  # the search's working memory on top, as the plan adds it under mse
        planned = elements * (fmt.export_working_bytes + fmt.export_mse_working_bytes)
        planned += fmt.export_worker_bytes + fmt.mse_search_bytes(COLS)
        assert got["mse"] <= planned + SLACK, (
            f"{name} grew {got['mse'] / 2**20:.1f} MiB under mse, planned {planned / 2**20:.1f} MiB"
        )


def test_the_check_of_the_output_holds_a_scale_tensor_at_a_time_not_the_shard(measured):
    assert measured["tensors"] == 3 * MODULES  # the check read the whole shard, without a problem
    # a scale tensor at a time, the masks of its range check, the headers: under an eighth of the
    # shard (mapped, its scales' pages and those around them made most of it resident)
    shard = MODULES * SHARD_ROWS * SHARD_COLS * 9 // 16
    assert measured["check"] <= shard // 8, (
        f"reading the scales of a {shard / 2**20:.0f} MiB shard grew the resident set {measured['check'] / 2**20:.1f} MiB"
    )
