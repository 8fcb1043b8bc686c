"""GPT-OSS in its release's MXFP4 layout under expert parallelism: calibrated with gptq at world 2,
ep 2 (each rank its own experts) and exported by two ranks (each its share of the shards), the same
files byte for byte as calibrated and exported in one process."""

import os
from datetime import timedelta

import pytest

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.multiproc import free_port, run_world

SHARD_BYTES = 60_000  # several shards, so that each rank writes some


def calibrate_and_export(ck: str, root: str, ep: int, port: int) -> None:
    """This process's rank calibrates `ck` with gptq under mxfp4_experts_only and exports it in
    the release's layout, into root/w{world}-ep{ep} and root/out-w{world}-ep{ep}."""
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        name = f"w{state.world}-ep{ep}"
        q = os.path.join(root, name)
        # GPTQ on every expert a token reaches: the tiny run's are under the default minimum
        args = PTQArgs(
            ck, "mxfp4_experts_only", q, calib_size=6, seq_len=16, algorithm="gptq", gptq_min_tokens=1, progress=False
        )
        run_ptq(state, args)
        out = os.path.join(root, f"out-{name}")
        export_hf(q, out, fmt="mxfp4", max_shard_bytes=SHARD_BYTES, progress=False, parallel=state)


@pytest.mark.timeout(300)
def test_two_ranks_write_the_single_process_bytes(tmp_path):
    hf = make_tiny("gpt_oss", str(tmp_path / "hf"), dtype="bf16")
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    root = str(tmp_path / "runs")
    calibrate_and_export(ck, root, 1, free_port())
    run_world(calibrate_and_export, 2, ck, root, 2, free_port(), timeout=240)
    one, two = os.path.join(root, "out-w1-ep1"), os.path.join(root, "out-w2-ep2")
    assert check_export(one, hf) == []
    assert len([n for n in os.listdir(one) if n.endswith(".safetensors")]) > 2
    assert same_files(one, two)
