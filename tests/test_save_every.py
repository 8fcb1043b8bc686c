"""--save-every N: the work directory holds a boundary every N-th layer, a killed run resumes from the
last one saved and exports the same bytes; 0 saves nothing, and --resume is then refused."""

import os
import subprocess
import sys

import pytest

from eprt.hf.convert import convert_hf
from eprt.parallel import ParallelState
from eprt.parallel.guard import RankFailure
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.save_time import saves
from eprt.quant.run.workdir import WorkDir
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import same_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def args(ck, out, **kw):
    return PTQArgs(ck, "nvfp4", out, calib_size=6, seq_len=24, group_tokens=48, progress=False, **kw)


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_every")
    return convert_hf(make_tiny("deepseek_v3", str(root / "hf"), num_hidden_layers=5), str(root / "ck"), progress=False)


class Killed(Exception):
    pass


@pytest.mark.parametrize("every", [0, 2, 3])
def test_saves_every_nth_layer_and_resumes_from_the_last(ck, tmp_path, monkeypatch, every):
    run_ptq(ParallelState.single("cpu"), args(ck, str(tmp_path / "whole")))
    saved, save = [], WorkDir.save
    monkeypatch.setattr(
        WorkDir, "save", lambda self, layer, *a, **kw: saved.append(layer) or save(self, layer, *a, **kw)
    )
    run_layer = LayerEngine.run_layer

    def dying(self, i, ls, pb):
        if i == 4:
            raise Killed
        return run_layer(self, i, ls, pb)

    out = str(tmp_path / "q")
    monkeypatch.setattr(LayerEngine, "run_layer", dying)
    with pytest.raises(RankFailure, match="Killed"):
        run_ptq(ParallelState.single("cpu"), args(ck, out, save_every=every))
    assert saved == [i for i in range(4) if every and (i + 1) % every == 0]
    assert saves(5, every) == len([i for i in range(5) if every and (i + 1) % every == 0])
    rank_dir = os.path.join(out + ".work", "rank-00000")
    kept = sorted(os.listdir(rank_dir)) if os.path.isdir(rank_dir) else []
    assert kept == ([f"layer-{saved[-1]:05d}.safetensors"] if saved else [])
    monkeypatch.setattr(LayerEngine, "run_layer", run_layer)
    if not every:
        return
    resumed = run_ptq(ParallelState.single("cpu"), args(ck, out, save_every=every, resume=True))
    assert resumed["resumed_after"] == saved[-1]
    same_files(str(tmp_path / "whole"), out)


def test_resume_without_saves_is_refused(ck, tmp_path):
    r = subprocess.run(
        [sys.executable, "tools/ptq.py", ck, "--recipe", "nvfp4", "--out", str(tmp_path / "q")]
        + ["--resume", "--save-every", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "--save-every 0" in r.stderr and "--resume" in r.stderr
    assert not os.path.exists(tmp_path / "q")
