"""The prepared GPU check (`make gpu-check`): eprt's CUDA tests and GPU benchmarks in one run of at most 8 minutes.

    python3 bench/gpu_check.py [--budget 470] [--json PATH] [--wheels DIR] [--cpu] [--select EXPR]

With CUDA, in order, each part a subprocess with its own time budget inside the global one:
  install      the wheels of bench/gpu_wheels.txt from --wheels that the machine lacks, then eprt
               itself (`pip install --no-deps -e .`), all without network; then an import check
  cuda_tests   pytest tests/test_cuda.py tests/test_kernels.py on the GPU: Triton grouped GEMM and
               permute/combine against the loops, bitwise batch invariance, fla's chunk_kda against
               eprt's chunked KDA, the pipeline on one GPU against the CPU's export (3 families)
  gemm_bench   bench/gpu_gemm.py: grouped GEMM TFLOP/s at DeepSeek-V3's and Qwen3-30B-A3B's shapes
  ptq_bench    bench/gpu_ptq.py: calibration tokens/s and peak GPU memory, ~2 B Qwen3-MoE, ep 1
Without CUDA (or with --cpu), the parts a CPU can run, and the JSON lists the others as skipped:
  kernel_tests_interpreted  the Triton tests of tests/test_kernels.py under TRITON_INTERPRET=1
  cpu_export                bench/gpu_pipeline.py: the CPU side of the pipeline comparison
  gemm_bench, ptq_bench     at tiny sizes

Figures go to $OUT/gpu-check.json when OUT is set, else ./gpu-check.json (rewritten after every
part, so a run cut short keeps what it measured); a summary table ends the output. Exit status:
0 when every part that ran passed, 1 when one failed or ran out of time, 2 when the machine
cannot run the check at all (no torch, a package missing that no wheel brings). `--select` narrows
the test parts to the tests a pytest -k expression picks: a rerun of the ones that failed, which
spends less of a short device lease.
"""

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_LIST = os.path.join(ROOT, "bench", "gpu_wheels.txt")
DEFAULT_BUDGET_S = 470  # 8 minutes less a margin for starting python and writing the JSON
PER_TEST_TIMEOUT_S = 180

# part: (budget in seconds, runs with CUDA, runs without). Budgets of one mode sum to at most the
# default global budget; time a part leaves unused goes to the parts after it.
PARTS = {
    "install": (45, True, False),
    "cuda_tests": (250, True, False),
    "kernel_tests_interpreted": (150, False, True),
    "cpu_export": (150, False, True),
    "gemm_bench": (70, True, True),
    "ptq_bench": (105, True, True),
}
NOT_RUN = {
    "install": "no CUDA: a CPU machine installs eprt and its test extras with `make setup-test`",
    "cuda_tests": "no CUDA: tests/test_cuda.py needs a GPU (the normal suite deselects it)",
    "kernel_tests_interpreted": "CUDA: cuda_tests runs tests/test_kernels.py on the GPU itself",
    "cpu_export": "CUDA: cuda_tests' pipeline test runs the CPU export beside the GPU's",
}
# Distributions the check needs (eprt's own requirements, and pytest with its timeout plugin), and
# those only some tests need (fla's KDA kernel, the decoding of Kimi-K3's MXFP4 experts).
REQUIRED = ("torch", "triton", "safetensors", "tokenizers", "pyyaml", "tqdm", "numpy", "pytest", "pytest-timeout")
OPTIONAL = ("fla-core", "einops", "compressed-tensors", "pydantic")


