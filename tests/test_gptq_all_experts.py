"""--calibrate-all-experts reaches GPTQ: each routed expert's Hessians are over every token of its
layer (the statistics-only rows), so every expert is solved, whatever the router chose, and the
export stays the same bytes at every layout."""

from datetime import timedelta

import pytest
import torch

from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.algorithms.gptq.layer import LayerGPTQ
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.hf_utils import read_hf_tensors
from tests.multiproc import run_world

# more than any tiny expert's routed tokens, fewer than the run's: only every-token sums solve them all
CALIB = dict(calib_size=8, seq_len=64, progress=False, gptq_min_tokens=300, batch_size=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_all_experts")
    hf = make_tiny("qwen3_moe", str(root / "hf"), dtype="bf16")
    return convert_hf(hf, str(root / "ck"), progress=False)


def test_every_expert_sums_every_token_of_its_layer(tiny, tmp_path, monkeypatch):
    """Every local expert has Hessians (none kept at max rounding for want of tokens), and the
    first projection's, all over the same rows (every token of the layer), are the same for every
    expert; the down projection's (each expert's own activation) differ."""
    seen: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    free = LayerGPTQ.free

    def kept(self):
        for m, sums in self.expert_hessians.items():
            seen[m] = {l: (pair[0].total.clone(), pair[1].total.clone()) for l, pair in sums.items()}
        free(self)

    monkeypatch.setattr(LayerGPTQ, "free", kept)
    run_ptq(
        ParallelState.single(),
        PTQArgs(tiny, "int4_g32", str(tmp_path / "q"), algorithm="gptq", calibrate_all_experts=True, **CALIB),
    )
    assert seen
    for m, sums in seen.items():
        experts = sorted(sums)
        assert len(experts) > 1 and experts == list(range(len(experts))), m
        first_in, first_down = sums[0]
        assert first_in.any() and first_down.any(), m
        assert all(torch.equal(sums[l][0], first_in) for l in experts), m
        assert not all(torch.equal(sums[l][1], first_down) for l in experts), m


def _calibrate(ck: str, out: str, ep: int) -> None:
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, "int4_g32", out, algorithm="gptq", calibrate_all_experts=True, **CALIB))


def test_the_export_is_the_same_bytes_at_every_layout_and_moves_from_routed_gptq(tiny, tmp_path):
    one = str(tmp_path / "w1")
    run_ptq(
        ParallelState.single(),
        PTQArgs(tiny, "int4_g32", one, algorithm="gptq", calibrate_all_experts=True, **CALIB),
    )
    run_world(_calibrate, 2, tiny, str(tmp_path / "w2"), 2, timeout=200)
    exports = [
        export_hf(q, str(tmp_path / f"export-{i}"), progress=False, fmt="compressed-tensors")
        for i, q in enumerate((one, str(tmp_path / "w2")))
    ]
    assert same_files(exports[0], exports[1])
    routed = str(tmp_path / "routed")
    run_ptq(ParallelState.single(), PTQArgs(tiny, "int4_g32", routed, algorithm="gptq", **CALIB))
    routed_export = export_hf(routed, str(tmp_path / "export-routed"), progress=False, fmt="compressed-tensors")
    # the routed run keeps every tiny expert at max rounding (too few tokens); every-token sums solve them
    mine, theirs = read_hf_tensors(exports[0]), read_hf_tensors(routed_export)
    assert mine.keys() == theirs.keys()
    experts = [n for n in mine if ".experts." in n and n.endswith(".weight_packed")]
    assert experts and all(not torch.equal(mine[n], theirs[n]) for n in experts)
