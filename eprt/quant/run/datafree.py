"""The data-free path: a recipe whose every format takes no activation statistic
(`WeightFormat.uses_activation_statistics`: FP8 block and per channel, whose inputs the engine
scales at run time; NVFP4 weights only, whose inputs stay bf16), whose weight scales come from the
weights alone (max, mse) and that quantizes no KV cache (its scales are the keys' and values' amax)
needs neither calibration data nor a forward pass.

PTQ then reads no data and runs no layer: it writes the calibrated checkpoint with an empty
calibration record (the recipe, and the pins of the base's weight files), and its export
(eprt.hf.export) quantizes each weight as it streams it to the output, from the same scales as
after calibration, so the export is the same bytes. The export can also take the recipe straight
from an unquantized checkpoint (`eprt-export CKPT OUT --recipe fp8_block`), which is the same
export without the calibrated checkpoint between them.

A multi-rank launch: rank 0 alone writes the output (a manifest of a few KB), and the other ranks
only take part in publishing it atomically; there is no weight to share out. The export's ranks
share the shards as after calibration.
"""

from __future__ import annotations

import dataclasses

from eprt.errors import ConfigError
from eprt.families import reader_for
from eprt.flags import flag_name
from eprt.parallel import ParallelState
from eprt.parallel.guard import fail_together
from eprt.parallel.output import write_together
from eprt.progress import logger
from eprt.quant.algorithms.registry import ALGORITHMS, unrotated
from eprt.quant.calibrated import refuse_calibrated, write_calibrated
from eprt.quant.feasibility import quantized_modules
from eprt.quant.formats import WEIGHT_FORMATS, weight_format
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.recipe import Recipe, load_recipe
from eprt.quant.run.args import CALIBRATION_SETTINGS, PTQArgs
from eprt.quant.source_grid import checkpoint_int4_grid
from eprt.storage.atomic import check_output_dir, naming_refused_writes
from eprt.storage.checkpoint import Checkpoint

# the algorithms that set weight scales from the weights alone (eprt.quant.algorithms.registry)
WEIGHT_ONLY_ALGORITHMS = tuple(name for name, entry in ALGORITHMS.items() if entry.weight_only)


def statistics_needed(recipe: Recipe) -> list[str]:
    """What in `recipe` needs calibration's forward passes, one phrase each (in rule order, no
    repeats); empty: the recipe is data-free."""
    needs: list[str] = []
    for rule in recipe.rules:
        if rule.format == "none":
            continue
        if weight_format(rule.format).uses_activation_statistics:
            needs.append(f"format {rule.format} scales its inputs by their calibrated amax")
        if unrotated(rule.algorithm) not in WEIGHT_ONLY_ALGORITHMS:  # the rotation needs no data
            needs.append(f"algorithm {rule.algorithm} rounds the weights against the calibration inputs")
    if recipe.kv_cache is not None:
        needs.append(f"the {recipe.kv_cache} KV cache is scaled by the keys' and values' calibrated amax")
    return list(dict.fromkeys(needs))


def data_free_recipe(spec: str, algorithm: str | None, ckpt: str) -> Recipe:
    """The recipe `spec` for a quantization without calibration (the export's `--recipe`), refused
    by name, with the way out, where it needs statistics."""
    recipe = load_recipe(spec, None, algorithm)
    needs = statistics_needed(recipe)
    if needs:
        raise ConfigError(
            f"--recipe {spec}: {'; '.join(needs)}, so it needs calibration data and forward passes; "
            f"the export quantizes from the weights alone only a recipe that needs neither (formats "
            f"{', '.join(data_free_formats())}, algorithms {', '.join(WEIGHT_ONLY_ALGORITHMS)}, no KV "
            f"cache): calibrate first (eprt-ptq {ckpt} --recipe {spec} --out Q), then export Q"
        )
    return recipe


def data_free_formats() -> list[str]:
    """The formats that take no activation statistic."""
    return [name for name, f in WEIGHT_FORMATS.items() if not f.uses_activation_statistics]


def data_free(recipe: Recipe, a: PTQArgs) -> bool:
    """Whether the run needs no data and no forward pass: `recipe` takes no statistic, and neither
    the quality report on --eval data nor the preview asks for the model to run."""
    return not statistics_needed(recipe) and a.eval is None and a.preview is None


def say_calibrated(recipe: Recipe) -> None:
    """Rank 0 says why a recipe whose formats all take no activation statistic calibrates all the
    same: its algorithm (GPTQ's Hessians, AWQ's search) or its KV cache needs the data."""
    needs = statistics_needed(recipe)
    if needs and not any(
        weight_format(r.format).uses_activation_statistics for r in recipe.rules if r.format != "none"
    ):
        logger().info(
            "recipe %s (%s): its formats take no activation statistic, but %s: a calibrated run",
            recipe.name,
            "+".join(recipe.algorithms),
            "; ".join(needs),
        )


def say_data_free(a: PTQArgs, recipe: Recipe) -> None:
    """Rank 0 says why no data is read, which settings go unused, and how to get a quality report."""
    log = logger()
    log.info(
        "recipe %s (%s) takes no activation statistic: a data-free run, no calibration data read and no forward pass",
        recipe.name,
        "+".join(recipe.algorithms),
    )
    defaults = {f.name: f.default for f in dataclasses.fields(PTQArgs)}
    unused = [flag_name(n) for n in CALIBRATION_SETTINGS if getattr(a, n) != defaults[n]]
    if unused:
        log.info("unused in a data-free run: %s", ", ".join(unused))
    log.info(
        "no quality report (it runs the model over held-out data): run again with --eval DATA for a "
        "calibrated run that writes one"
    )


def run_data_free(
    state: ParallelState,
    ckpt: str,
    out: str,
    recipe: Recipe,
    *,
    overwrite: bool = False,
    ck: Checkpoint | None = None,
) -> dict:
    """Write `out`, the calibrated checkpoint of `ckpt` under data-free `recipe` (refused as
    calibration refuses it: an output that exists, a calibrated input, a recipe the model cannot
    take); every rank of the run calls it. `ck`: `ckpt` as the command opened it; the run closes it.
    Returns what eprt.quant.run.ptq.run_ptq does: no tokens, no quality report."""
    with fail_together(state, "reading the checkpoint and the recipe"):
        check_output_dir(out, overwrite, (ckpt,))  # before anything is read: refused again when it is written
        ck = ck if ck is not None else Checkpoint(ckpt)
        refuse_calibrated(ck, ckpt)
        recipe = recipe.on_source(checkpoint_int4_grid(ck))
        quantized_modules(reader_for(ck.config.model_type, ck.path).layout(ck.config), recipe, ck.path)
    with ck:
        summary = {"algorithm": "+".join(recipe.algorithms), "data_free": True}

        def write(tmp: str) -> None:
            with naming_refused_writes(tmp, f"the output {out}", "write the output elsewhere"):
                # nothing observed: the export asks the record for no statistic of these formats
                write_calibrated(tmp, out, state, Calibrator(None, [], kv=False), ck, recipe, summary)

        write_together(state, out, write, overwrite=overwrite, inputs=ck.input_dirs())
    if state.rank == 0:
        logger().info(
            "%s with %s -> %s, data-free: no data read, no layer run; its export quantizes each "
            "weight as it writes it (eprt-export %s HF_OUT)",
            ckpt,
            recipe.name,
            out,
            out,
        )
    return {"out": out, "calibration_s": 0.0, "tokens": 0, "resumed_after": -1, "quality": None}