class Check:
    name = "gpu-check"
    parts = PARTS  # part: (budget in seconds, runs with CUDA, runs without)

    def __init__(
        self, start: float, budget_s: float, json_path: str, cuda: bool, wheels: str, select: str | None = None
    ):
        self.start, self.deadline = start, start + budget_s
        self.json_path, self.cuda, self.wheels, self.select = json_path, cuda, wheels, select
        self.report = {
            "schema": 1,
            "mode": "cuda" if cuda else "cpu",
            "budget_s": budget_s,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": {},
            "parts": {},
            "skipped": {},
        }
        self.env = child_env(cuda)

    def log(self, message: str) -> None:
        now = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"[{self.name} {now} +{time.monotonic() - self.start:5.1f}s] {message}", flush=True)

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.report, f, indent=2)
        os.replace(tmp, self.json_path)

    def skip(self, name: str, reason: str) -> None:
        self.report["skipped"][name] = reason
        self.report["parts"][name] = {"status": "skipped", "reason": reason}
        self.log(f"{name}: skipped ({reason})")

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, float]:
        """Run `cmd` in its own process group; on timeout kill the whole group (torchrun's
        workers too). Returns (exit status or None on timeout, seconds)."""
        self.log(
            f"{name}: {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)} "
            f"(limit {timeout:.0f} s)"
        )
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc = None
        return rc, time.monotonic() - t0

    def part(self, name: str, later: list[str], body) -> None:
        """Run part `name` within its time: its own budget, plus whatever the parts before it left
        unused, never eating into the budgets of the parts `later`."""
        budget = self.parts[name][0]
        remaining = self.deadline - time.monotonic()
        limit = min(remaining, max(budget, remaining - sum(self.parts[p][0] for p in later)))
        if limit < 10:
            self.skip(name, f"the global budget of {self.report['budget_s']} s is spent")
            self.report["parts"][name]["status"] = "not_run"
            self.save()
            return
        entry = {"status": "running", "budget_s": budget, "limit_s": round(limit)}
        self.report["parts"][name] = entry
        t0 = time.monotonic()
        try:
            status, figures = body(limit)
        except Exception as err:  # a bug of the check itself: record it, go on with the next part
            status, figures = "failed", {"error": f"{type(err).__name__}: {err}"}
        entry.update(status=status, seconds=round(time.monotonic() - t0, 1), figures=figures)
        self.log(f"{name}: {status} in {entry['seconds']} s")
        self.save()

    # --- parts -------------------------------------------------------------------------------

    def install(self, limit: float):
        figures = {"wheels_folder": os.path.relpath(self.wheels, ROOT), "installed": [], "present": []}
        wanted = wheel_requirements()
        missing = [(n, v) for n, v in wanted if not at_least(installed_version(n), v)]
        figures["present"] = [f"{n}=={installed_version(n)}" for n, v in wanted if (n, v) not in missing]
        files = []
        for n, v in missing:
            found = wheel_file(self.wheels, n, v)
            if found is None:
                figures.setdefault("no_wheel", []).append(f"{n}=={v}")
            else:
                files.append(found)
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
        ]
        spent = 0.0
        if files:
            rc, spent = self.run("install", [*pip, *files], limit * 0.6)
            if rc != 0:
                return "failed", {**figures, "error": f"pip install of the wheels exited {rc}"}
            figures["installed"] = [os.path.basename(f) for f in files]
        # No build isolation: it would fetch setuptools from an index the machine cannot reach.
        rc, _ = self.run("install", [*pip, "--no-build-isolation", "-e", ROOT], limit - spent)
        figures["eprt_editable_install"] = (
            "ok" if rc == 0 else f"pip exited {rc} (eprt still imports through PYTHONPATH)"
        )
        return ("passed" if rc == 0 and "no_wheel" not in figures else "failed"), figures

    def cuda_tests(self, limit: float):
        return self.pytest("cuda_tests", ["tests/test_cuda.py", "tests/test_kernels.py"], limit)

    def kernel_tests_interpreted(self, limit: float):
        return self.pytest(
            "kernel_tests_interpreted", ["tests/test_kernels.py"], limit, "triton and not without_triton"
        )

    def selected(self, within: str | None) -> list[str]:
        """pytest's -k for a test part: its own selection `within`, narrowed by --select."""
        picks = [f"({e})" for e in (within, self.select) if e]
        return ["-k", " and ".join(picks)] if picks else []

    def pytest(self, name: str, args: list[str], limit: float, within: str | None = None):
        with tempfile.TemporaryDirectory() as d:
            junit = os.path.join(d, "junit.xml")
            rc, _ = self.run(
                name,
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-rfE",
                    "-p",
                    "no:cacheprovider",
                    f"--timeout={PER_TEST_TIMEOUT_S}",
                    "-o",
                    "junit_family=xunit1",
                    f"--junitxml={junit}",
                    *args,
                    *self.selected(within),
                ],
                limit,
            )
            figures = junit_figures(junit) if os.path.exists(junit) else {"error": "pytest wrote no report"}
        if rc is None:
            return "timeout", figures
        ok = (
            rc == 0 and figures.get("failed", 1) == 0 and figures.get("errors", 1) == 0 and figures.get("passed", 0) > 0
        )
        return ("passed" if ok else "failed"), figures

    def script(self, name: str, args: list[str], limit: float):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "figures.json")
            rc, _ = self.run(name, [sys.executable, *args, "--json", out], limit)
            figures = json.load(open(out)) if rc == 0 and os.path.exists(out) else {}
        if rc is None:
            return "timeout", figures
        if not figures:
            return "failed", {"error": f"exited {rc}" + (" without writing its figures" if rc == 0 else "")}
        return ("passed" if rc == 0 else "failed"), figures

    def cpu_export(self, limit: float):
        return self.script("cpu_export", ["bench/gpu_pipeline.py"], limit)

    def gemm_bench(self, limit: float):
        return self.script("gemm_bench", ["bench/gpu_gemm.py"] + ([] if self.cuda else ["--tiny"]), limit)

    def ptq_bench(self, limit: float):
        return self.script("ptq_bench", ["bench/gpu_ptq.py"] + ([] if self.cuda else ["--tiny"]), limit)


