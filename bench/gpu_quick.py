"""The quick GPU check (`make gpu-quick`): what would break on a first GPU node, in about six minutes.

    python3 bench/gpu_quick.py [--cpu] [--rerun] [--steps S1,S2] [--cap STEP=SECONDS] [--json PATH]

Steps, from the cheapest to the most telling, each a subprocess capped at its own time and killed
with everything it started (torchrun's ranks too) at its cap:
  environment  versions and the device; without CUDA it fails at once (not a silent CPU run)
               unless --cpu asks for the CPU mode
  install      the wheels of bench/gpu_wheels.txt from wheels/ the machine lacks, then eprt, without
               network (CUDA only)
  kernels      the Triton grouped GEMM at real expert shapes and its bitwise batch invariance,
               permute and combine at DeepSeek-V3's routing size (tests/test_cuda.py; in CPU mode one
               case of each Triton test under TRITON_INTERPRET=1)
  layouts      world 1 against world 2 on the one device, the same export bytes (bench/gpu_layouts.py)
  memory       the memory plan against the allocator's peak (allocated and reserved), and the time
               estimate against the measured calibration, on a ~2 B Qwen3-MoE (bench/gpu_ptq.py),
               made on the CPU in the background while the steps before it run
  gemm         the grouped GEMM against cuBLAS and torch._grouped_mm (bench/gpu_gemm.py)
  gptq         GPTQ's Hessians and solve on the device, world 1 against world 2, the same bytes
  kda          fla's chunk_kda against eprt's chunked KDA (CUDA only)

The figures go to $OUT/gpu-quick.json (else ./gpu-quick.json), rewritten after every step, so a
lease that ends early keeps what was measured. --rerun reads that file and runs only the steps that
did not pass, keeping the others' figures. Exit status: 0 when every step that ran passed, 1 when
one failed or reached its cap, 2 when the machine cannot run the check (no CUDA without --cpu, no
torch, a required package missing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_check import OPTIONAL, REQUIRED, ROOT, Check, child_env, probe  # noqa: E402

# step: (cap with CUDA, cap in the CPU mode; None: not run in that mode), in the order they run
STEPS = {
    "environment": (30, 30),
    "install": (40, None),
    "kernels": (55, 60),
    "layouts": (60, 75),
    "memory": (90, 45),
    "gemm": (35, 30),
    "gptq": (60, 75),
    "kda": (40, None),
}
NOT_IN_CPU_MODE = {
    "install": "the CPU mode: a CPU machine installs eprt and its test extras with `make setup-test`",
    "kda": "the CPU mode: fla's kernels need CUDA (tests/oracles/test_kimi_models.py checks eprt's own KDA on the CPU)",
}
CUDA_KERNEL_TESTS = "grouped_mm or permute_and_combine or block_fp8"
INTERPRETED_KERNEL_TESTS = "(triton and not without_triton) and (one_row or 7-5 or top1 or small_blocks)"


class QuickCheck(Check):
    name = "gpu-quick"

    def __init__(self, *args, caps: dict[str, float], **kw):
        super().__init__(*args, **kw)
        self.caps = caps
        self.report["schema"] = "gpu-quick/1"
        self.report["steps"] = self.report.pop("parts")
        self.model_dir = tempfile.mkdtemp(prefix="eprt-gpu-quick-")
        self.maker: subprocess.Popen | None = None

    def skip(self, name: str, reason: str) -> None:
        self.report["skipped"][name] = reason
        self.report["steps"][name] = {"status": "skipped", "reason": reason}
        self.log(f"{name}: skipped ({reason})")

    def step(self, name: str, body) -> None:
        """Run step `name` within its cap (or what the global budget has left), record it, save."""
        left = self.deadline - time.monotonic()
        cap = min(self.caps[name], left)
        if left < 5:
            self.skip(name, f"the global budget of {self.report['budget_s']} s is spent")
            self.report["steps"][name]["status"] = "not_run"
            self.save()
            return
        entry = {"status": "running", "cap_s": round(cap)}
        self.report["steps"][name] = entry
        self.save()
        t0 = time.monotonic()
        try:
            status, figures = body(cap)
        except Exception as err:  # a bug of the check itself: recorded, and the next step runs
            status, figures = "failed", {"error": f"{type(err).__name__}: {err}"}
        entry.update(status=status, seconds=round(time.monotonic() - t0, 1), figures=figures)
        self.log(f"{name}: {status} in {entry['seconds']} s")
        self.save()

    # --- the test model, made on the CPU in the background -----------------------------------------

    def start_model(self) -> None:
        cmd = [sys.executable, "bench/gpu_ptq.py", "--make", self.model_dir] + ([] if self.cuda else ["--tiny"])
        env = {**self.env, "CUDA_VISIBLE_DEVICES": ""}  # made on the CPU, beside the GPU's steps
        self.log(f"making the test model in the background: {' '.join(cmd[1:])}")
        log = open(os.path.join(self.model_dir, "make.log"), "w")
        self.maker = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop_model(self) -> None:
        if self.maker is not None and self.maker.poll() is None:
            os.killpg(self.maker.pid, signal.SIGKILL)
            self.maker.wait()

    # --- steps -----------------------------------------------------------------------------------

    def kernels(self, cap: float):
        if self.cuda:
            return self.pytest("kernels", ["tests/test_cuda.py"], cap, CUDA_KERNEL_TESTS)
        return self.pytest("kernels", ["tests/test_kernels.py"], cap, INTERPRETED_KERNEL_TESTS)

    def layouts(self, cap: float):
        return self.script("layouts", ["bench/gpu_layouts.py"], cap)

    def gptq(self, cap: float):
        return self.script("gptq", ["bench/gpu_layouts.py", "--algorithm", "gptq"], cap)

    def memory(self, cap: float):
        start = time.monotonic()
        if self.maker is None:
            self.start_model()
        try:
            rc = self.maker.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            return "timeout", {"error": "the test model was not made within the step's cap"}
        if rc != 0:
            return "failed", {"error": f"making the test model exited {rc} (its log: {self.model_dir}/make.log)"}
        args = ["bench/gpu_ptq.py", "--checkpoint", self.model_dir] + ([] if self.cuda else ["--tiny"])
        return self.script("memory", args, cap - (time.monotonic() - start))

    def gemm(self, cap: float):
        return self.script("gemm", ["bench/gpu_gemm.py"] + ([] if self.cuda else ["--tiny"]), cap)

    def kda(self, cap: float):
        return self.pytest("kda", ["tests/test_cuda.py"], cap, "fla_chunk_kda")


def environment_step(check: QuickCheck, facts: dict) -> None:
    """The environment as a step of its own: passed when the required packages are there."""
    missing = [m for m in facts["missing"] if m in REQUIRED]
    check.report["environment"] = facts
    check.report["steps"]["environment"] = {
        "status": "failed" if missing else "passed",
        "seconds": round(time.monotonic() - check.start, 1),
        "figures": {"missing_required": missing, "missing_optional": [m for m in facts["missing"] if m in OPTIONAL]},
    }
    check.save()


def summary(report: dict) -> str:
    lines = [
        f"gpu-quick ({report['mode']} mode) in {report.get('elapsed_s', 0)} s",
        f"{'step':12} {'status':8} {'s':>6}",
    ]
    for name, s in report["steps"].items():
        note = s.get("reason") or (s.get("figures") or {}).get("error", "")
        kept = " (kept from the last run)" if s.get("kept_from_last_run") else ""
        lines.append(f"{name:12} {s['status']:8} {s.get('seconds', 0):6.1f}  {note[:100]}{kept}")
    return "\n".join(lines)


def previous(json_path: str) -> dict:
    """The steps of the last run's JSON that passed, for --rerun; {} where there is none."""
    try:
        with open(json_path) as f:
            steps = json.load(f).get("steps", {})
    except (OSError, ValueError):
        return {}
    return {n: s for n, s in steps.items() if s.get("status") == "passed"}


