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
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors
from tests.multiproc import free_port, run_world

E = 8  # routed experts of the tiny configs
SHAPES = [(2, 6), (1, 5), (3, 4), (0, 7)]  # rank r's batch (sequences, tokens); rank 3 has none
# (recipe, kv cache, calibration dtype): fp32 shows a kernel's last-bit differences that bf16
# rounding may hide, bf16 is what users run.
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


def ep_logits(cks: list[str], ep: int, port: int, seq_len: int | None = None) -> list[dict]:
    """On this rank of a (world, ep) run: for each checkpoint, the experts its model holds and its
    logits on the rank's batch against the single-process model's."""
    ids = tokens(int(os.environ["RANK"]), seq_len)
    os.environ["MASTER_PORT"] = str(port)
    out = []
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        for ck in cks:
            with torch.no_grad():
                want = eprt.load_model(ck, dtype=torch.float32)(ids)
                model = eprt.load_model(ck, dtype=torch.float32, parallel=state)
                got = model(ids)
            out.append(
                {
                    "experts": {(b.experts.first, b.experts.count) for _, b in model.moe_blocks()},
                    "shape": (tuple(got.shape), tuple(want.shape)),
                    "bitwise": torch.equal(got, want),
                    "max_diff": (got - want).abs().max().item() if got.numel() else 0.0,
                }
            )
    return out


def assert_ep_logits(cks: list[str], world: int, ep: int, seq_len: int | None = None) -> None:
    """Every rank of a (world, ep) run holds experts [r % ep * E/ep, +E/ep) and gets, for its own
    batch (rank 3 an empty one), the single-process logits to the last bit."""
    results = run_world(ep_logits, world, cks, ep, free_port(), seq_len, timeout=190)
    for rank, per_ck in enumerate(results):
        B, T = SHAPES[rank]
        T = seq_len or T
        for ck, r in zip(cks, per_ck):
            assert r["shape"] == ((B, T, 512), (B, T, 512)), (ck, rank)
            assert r["experts"] == {((rank % ep) * E // ep, E // ep)}, (ck, rank)
            assert r["bitwise"], (ck, world, ep, rank, r["max_diff"])


def calibrate(cks: dict[str, str], out_root: str, ep: int, port: int, recipes=RECIPES, calib_size: int = 9) -> None:
    """Calibrate each named checkpoint with each (recipe, kv cache, dtype) at this process's
    (world, ep), into out_root/{name}-{recipe}-w{world}-ep{ep}."""
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        for name, ck in cks.items():
            for recipe, kv, dtype in recipes:
                args = PTQArgs(
                    ck,
                    recipe,
                    os.path.join(out_root, f"{name}-{recipe}-w{state.world}-ep{ep}"),
                    kv_cache=kv,
                    calib_size=calib_size,
                    seq_len=24,
                    batch_size=2,
                    dtype=dtype,
                    progress=False,
                )
                run_ptq(state, args)


def calibrate_every_layout(cks: dict[str, str], out_root: str, recipes=RECIPES, calib_size: int = 9) -> None:
    """`calibrate` in one process and at (world 2, ep 2) and (world 4, ep 2)."""
    calibrate(cks, out_root, 1, free_port(), recipes, calib_size)
    run_world(calibrate, 2, cks, out_root, 2, free_port(), recipes, calib_size, timeout=240)
    run_world(calibrate, 4, cks, out_root, 2, free_port(), recipes, calib_size, timeout=300)


def exports_by_layout(out_root: str, name: str, recipe: str) -> dict[str, str]:
    """{layout: the export of out_root/{name}-{recipe}-{layout}} for one process and every LAYOUTS."""
    return {
        layout: export_hf(
            os.path.join(out_root, f"{name}-{recipe}-{layout}"),
            os.path.join(out_root, f"export-{name}-{recipe}-{layout}"),
            progress=False,
        )
        for layout in ("w1-ep1", *LAYOUTS)
    }


def same_files(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


def assert_exports_layout_invariant(ck: str, hf: str, out: str) -> dict[str, str]:
    """Calibrate `ck` with every recipe at world 1, (2, ep 2) and (4, ep 2), export each: each
    recipe's exports are the same files byte for byte, and pass check_export against `hf`.
    Returns {recipe: the single-process export}."""
    calibrate_every_layout({"model": ck}, out)
    refs = {}
    for recipe, *_ in RECIPES:
        exports = exports_by_layout(out, "model", recipe)
        refs[recipe] = exports["w1-ep1"]
        assert check_export(refs[recipe], hf) == [], recipe
        for layout in LAYOUTS:
            assert same_files(refs[recipe], exports[layout]), (recipe, layout)
    return refs


def assert_family_exports(
    ckpts: dict[str, dict[str, tuple[str, str]]],
    out: str,
    never_quantized: dict[str, list[str]],
    quantized: dict[str, list[str]],
    as_is=lambda name: False,
) -> list[tuple[str, str, dict, dict, str]]:
    """Calibrate each family's bf16 checkpoint (`ckpts`: tiny_checkpoints by family) with every
    recipe at every layout and export it: each export passes eprt-check against its source and is
    the same files at every layout; the modules of `never_quantized` keep the source's bytes and
    have no scales, those of `quantized` are stored in the recipe's format with their scales, and
    every source tensor `as_is` names travels as the source holds it. Returns (family, recipe,
    source tensors, exported tensors, export dir) of each single-process export, for the family's
    own assertions."""
    calibrate_every_layout({f: c["bf16"][1] for f, c in ckpts.items()}, out, calib_size=6)
    seen = []
    for family, by_dtype in ckpts.items():
        hf = by_dtype["bf16"][0]
        source = read_hf_tensors(hf)
        for recipe, *_ in RECIPES:
            exports = exports_by_layout(out, family, recipe)
            ref = exports["w1-ep1"]
            assert check_export(ref, hf) == [], (family, recipe)
            for layout in LAYOUTS:
                assert same_files(ref, exports[layout]), (family, recipe, layout)
            exported = read_hf_tensors(ref)
            for module in never_quantized[family]:
                assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), module
                assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
            for module in quantized[family]:
                assert exported[f"{module}.weight"].dtype == (torch.uint8 if recipe == "nvfp4" else torch.float8_e4m3fn)
                assert f"{module}.weight_scale" in exported, module
            for n in filter(as_is, source):
                assert raw(exported[n]) == raw(source[n]) and exported[n].dtype == source[n].dtype, n
            seen.append((family, recipe, source, exported, ref))
    return seen
