"""What a PTQ run settles before it reads a weight or a token: its checkpoint, refused unless
unquantized and resolved once in --dtype; its recipe against the model, refusing what export would
refuse; its shape (`RunShape`: this rank's place, the data's sizes and steps) and its memory plan,
refused over --max-memory or --max-host-memory. The calibrated run and the format search both start
here; the dry run plans from the same pieces."""

from __future__ import annotations

import os

import torch

from eprt.config import ModelConfig
from eprt.errors import ConfigError
from eprt.loading.loader import weight_bytes
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.progress import logger
from eprt.quant.algorithms.program import Program
from eprt.quant.calibrated import refuse_calibrated
from eprt.quant.feasibility import quantized_modules
from eprt.quant.formats.kv import KV_CACHE_FORMATS
from eprt.quant.loop.sequences import group_tokens
from eprt.quant.recipe import Recipe, load_recipe
from eprt.quant.run.args import RUN_DTYPES, PTQArgs
from eprt.quant.run.memory_check import check_host_memory, check_memory
from eprt.quant.run.memory_plan import MemoryPlan, RunShape
from eprt.quant.run.process_memory import available_memory, current_rss, memory_in_use
from eprt.quant.source_grid import checkpoint_int4_grid
from eprt.storage.atomic import check_output_dir
from eprt.storage.checkpoint import Checkpoint
from eprt.units import format_bytes


def open_unquantized(state: ParallelState, a: PTQArgs, ck: Checkpoint | None) -> tuple[Checkpoint, ResolvedCheckpoint]:
    """`a.ckpt` (or `ck`, its open checkpoint) refused unless unquantized, and its resolution in --dtype,
    with the output directory and --device checked first."""
    check_output_dir(a.out, a.overwrite, (a.ckpt,))  # before calibrating: refused again when it is written
    if a.device is not None and a.device != state.device.type:
        raise ConfigError(
            f"--device {a.device}: this rank runs on {state.device.type}; --device plans for "
            "another machine with --dry-run, a run uses its ranks' own devices"
        )
    ck = ck if ck is not None else Checkpoint(a.ckpt)
    refuse_calibrated(ck, a.ckpt)
    return ck, ResolvedCheckpoint.of(ck, run_dtype(a.dtype))  # the one resolution the whole run reads


def run_dtype(name: str) -> torch.dtype:
    """The torch dtype of `--dtype NAME`."""
    if name not in RUN_DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose one of {', '.join(RUN_DTYPES)}")
    return getattr(torch, RUN_DTYPES[name])


def plan_recipe(
    rc: ResolvedCheckpoint, spec: str, kv_cache: str | None = None, algorithm: str | None = None
) -> tuple[Recipe, list[str]]:
    """The recipe `spec` (its rules that name no algorithm get `algorithm`) and the modules it
    quantizes in `rc`, from the manifest alone: whatever export would refuse about this recipe
    and this model is refused here, before a weight is read."""
    recipe = load_recipe(spec, kv_cache, algorithm).on_source(checkpoint_int4_grid(rc.ck))
    setting = (
        f"--kv-cache {kv_cache}" if kv_cache is not None else f"recipe {recipe.name!r}'s kv_cache: {recipe.kv_cache}"
    )
    check_kv_cache(recipe.kv_cache, rc.ck.config, rc.ck.path, setting)
    return recipe, list(quantized_modules(rc.layout, recipe, rc.ck.path))


def check_kv_cache(kv_cache: str | None, config: ModelConfig, where: str, setting: str | None = None) -> None:
    """Refuse a KV-cache format whose blocks the model's cached heads do not fill (NVFP4's 16 along the
    head dim), from the config alone: otherwise only the quality report's fake quantization would
    find it, after calibration, and a run without one would export a cache the engine cannot hold.
    `where` names the checkpoint, `setting` what asked for the format (default: --kv-cache)."""
    kv = KV_CACHE_FORMATS.get(kv_cache)  # a name that is no format is the recipe's to refuse
    if kv is None:
        return
    if config.own is not None and not config.own.kv_cache_calibrated():
        logger().warning(
            f"{setting or f'--kv-cache {kv_cache}'}: {where} ({config.family}) has a KV cache its engine scales "
            "itself, reading no scale from the checkpoint: the export carries no KV-cache scales"
        )
        return
    keys, values = config.kv_head_dims
    unfit = [
        f"{what} heads {width} wide" for what, width in (("key", keys), ("value", values)) if kv.unfit_head_dim(width)
    ]
    if unfit:
        raise ConfigError(
            f"{setting or f'--kv-cache {kv_cache}'}: {kv.quant_algo} caches keys and values in blocks of {kv.block} "
            f"along the head dim, and {where} ({config.family}) caches {' and '.join(unfit)}: calibrate with "
            "--kv-cache fp8 (one scale per tensor, any head width)"
        )


def run_shape(a: PTQArgs, state: ParallelState, config) -> RunShape:
    """This rank's place and the run's data sizes and steps, as the plan and the engine take them."""
    if a.chunk_size is not None and a.chunk_size < 1:
        raise ConfigError(f"--chunk-size {a.chunk_size} must be positive")
    return RunShape(
        state.rank,
        state.world,
        state.ep_size,
        a.calib_size,
        a.seq_len,
        a.chunk_size or a.batch_size * state.world,
        a.group_tokens or group_tokens(config.num_experts, config.num_experts_per_tok),
        a.calibrate_all_experts,
        max(a.eval_size, 0),
    )


def ranks_on_this_host(state: ParallelState) -> int:
    """The ranks that share this rank's host memory: torchrun's LOCAL_WORLD_SIZE (the world, where
    no launcher says)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", state.world))


def plan_run(state: ParallelState, rc: ResolvedCheckpoint, a: PTQArgs, program: Program) -> tuple[MemoryPlan, bool]:
    """Refuse, before any weight or token is read, a run whose planned peak exceeds --max-memory
    (on a GPU, or whose ranks' host memory on this host exceeds --max-host-memory); the plan, and
    whether the preview's whole model fits beside it (rank 0 says so when it does not). `program`:
    what the run runs (eprt.quant.algorithms.program), whose algorithms give their own terms."""
    c = rc.ck.config
    planner = program.planner(rc, state.device)
    shape = program.shape(run_shape(a, state, c))
    limit = a.max_memory or available_memory(state.device)
    plan = planner.plan(shape, memory_in_use(state.device), host_baseline=current_rss(), limit=limit)
    check_memory(planner, plan, limit, shape, c.num_experts)
    check_host_memory(
        planner,
        plan,
        a.max_host_memory or available_memory(torch.device("cpu")),
        shape,
        c.num_experts,
        ranks_on_this_host(state),
    )
    if state.rank == 0:
        logger().info("memory plan: rank 0 %s", plan.summary())
    if not a.preview:
        return plan, False
    mine = state.placement(c.num_experts).range if c.moe_layers else None
    whole = sum(weight_bytes(rc.holding(mine)))
    fits = plan.peak + whole <= limit
    if not fits and state.rank == 0:
        logger().warning(
            "no preview: the whole model (%s per rank) does not fit beside the calibration (%s) in --max-memory %s",
            format_bytes(whole),
            format_bytes(plan.peak),
            format_bytes(limit),
        )
    return plan, fits
