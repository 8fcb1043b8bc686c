"""Expert-parallel checks a family's tests share: logits at (world, ep) equal the single-process
logits bit for bit, and PTQ exports are the same bytes whatever layout calibrated them."""

import filecmp
import os
from datetime import timedelta

import torch

import eprt
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.multiproc import free_port, run_world

E = 8  # routed experts of the tiny configs
SHAPES = [(2, 6), (1, 5), (3, 4), (0, 7)]  # rank r's batch (sequences, tokens); rank 3 has none
# (recipe, kv cache, calibration dtype), as tests/layouts/test_ptq.py: fp32 shows last-bit differences
# that bf16 rounding may hide, bf16 is what users run.
RECIPES = [("fp8", None, "fp32"), ("nvfp4", "fp8", "bf16")]
LAYOUTS = ["w2-ep2", "w4-ep2"]


def tiny_checkpoints(root, family: str) -> dict[str, tuple[str, str]]:
    """{dtype: (Hugging Face dir, eprt checkpoint)} of the built-in tiny `family`, in fp32 and bf16, under root."""
    out = {}
    for dtype in ("fp32", "bf16"):
        hf = make_tiny(family, str(root / f"hf-{dtype}"), dtype=dtype)
        out[dtype] = hf, convert_hf(hf, str(root / f"ck-{dtype}"), progress=False)
    return out


def tokens(rank: int, seq_len: int | None = None) -> torch.Tensor:
    B, T = SHAPES[rank]
    return torch.randint(0, 512, (B, seq_len or T), generator=torch.Generator().manual_seed(rank))


def _ep_logits(ck: str, ep: int, port: int, seq_len: int | None):
    ids = tokens(int(os.environ["RANK"]), seq_len)
    with torch.no_grad():
        want = eprt.load_model(ck, dtype=torch.float32)(ids)
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        model = eprt.load_model(ck, dtype=torch.float32, parallel=state)
        with torch.no_grad():
            got = model(ids)
        experts = {(b.experts.first, b.experts.count) for _, b in model.moe_blocks()}
    return {
        "experts": experts,
        "shape": (tuple(got.shape), tuple(want.shape)),
        "bitwise": torch.equal(got, want),
        "max_diff": (got - want).abs().max().item() if got.numel() else 0.0,
    }


def assert_ep_logits_bitwise(ck: str, world: int, ep: int, seq_len: int | None = None) -> None:
    """Every rank of a (world, ep) run holds experts [r % ep * E/ep, +E/ep) and gets, for its own
    batch (rank 3 an empty one), the single-process logits to the last bit."""
    results = run_world(_ep_logits, world, ck, ep, free_port(), seq_len, timeout=140)
    for rank, r in enumerate(results):
        B, T = SHAPES[rank]
        T = seq_len or T
        assert r["shape"] == ((B, T, 512), (B, T, 512)), rank
        assert r["experts"] == {((rank % ep) * E // ep, E // ep)}, rank
        assert r["bitwise"], (world, ep, rank, r["max_diff"])


def _calibrate(ck: str, out_root: str, ep: int, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        for recipe, kv, dtype in RECIPES:
            run_ptq(
                state,
                PTQArgs(
                    ck,
                    recipe,
                    os.path.join(out_root, f"{recipe}-w{state.world}-ep{ep}"),
                    kv_cache=kv,
                    calib_size=9,
                    seq_len=24,
                    batch_size=2,
                    dtype=dtype,
                    progress=False,
                ),
            )


def same_files(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


def assert_exports_layout_invariant(ck: str, hf: str, out: str) -> dict[str, str]:
    """Calibrate `ck` with every recipe at world 1, (2, ep 2) and (4, ep 2), export each: each
    recipe's exports are the same files byte for byte, and pass check_export against `hf`.
    Returns {recipe: the single-process export}."""
    state = ParallelState.single()
    for recipe, kv, dtype in RECIPES:
        run_ptq(
            state,
            PTQArgs(
                ck,
                recipe,
                os.path.join(out, f"{recipe}-w1-ep1"),
                kv_cache=kv,
                calib_size=9,
                seq_len=24,
                batch_size=2,
                dtype=dtype,
                progress=False,
            ),
        )
    run_world(_calibrate, 2, ck, out, 2, free_port(), timeout=200)
    run_world(_calibrate, 4, ck, out, 2, free_port(), timeout=300)
    refs = {}
    for recipe, *_ in RECIPES:
        exports = {
            layout: export_hf(
                os.path.join(out, f"{recipe}-{layout}"), os.path.join(out, f"export-{recipe}-{layout}"), progress=False
            )
            for layout in ("w1-ep1", *LAYOUTS)
        }
        refs[recipe] = exports["w1-ep1"]
        assert check_export(refs[recipe], hf) == [], recipe
        for layout in LAYOUTS:
            assert same_files(refs[recipe], exports[layout]), (recipe, layout)
    return refs