# --- the environment ---------------------------------------------------------------------------


def child_env(cuda: bool) -> dict:
    """The children's environment: eprt from this tree first; without CUDA, no GPU at all and
    Triton's interpreter (Triton reads TRITON_INTERPRET when a kernel is defined)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    if not cuda:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def probe(env: dict) -> dict:
    """Versions and the device, read by a fresh interpreter with the children's environment.
    Packages are looked up by their metadata (fast); torch and eprt are imported."""
    code = (
        "import json, os, platform, sys\n"
        "from importlib import metadata\n"
        "out = {'python': platform.python_version(), 'executable': sys.executable, 'cpus': os.cpu_count(),\n"
        "       'packages': {}, 'missing': []}\n"
        f"for name in {list(REQUIRED) + list(OPTIONAL) + ['transformers']!r}:\n"
        "    try:\n"
        "        out['packages'][name] = metadata.version(name)\n"
        "    except metadata.PackageNotFoundError:\n"
        "        out['missing'].append(name)\n"
        "import torch\n"
        "out['torch_cuda'] = torch.version.cuda\n"
        "out['cuda_available'] = torch.cuda.is_available()\n"
        "if out['cuda_available']:\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    out['device'] = {'name': p.name, 'capability': list(torch.cuda.get_device_capability(0)),\n"
        "                     'memory_gib': round(p.total_memory / 2**30, 1), 'count': torch.cuda.device_count()}\n"
        "import eprt\n"
        "out['eprt'] = eprt.__file__\n"
        "print('PROBE ' + json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        print(f"gpu-check: {sys.executable} cannot import torch and eprt:\n{r.stderr[-2000:]}", file=sys.stderr)
        sys.exit(2)
    return json.loads(line[len("PROBE ") :])


def wheel_requirements() -> list[tuple[str, str]]:
    """(distribution, version) pairs of bench/gpu_wheels.txt."""
    out = []
    for line in open(WHEEL_LIST):
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out.append((name.strip(), version.strip()))
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_file(folder: str, name: str, version: str) -> str | None:
    if not os.path.isdir(folder):
        return None
    for f in sorted(os.listdir(folder)):
        parts = f.split("-")
        if f.endswith(".whl") and len(parts) >= 2 and normalize(parts[0]) == normalize(name) and parts[1] == version:
            return os.path.join(folder, f)
    return None


def installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def at_least(have: str | None, want: str) -> bool:
    if have is None:
        return False
    try:
        from packaging.version import Version
    except ImportError:
        return have == want
    return Version(have) >= Version(want)


def junit_figures(path: str) -> dict:
    """Counts, and per test its outcome, seconds and the figures it recorded (record_property)."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").strip().splitlines()
                break
        entry = {
            "id": f"{case.get('classname', '')}::{case.get('name')}",
            "outcome": outcome,
            "seconds": round(float(case.get("time", 0)), 2),
        }
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            entry["figures"] = props
        if outcome != "passed":
            entry["message"] = message[0][:300] if message else ""
        tests.append(entry)
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "errors", "skipped")}
    return {**counts, "tests": tests}


# --- the summary -------------------------------------------------------------------------------


def summary(report: dict) -> str:
    lines = [
        f"gpu-check ({report['mode']} mode) in {report.get('elapsed_s', 0)} s of {report['budget_s']} s",
        f"{'part':26} {'status':8} {'s':>6}  figures",
    ]
    for name, p in report["parts"].items():
        lines.append(f"{name:26} {p['status']:8} {p.get('seconds', 0):6.1f}  {headline(name, p)}")
    return "\n".join(lines)


