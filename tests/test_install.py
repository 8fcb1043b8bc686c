"""eprt installed from a wheel, without the clone: its console scripts run the whole pipeline
from a directory that has nothing of the source tree, and the export is the one the source
tree's own code writes."""

import hashlib
import os
import shutil
import site
import subprocess
import sys

from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.recipe import available
from eprt.quant.run.args import DEFAULT_PROMPT
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.multiproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTQ = ["--recipe", "nvfp4", "--kv-cache", "fp8", "--calib-size", "4", "--seq-len", "32"]


def files_digest(d: str) -> dict[str, str]:
    """Every file under `d` with the hash of its bytes."""
    return {
        os.path.relpath(os.path.join(root, f), d): hashlib.sha256(open(os.path.join(root, f), "rb").read()).hexdigest()
        for root, _, files in os.walk(d)
        for f in files
    }


def installed_venv(tmp_path) -> str:
    """A venv holding eprt from a wheel built from setup.py and eprt/ alone; torch and the rest come
    from the site-packages of the interpreter running the tests (a venv's, when pytest runs in one),
    whose eprt, an editable install, must not be the one imported."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(ROOT, "setup.py"), src)
    shutil.copytree(os.path.join(ROOT, "eprt"), src / "eprt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "docs"), src / "docs")
    env = clean_env()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheels"),
            str(src),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "wheels").iterdir()
    venv = str(tmp_path / "venv")
    python = os.path.join(venv, "bin", "python")
    # --system-site-packages would show the base interpreter's packages, not those of the venv pytest
    # may run in; a .pth listing this interpreter's site-packages shows exactly its own. Listed as
    # plain paths, their own .pth hooks (the editable eprt's among them) do not run in the new venv.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(purelib, "tested-interpreter.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            str(wheel),
        ],
        check=True,
        env=env,
    )
    return venv


def clean_env(venv: str | None = None) -> dict[str, str]:
    """The environment without the source tree on PYTHONPATH, with `venv`'s scripts first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if venv:
        env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env["PATH"]
        env["VIRTUAL_ENV"] = venv
    return env


def test_console_scripts_of_a_wheel_run_the_pipeline_from_anywhere(tmp_path):
    venv = installed_venv(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = clean_env(venv)
    python = os.path.join(venv, "bin", "python")

    def sh(*args, check=True):
        r = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True)
        assert r.returncode == 0 or not check, f"{' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}"
        return r

    where = sh(python, "-c", "import eprt; print(eprt.__file__)").stdout.strip()
    assert where.startswith(os.path.join(venv, "lib")), where
    assert sh("eprt-make-tiny", "qwen3_moe", "hf").stdout.strip() == "hf"
    sh("eprt-convert", "hf", "ck", "--no-progress")
    # the README's form, two local ranks, with the preview; and torchrun's -m, world 1
    ptq = sh("eprt-ptq", "--nproc-per-node", "2", "ck", *PTQ, "--preview", "--out", "q")
    assert "[eprt rank 0] before: 'The river ran low" in ptq.stderr
    assert "[eprt rank 0] after (nvfp4, fake-quantized)" in ptq.stderr
    assert "[eprt rank 1] before" not in ptq.stderr  # one voice, rank 0's
    torchrun = [python, "-m", "torch.distributed.run"]
    dry = sh(*torchrun, "--nproc-per-node", "1", f"--master-port={free_port()}", "-m", "eprt.ptq", "ck", "--dry-run")
    assert "world 1 = edp 1 x ep 1" in dry.stdout
    sh("eprt-export", "q", "out", "--no-progress")
    assert sh("eprt-check", "out").stdout.strip() == "out: ok"
    refused = sh("eprt-ptq", "ck", "--recipe", "int3", "--out", "q2", check=False)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    # the wheel ships every recipe of the source tree
    assert refused.stderr.startswith(f"error: --recipe 'int3': no such recipe; choose one of {', '.join(available())} ")

    # the wheel ships every page of docs/, which eprt-docs lists and prints as written
    pages = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
    assert [line.split()[0] for line in sh("eprt-docs").stdout.splitlines()] == pages
    with open(os.path.join(ROOT, "docs", "quickstart.md"), encoding="utf-8") as f:
        assert sh("eprt-docs", "quickstart").stdout == f.read()
    assert "eprt-docs export" in sh("eprt-export", "--help").stdout

    # the same pipeline by the source tree's code, in this process: the same bytes
    hf = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            "nvfp4",
            str(tmp_path / "q"),
            kv_cache="fp8",
            calib_size=4,
            seq_len=32,
            preview=DEFAULT_PROMPT,
            progress=False,
        ),
    )
    want = files_digest(export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False))
    assert files_digest(str(work / "out")) == want
