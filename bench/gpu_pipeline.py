"""The whole pipeline on tiny models, on the CPU and on one GPU, and the comparison of the two exports.

    python bench/gpu_pipeline.py --json OUT.json     # the CPU side for every family (what the GPU side is held to)

tests/test_cuda.py runs both sides and compares them; `make gpu-check` runs this file's CPU side
where there is no GPU, so that the code the GPU test relies on keeps running in CI.

Weights and weight scales depend on the weights alone, so the GPU export must equal the CPU's bit
for bit. Input, key and value scales come from activations, which the GPU computes with other
kernels (Triton, cuBLAS, fla's KDA) in another order: they are held to a relative tolerance.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.hf_utils import read_hf_tensors  # noqa: E402

# family -> make_tiny's source format: Kimi-K3 as it ships (MXFP4 routed experts, decoded at load).
FAMILIES = {"qwen3_moe": None, "deepseek_v3": None, "kimi_k3": "mxfp4"}
RECIPE, KV_CACHE, CALIB_SIZE, SEQ_LEN = "nvfp4", "fp8", 8, 64
# Tensors computed from activations; everything else in an export comes from the weights alone.
ACTIVATION_SCALES = ("input_scale", "k_scale", "v_scale")
ACTIVATION_RTOL = 0.05
GPU_PTQ_TIMEOUT_S = 240


def checkpoint(family: str, directory: str) -> str:
    """The tiny `family` as an eprt checkpoint under `directory`."""
    hf = make_tiny(family, os.path.join(directory, "hf"), source_format=FAMILIES[family])
    return convert_hf(hf, os.path.join(directory, "ck"), progress=False)


def cpu_export(ck: str, directory: str) -> str:
    """Calibrate in this process on the CPU (a world of one) and export."""
    q = os.path.join(directory, "q-cpu")
    run_ptq(
        ParallelState.single("cpu"),
        PTQArgs(ck, RECIPE, q, kv_cache=KV_CACHE, calib_size=CALIB_SIZE, seq_len=SEQ_LEN, progress=False),
    )
    return export_hf(q, os.path.join(directory, "export-cpu"), progress=False)


def gpu_export(ck: str, directory: str) -> str:
    """Calibrate with tools/ptq.py under torchrun, one process on GPU 0, and export on the CPU."""
    q = os.path.join(directory, "q-gpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        os.path.join(ROOT, "tools", "ptq.py"),
        ck,
        "--recipe",
        RECIPE,
        "--kv-cache",
        KV_CACHE,
        "--calib-size",
        str(CALIB_SIZE),
        "--seq-len",
        str(SEQ_LEN),
        "--out",
        q,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=GPU_PTQ_TIMEOUT_S, env=env)
    if r.returncode:
        raise RuntimeError(f"tools/ptq.py on the GPU exited {r.returncode}:\n{r.stderr[-4000:]}")
    return export_hf(q, os.path.join(directory, "export-gpu"), progress=False)


def compare_exports(cpu_dir: str, gpu_dir: str) -> dict:
    """Figures of the comparison; raises AssertionError naming the first tensor that breaks it.

    Every tensor name on both sides; weights and weight scales equal bit for bit; activation
    scales within ACTIVATION_RTOL of the CPU's."""
    cpu, gpu = read_hf_tensors(cpu_dir), read_hf_tensors(gpu_dir)
    assert set(cpu) == set(gpu), (
        f"tensor names differ: only on the CPU {sorted(set(cpu) - set(gpu))[:5]}, "
        f"only on the GPU {sorted(set(gpu) - set(cpu))[:5]}"
    )
    worst, worst_name, exact = 0.0, None, 0
    for name in sorted(cpu):
        a, b = cpu[name], gpu[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        )
        if name.endswith(ACTIVATION_SCALES):
            rel = ((a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-30)).max().item()
            assert rel <= ACTIVATION_RTOL, f"{name}: GPU {b.tolist()} vs CPU {a.tolist()} ({rel:.3%} apart)"
            if rel >= worst:
                worst, worst_name = rel, name
        else:
            assert torch_equal(a, b), f"{name}: the GPU export's bytes differ from the CPU export's"
            exact += 1
    return {
        "tensors": len(cpu),
        "bitwise_equal": exact,
        "activation_scales": len(cpu) - exact,
        "activation_scale_max_rel_diff": worst,
        "activation_scale_worst": worst_name,
    }


def torch_equal(a, b) -> bool:
    """Equal bytes (NaN-safe, and defined for the float8 and uint8 dtypes an export holds)."""
    return a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where to write the figures")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = p.parse_args()
    figures = {}
    for family in args.families:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            out = cpu_export(checkpoint(family, d), d)
            tensors = read_hf_tensors(out)
            figures[family] = {
                "tensors": len(tensors),
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "seconds": round(time.perf_counter() - start, 2),
            }
        print(
            f"{family}: CPU export of {figures[family]['tensors']} tensors in {figures[family]['seconds']} s",
            flush=True,
        )
    with open(args.json, "w") as f:
        json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