def parse_caps(items: list[str], cuda: bool) -> dict[str, float]:
    caps = {n: (c if cuda else p) for n, (c, p) in STEPS.items() if (c if cuda else p) is not None}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in STEPS or not seconds:
            raise SystemExit(f"--cap {item}: give STEP=SECONDS, STEP one of {', '.join(STEPS)}")
        caps[name] = float(seconds)
    return caps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the CPU mode: the same steps a CPU can run, on the CPU")
    p.add_argument("--rerun", action="store_true", help="run only the steps the last run's JSON has not passed")
    p.add_argument("--steps", help="run only these steps (comma-separated), in their own order")
    p.add_argument("--cap", action="append", default=[], metavar="STEP=SECONDS", help="another cap for a step")
    p.add_argument("--budget", type=float, default=440, help="seconds for the whole check")
    p.add_argument("--json", help="where the figures go (default $OUT/gpu-quick.json, else ./gpu-quick.json)")
    p.add_argument("--wheels", default=os.path.join(ROOT, "wheels"), help="folder of the wheels to install")
    a = p.parse_args()
    json_path = os.path.abspath(a.json or os.path.join(os.environ.get("OUT") or ".", "gpu-quick.json"))
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    kept = previous(json_path) if a.rerun else {}

    start = time.monotonic()
    facts = probe(child_env(cuda=not a.cpu))
    cuda = facts["cuda_available"] and not a.cpu
    caps = parse_caps(a.cap, cuda)
    check = QuickCheck(start, a.budget, json_path, cuda=cuda, wheels=os.path.abspath(a.wheels), caps=caps)
    check.report["steps"].update({n: {"status": "pending"} for n in STEPS})  # in their order, until each runs
    check.report["steps"].update({n: {**s, "kept_from_last_run": True} for n, s in kept.items()})
    environment_step(check, facts)
    if not cuda and not a.cpu:
        reason = (
            f"no usable CUDA device (torch {facts['packages'].get('torch')}, built for CUDA {facts['torch_cuda']}): "
            "the check stops here; run with --cpu for the CPU mode"
        )
        check.report["steps"]["environment"].update(status="failed", reason=reason)
        check.save()
        print(f"gpu-quick: {reason}", file=sys.stderr)
        return 2
    if check.report["steps"]["environment"]["status"] != "passed" and not cuda:
        print(f"gpu-quick: {', '.join(facts['missing'])} missing", file=sys.stderr)
        return 2
    chosen = set(a.steps.split(",")) if a.steps else set(STEPS)
    order = [n for n in STEPS if n != "environment" and n in chosen and n in caps and n not in kept]
    for name in STEPS:
        if name not in caps:
            check.skip(name, NOT_IN_CPU_MODE[name])
        elif name not in chosen and name not in kept and name != "environment":
            check.skip(name, "not among --steps")
    try:
        if "memory" in order:  # made on the CPU while the steps before it run
            check.start_model()
        for name in order:
            if name != "install":
                check.step(name, getattr(check, name))
                continue
            check.step(name, check.install)
            facts = probe(check.env)
            environment_step(check, facts)
            if check.report["steps"]["environment"]["status"] != "passed":
                check.log(f"cannot go on: {', '.join(facts['missing'])} missing (docs/gpu-check.md)")
                return 2
    finally:
        check.stop_model()
    check.save()
    print(summary(check.report), flush=True)
    check.log(f"figures in {json_path}")
    ran = [s for n, s in check.report["steps"].items() if s["status"] != "skipped"]
    return 0 if all(s["status"] == "passed" for s in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
