"""--resume: a calibration killed mid-layer continues from its last completed layer and exports
the same bytes as a run never stopped."""

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest

from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.calibrated import QUALITY_FILE
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.workdir import MARKER
from eprt.quant.run.workdir_lock import LOCK_FILE
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import same_files
from tests.multiproc import run_world

KILL_LAYER, KILL_STEP = 2, 2


def args(ck, out, **kw):
    return PTQArgs(ck, "nvfp4", out, kv_cache="fp8", calib_size=9, seq_len=24, group_tokens=48, progress=False, **kw)


def killed_mid_layer(ck, out):
    """Rank 1 dies in step KILL_STEP of layer KILL_LAYER, as a killed process does: no cleanup."""
    run_step = LayerEngine._run_step

    def dying(self, layer, step, ls, **kw):
        if self.state.rank == 1 and layer is self.decoder.layers[KILL_LAYER] and step == KILL_STEP:
            os._exit(9)
        return run_step(self, layer, step, ls, **kw)

    LayerEngine._run_step = dying
    with ParallelState.from_env(timeout=timedelta(seconds=10)) as state:
        run_ptq(state, args(ck, out))


def resumed(ck, out):
    with ParallelState.from_env(timeout=timedelta(seconds=60)) as state:
        return run_ptq(state, args(ck, out, resume=True))["resumed_after"]


# GLM-5's layer KILL_LAYER shares layer 1's top-k: the resumed run reads it from the work directory
@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_a_run_killed_mid_layer_resumes_and_exports_the_same_bytes(tmp_path, family):
    ck = convert_hf(make_tiny(family, str(tmp_path / "hf"), num_hidden_layers=4), str(tmp_path / "ck"), progress=False)
    run_ptq(ParallelState.single("cpu"), args(ck, str(tmp_path / "whole")))
    out = str(tmp_path / "q")
    with pytest.raises(AssertionError, match="rank 1"):
        run_world(killed_mid_layer, 2, ck, out, timeout=120)
    assert not os.path.exists(out)
    work = out + ".work"
    assert sorted(os.listdir(work)) == [MARKER, LOCK_FILE, "rank-00000", "rank-00001"]  # the lock file, unlocked
    # the last layer both ranks completed, and nothing half-written; the layer before it stays where its
    # drop waited on the peers' next save (eprt.quant.run.workdir), which never came
    last, before = (f"layer-{KILL_LAYER - k:05d}.safetensors" for k in (1, 2))
    for rank_dir in ("rank-00000", "rank-00001"):
        held = set(os.listdir(os.path.join(work, rank_dir)))
        assert last in held and held <= {last, before}, (rank_dir, held)

    with pytest.raises(AssertionError, match="other arguments"):  # a resume of another run is refused
        run_world(resumed_other, 2, ck, out, timeout=120)
    assert run_world(resumed, 2, ck, out, timeout=120) == [KILL_LAYER - 1] * 2
    assert not os.path.exists(work)
    export_hf(str(tmp_path / "whole"), str(tmp_path / "export-whole"), progress=False)
    export_hf(out, str(tmp_path / "export-q"), progress=False)
    # the quality report too: its held-out streams and what it measured were saved with each layer
    report = lambda d: json.loads(Path(d, QUALITY_FILE).read_text())  # noqa: E731
    assert report(out) == report(tmp_path / "whole")
    assert same_files(str(tmp_path / "export-whole"), str(tmp_path / "export-q"))


def resumed_other(ck, out):
    with ParallelState.from_env(timeout=timedelta(seconds=60)) as state:
        run_ptq(
            state,
            PTQArgs(
                ck, "nvfp4", out, kv_cache="fp8", calib_size=9, seq_len=16, group_tokens=48, progress=False, resume=True
            ),
        )