def headline(name: str, p: dict) -> str:
    f = p.get("figures") or {}
    if p["status"] in ("skipped", "not_run"):
        return p.get("reason", "")
    if "error" in f:
        return f["error"][:100]
    if name in ("cuda_tests", "kernel_tests_interpreted"):
        bad = [t["id"].rsplit("::", 1)[-1] for t in f.get("tests", []) if t["outcome"] != "passed"]
        return f"{f['passed']} passed, {f['failed']} failed, {f['errors']} errors, {f['skipped']} skipped" + (
            f"; not passed: {', '.join(bad[:4])}" if bad else ""
        )
    if name == "gemm_bench":
        return "; ".join(
            f"{r['shape']} {r['projection']} T={r['tokens']}: {r.get('grouped_mm_tflops', 0):.1f} TF/s "
            f"({r.get('vs_dense_mm', 0):.2f}x dense, {r.get('vs_torch_grouped_mm', 0):.2f}x _grouped_mm)"
            for r in f.get("rows", [])[:8]
        )
    if name == "ptq_bench" and "tokens_per_s" in f:
        return (
            f"{f['model']['parameters'] / 1e6:.0f} M params: {f['tokens_per_s']:.0f} tokens/s, "
            f"peak {f['peak_memory_bytes'] / 2**30:.2f} GiB ({f['peak_vs_weights']:.2f}x weights)"
        )
    if name == "cpu_export":
        return ", ".join(f"{fam} {v['tensors']} tensors" for fam, v in f.items())
    if name == "install":
        return f"installed {len(f.get('installed', []))} wheels; eprt {f.get('eprt_editable_install', '-')}"
    return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole check")
    p.add_argument("--json", help="where the figures go (default $OUT/gpu-check.json, else ./gpu-check.json)")
    p.add_argument("--wheels", default=os.path.join(ROOT, "wheels"), help="folder of the wheels to install")
    p.add_argument("--cpu", action="store_true", help="the CPU mode even where CUDA is there")
    p.add_argument("--select", metavar="EXPR", help="run only the tests of this pytest -k expression in the test parts")
    a = p.parse_args()
    json_path = os.path.abspath(a.json or os.path.join(os.environ.get("OUT") or ".", "gpu-check.json"))
    os.makedirs(os.path.dirname(json_path), exist_ok=True)

    start = time.monotonic()
    facts = probe(child_env(cuda=not a.cpu))
    cuda = facts["cuda_available"] and not a.cpu
    check = Check(start, a.budget, json_path, cuda=cuda, wheels=os.path.abspath(a.wheels), select=a.select)
    check.report["environment"] = facts
    check.log(
        f"{sys.executable}: python {facts['python']}, torch {facts['packages'].get('torch')} "
        f"(CUDA {facts['torch_cuda']}), triton {facts['packages'].get('triton')}, "
        + (f"{facts['device']['name']} x{facts['device']['count']}" if cuda else "no CUDA: the CPU mode")
    )
    order = [n for n, (_, with_cuda, without) in PARTS.items() if (with_cuda if cuda else without)]
    for name in PARTS:
        if name not in order:
            check.skip(name, NOT_RUN.get(name, ""))
    check.save()
    for i, name in enumerate(order):
        check.part(name, order[i + 1 :], getattr(check, name))
        if name == "install":
            facts = probe(check.env)
            check.report["environment"] = facts
            missing = [m for m in facts["missing"] if m in REQUIRED]
            if missing:
                check.log(
                    f"cannot go on: {', '.join(missing)} missing; list a wheel of each in bench/gpu_wheels.txt "
                    f"and bring it in {os.path.relpath(check.wheels, ROOT)}/ (docs/gpu-check.md)"
                )
                check.report["parts"]["install"]["status"] = "failed"
                check.save()
                print(summary(check.report))
                return 2
            for m in facts["missing"]:
                if m in OPTIONAL:
                    check.log(f"warning: {m} is missing: the tests that need it will fail")
    check.save()
    print(summary(check.report), flush=True)
    check.log(f"figures in {json_path}")
    ran = [p for p in check.report["parts"].values() if p["status"] not in ("skipped",)]
    return 0 if all(p["status"] == "passed" for p in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
