"""A recipe of rules run on tiny families in one process and at (world 2, ep 2) with another batch
size: what the layout tests of algorithms share."""

import os
from datetime import timedelta

import yaml

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import GROUP_TOKENS, same_files
from tests.multiproc import free_port, run_world


def rule_setup(root, families, name: str, rules: list[dict], **recipe) -> tuple[str, str, dict[str, str]]:
    """(root, the recipe `name` of `rules` (and `recipe`'s other keys), {family: its converted tiny
    checkpoint})."""
    path = str(root / f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"name": name, "quantize": rules, **recipe}, f)
    ckpts = {
        fam: convert_hf(make_tiny(fam, str(root / f"hf-{fam}")), str(root / f"ck-{fam}"), progress=False)
        for fam in families
    }
    return str(root), path, ckpts


def calibrate(root: str, recipe: str, ckpts: dict, ep: int, port: int | None, settings: dict) -> None:
    """Calibrate every checkpoint with `recipe` into root/{family}-w{world}: one process (port None)
    with batches of 1, else this rank of a world at `ep` with batches of 3."""
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    state = ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) if port is not None else ParallelState.single()
    with state:
        for family, ck in ckpts.items():
            out = os.path.join(root, f"{family}-w{state.world}")
            batch = 1 if ep == 1 else 3
            run_ptq(
                state, PTQArgs(ck, recipe, out, batch_size=batch, group_tokens=GROUP_TOKENS, progress=False, **settings)
            )


def assert_same_exports_at_both_layouts(setup, **settings) -> None:
    """Calibrate `setup` (rule_setup's) in one process and at (world 2, ep 2): every family's two
    exports pass eprt's checks and are the same files byte for byte."""
    root, recipe, ckpts = setup
    calibrate(root, recipe, ckpts, 1, None, settings)
    run_world(calibrate, 2, root, recipe, ckpts, 2, free_port(), settings, timeout=600)
    for family in ckpts:
        exports = [
            export_hf(os.path.join(root, f"{family}-w{w}"), os.path.join(root, f"export-{family}-w{w}"), progress=False)
            for w in (1, 2)
        ]
        assert check_export(exports[0]) == [], family
        assert same_files(*exports), family
