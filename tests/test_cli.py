"""What every command shares (eprt/cli.py): logging is the command's to configure, once, and never
the library's; a launched rank files its one-line verdict where its launcher reads it."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_the_library_leaves_logging_to_the_command(tmp_path):
    """A library that configured its logger on first use would let whichever caller came first decide."""
    r = python(
        "import logging, sys\n"
        "from eprt.hf.convert import convert_hf\n"
        "from eprt.testing.tiny import make_tiny\n"
        "from eprt.cli import run\n"
        f"convert_hf(make_tiny('qwen3_moe', {str(tmp_path / 'hf')!r}), {str(tmp_path / 'ck')!r}, progress=False)\n"
        "log = logging.getLogger('eprt')\n"
        "assert log.handlers == [] and log.level == logging.NOTSET, (log.handlers, log.level)\n"
        "run(lambda: log.info('once'))\n"
        "run(lambda: log.info('twice'))\n"
        "assert len(log.handlers) == 1, log.handlers\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["[eprt rank 0] once", "[eprt rank 0] twice"]


def test_a_launched_rank_files_its_refusal_for_the_launcher(tmp_path):
    verdict = tmp_path / "error.json"
    r = python(
        "from eprt.cli import run\nfrom eprt.errors import ConfigError\n"
        "def main():\n    raise ConfigError('field x is wrong: fix it')\nrun(main)\n",
        env={"TORCHELASTIC_ERROR_FILE": str(verdict), "RANK": "1", "WORLD_SIZE": "2"},
    )
    assert r.returncode == 2 and r.stderr == "error (rank 1 of 2): field x is wrong: fix it\n"
    filed = json.loads(verdict.read_text())
    assert filed["message"] == "field x is wrong: fix it" and filed["timestamp"] == int(filed["eprt_time"])
