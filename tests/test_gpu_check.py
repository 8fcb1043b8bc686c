"""`make gpu-check` where there is no GPU: bench/gpu_check.py runs the parts a CPU can run, names the
others as skipped, keeps to its time budget, and writes every figure to its JSON. (On a GPU the
same script runs tests/test_cuda.py and the GPU benchmarks.)"""

import json
import os
import subprocess
import sys
import time

from bench.gpu_check import Check, child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_PARTS = {"install", "cuda_tests", "kernel_tests_interpreted", "cpu_export", "gemm_bench", "ptq_bench"}
CPU_PARTS = {"kernel_tests_interpreted", "cpu_export", "gemm_bench", "ptq_bench"}


def gpu_check(tmp_path, *args):
    """The script as the Makefile runs it, with $OUT set as on the GPU machine, to a folder that does
    not exist yet (the script makes it)."""
    out = tmp_path / "out" / "gpu"
    r = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OUT": str(out)},
    )
    return r, json.load(open(out / "gpu-check.json"))


# one case of each Triton test: the suite runs them all in tests/test_kernels.py
ONE_CASE_EACH = "one_row or 7-5 or top1 or small_blocks or combine_ignores"


def test_cpu_mode_runs_what_a_cpu_can_and_names_the_rest(tmp_path):
    r, report = gpu_check(tmp_path, "--select", ONE_CASE_EACH)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert set(report) == {"schema", "mode", "budget_s", "started", "elapsed_s", "environment", "parts", "skipped"}
    assert report["mode"] == "cpu" and report["environment"]["cuda_available"] is False
    parts = report["parts"]
    assert set(parts) == ALL_PARTS
    assert {n for n, p in parts.items() if p["status"] == "passed"} == CPU_PARTS
    assert set(report["skipped"]) == ALL_PARTS - CPU_PARTS
    assert all("no CUDA" in reason for reason in report["skipped"].values())

    kernels = parts["kernel_tests_interpreted"]["figures"]
    assert kernels["passed"] > 0 and kernels["failed"] == kernels["errors"] == kernels["skipped"] == 0
    assert all("triton" in t["id"] and t["outcome"] == "passed" for t in kernels["tests"])
    # --select narrowed the part's own selection (every Triton test of tests/test_kernels.py) to one case each
    assert {t["id"].split("::")[1] for t in kernels["tests"]} == {
        "test_triton_matches_fallback_and_loop[one_row-torch.float32]",
        "test_triton_matches_fallback_and_loop[one_row-torch.bfloat16]",
        "test_triton_small_blocks_match_loop",
        "test_triton_batch_invariant[7-5-torch.float32]",
        "test_triton_batch_invariant[7-5-torch.bfloat16]",
        "test_triton_batch_invariant_small_blocks",
        "test_permute_matches_loop[top1-triton]",
        "test_combine_matches_loop_bitwise[top1-triton]",
        "test_combine_ignores_where_copies_sit[triton]",
    }

    exports = parts["cpu_export"]["figures"]
    assert set(exports) == {"qwen3_moe", "deepseek_v3", "kimi_k3"}
    assert all(e["tensors"] > 0 and e["bytes"] > 0 for e in exports.values())

    rows = parts["gemm_bench"]["figures"]["rows"]
    assert {r["projection"] for r in rows} == {"gate_up", "down"}
    for row in rows:
        assert row["grouped_mm_tflops"] > 0 and row["dense_mm_tflops"] > 0 and row["vs_dense_mm"] > 0
        assert ("torch_grouped_mm_tflops" in row) != ("torch_grouped_mm_error" in row)

    ptq = parts["ptq_bench"]["figures"]
    assert ptq["calibration_tokens"] == 8 * 64 and ptq["tokens_per_s"] > 0
    assert ptq["peak_memory_bytes"] > 0 and ptq["model"]["parameters"] > 0

    table = r.stdout[r.stdout.index("gpu-check (cpu mode)") :]
    for name in ALL_PARTS:
        assert name in table


def test_a_spent_budget_runs_no_part_and_fails(tmp_path):
    r, report = gpu_check(tmp_path, "--budget", "1")
    assert r.returncode == 1
    assert {n for n, p in report["parts"].items() if p["status"] == "not_run"} == CPU_PARTS
    assert all("budget" in report["skipped"][n] for n in CPU_PARTS)


def test_a_part_out_of_time_is_killed_with_its_children(tmp_path):
    """torchrun's workers, pytest's subprocesses: nothing a part started outlives its limit."""
    pid_file = tmp_path / "grandchild"
    check = Check(time.monotonic(), 60, str(tmp_path / "out.json"), cuda=False, wheels=str(tmp_path))
    rc, seconds = check.run(
        "sleeper", ["sh", "-c", f"sleep 120 & echo $! > {pid_file}; wait"], timeout=3, env=child_env(cuda=False)
    )
    assert rc is None and seconds < 20
    grandchild = int(pid_file.read_text())
    # SIGKILL is sent by then; on loaded cores the process may take a moment to be scheduled and die
    deadline = time.monotonic() + 10
    while (state := process_state(grandchild)) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state in ("gone", "Z")


def process_state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    except FileNotFoundError:
        return "gone"
