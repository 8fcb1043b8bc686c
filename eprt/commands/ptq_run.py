"""What eprt-ptq runs once its arguments are parsed (eprt.commands.ptq): the launch of the local
ranks, the dry run's plan and tables, the calibration. Apart from the parser so that `--help` loads no
model code."""

import torch
import torch.distributed as dist

from eprt.commands.launch import launch, without_nproc
from eprt.hf.export_plan import plan_export
from eprt.hf.serving import describe_gpus
from eprt.loading.loader import open_checkpoint, weight_bytes
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState, fail_together
from eprt.parallel.state import check_ep
from eprt.quant.algorithms.program import Program, program_of
from eprt.quant.recipe import Recipe
from eprt.quant.run.args import PTQArgs
from eprt.quant.run.data import check_data_settings
from eprt.quant.run.datafree import data_free
from eprt.quant.run.estimate import PROBE_STEPS, estimate_time
from eprt.quant.run.memory_check import check_host_memory, check_memory
from eprt.quant.run.probe_share import RankShare, plan_probe
from eprt.quant.run.process_memory import available_memory, current_rss, memory_in_use
from eprt.quant.run.ptq import run_ptq
from eprt.quant.run.setup import check_kv_cache, plan_recipe, ranks_on_this_host, run_dtype, run_shape
from eprt.samples import first_sample
from eprt.storage.atomic import check_output_dir
from eprt.storage.checkpoint import Checkpoint
from eprt.units import format_bytes


def run_command(argv: list[str], a: PTQArgs, nproc_per_node: int | None) -> int:
    """Start the local ranks (--nproc-per-node) once what the manifest and the arguments can refuse is
    refused, or, as a rank, read the checkpoint's manifest, then the dry run or the calibration."""
    if nproc_per_node is not None:
        check_before_launch(a, nproc_per_node)
        return launch("eprt.commands.ptq", without_nproc(argv), nproc_per_node)
    with ParallelState.from_env(ep=a.ep) as state, open_checkpoint(a.ckpt, state) as ck:
        if a.dry_run:
            # what PTQ would refuse about this recipe and model, refused now; the plan is the run's program's
            rc = ResolvedCheckpoint.of(ck, run_dtype(a.dtype))
            if a.recipe:
                recipe, targets = plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm)
            else:  # the layout alone, or --auto-quantize's, whose recipe takes --kv-cache
                recipe, targets = None, []
                check_kv_cache(a.kv_cache, ck.config, ck.path)
            if recipe is not None and data_free(recipe, a):
                data_free_dry_run(state, ck, recipe, targets)
                return 0
            dry_run(state, rc, a, program_of(recipe, targets))
            return 0
        run_ptq(state, a, ck=ck)
    return 0


def check_before_launch(a: PTQArgs, nproc: int) -> None:
    """What every rank would refuse from the arguments and the manifest alone, refused here before
    any rank starts: the ep degree, the checkpoint, the recipe against the model (an INT4 Linear's
    dims), the output, the data's files and settings, chat data without a chat template."""
    if a.ep is not None:
        check_ep(nproc, a.ep)
    with Checkpoint(a.ckpt) as ck:
        if ck.quantization is not None:
            return  # refused by the run, which says what a calibrated checkpoint is for
        if a.ep is not None:
            check_ep(nproc, a.ep, ck.config.num_experts or None)
        if a.recipe:
            plan_recipe(ResolvedCheckpoint.of(ck, run_dtype(a.dtype)), a.recipe, a.kv_cache, a.algorithm)
        if a.out and not a.dry_run:
            check_output_dir(a.out, a.overwrite, ck.input_dirs())
        check_data_settings(a)
        if a.calib and not a.dry_run:
            first_sample(a.calib, ck.hf_files_dir(), a.calib_column)  # a chat without a template, refused now


# --- dry run ---------------------------------------------------------------------------------


def dry_run(state: ParallelState, rc: ResolvedCheckpoint, a: PTQArgs, program: Program) -> None:
    """Every rank works out its own share and memory plan from the manifest, for ranks on
    --device (default its own), as the run plans it from the same program (its MTP layers, every
    algorithm's own terms), and refuses a plan over a limit it knows (--max-memory,
    --max-host-memory, or what this machine has free when the plan is for it); rank 0 prints them
    all, with its own plan's terms. With --estimate-time, and the plan for this machine's device,
    every rank probes the calibration's time (eprt.quant.run.estimate) and rank 0 prints its own."""
    with fail_together(state, "planning the layout"):
        ck, c, dtype = rc.ck, rc.ck.config, rc.dtype
        device = torch.device(a.device) if a.device else state.device
        here = device.type == state.device.type  # planning this machine's ranks, not another's
        held = state.placement(c.num_experts).range
        dense, experts = weight_bytes(rc.holding(held if c.moe_layers else None))
        planner = program.planner(rc, device)
        shape = program.shape(run_shape(a, state, c))
        limit = a.max_memory or (available_memory(device) if here else None)
        plan = planner.plan(shape, memory_in_use(device) if here else 0, host_baseline=current_rss(), limit=limit)
        if limit is not None:
            check_memory(planner, plan, limit, shape, c.num_experts)
        host_limit = a.max_host_memory or (available_memory(torch.device("cpu")) if here else None)
        if host_limit is not None:
            check_host_memory(planner, plan, host_limit, shape, c.num_experts, ranks_on_this_host(state))
        mine = {
            "rank": state.rank,
            "edp_rank": state.edp_rank,
            "ep_rank": state.ep_rank,
            "ep_ranks": state.ep_ranks,
            "edp_ranks": state.edp_ranks,
            "experts": {layer: held for layer in c.moe_layers},
            "dense": dense,
            "expert_bytes": experts,
            "peak": plan.peak,
            "host_peak": plan.host.peak if plan.host else None,
        }
    ranks = [mine]
    if state.world > 1:
        ranks = [None] * state.world if state.rank == 0 else None
        dist.gather_object(mine, ranks, dst=0, group=state.dp_group)
    if state.rank == 0:
        print(layout_table(state, ck, dtype, device, ranks))
        print(f"\nmemory plan on {device.type}: rank 0 {plan.summary()}")
        if program.recipe is not None:
            print(f"its export serves on: {describe_gpus(program.recipe.formats)}")
    if not a.estimate_time:
        return
    with fail_together(state, "planning the time probe"):
        share = RankShare(shape, PROBE_STEPS)
        probe = plan_probe(planner, share, memory_in_use(device) if here else 0, current_rss(), limit)
    if state.rank == 0:
        print(
            f"time probe on {device.type}: rank 0's share ({share.held(c.num_experts)[1] if c.moe_layers else 0} "
            f"routed experts of a layer, {share.schedule.num_steps} steps of {share.step_sequences} sequences) "
            f"{probe.summary()}"
        )
    if not here:
        if state.rank == 0:
            print(
                f"calibration time on {device.type}: not estimated on this {state.device.type} machine (the probe "
                f"runs a layer on the device itself): run this dry run with --estimate-time on one {device.type} "
                "node, as many local ranks as the run starts there"
            )
        return
    with fail_together(state, "estimating the calibration's time"):
        estimate = estimate_time(
            state,
            rc,
            program,
            shape,
            expert_stack=plan.expert_stack,
            save_every=a.save_every,
            work_dir=a.work_dir or (f"{a.out.rstrip('/')}.work" if a.out else None),
            save_bytes=plan.hidden,
        )
    if state.rank == 0:
        print(f"calibration time on {device.type}: rank 0 {estimate.summary()}")


def data_free_dry_run(state: ParallelState, ck: Checkpoint, recipe: Recipe, targets: list[str]) -> None:
    """Rank 0 says the run is data-free (eprt.quant.run.datafree) and plans the memory of what holds
    weights: the export, one tensor at a time."""
    if state.rank != 0:
        return
    c = ck.config
    plan = plan_export(ck, targets, recipe, torch.get_num_threads(), current_rss())
    print(
        f"checkpoint {ck.path}: {c.family}, {c.num_layers} layers, {len(targets)} modules quantized\n"
        f"data-free run: recipe {recipe.name} ({'+'.join(recipe.algorithms)}) takes no activation statistic, so no "
        f"calibration data is read and no layer runs; rank 0 writes the output (the recipe and the pins of the "
        f"base's weight files), the other ranks wait for it\n"
        f"\nmemory plan of its export (eprt-export OUT HF_OUT), which quantizes each weight as it writes it, one "
        f"tensor resident at a time: {plan.summary()}\n"
        f"its export serves on: {describe_gpus(recipe.formats)}"
    )


def layout_table(
    state: ParallelState, ck: Checkpoint, dtype: torch.dtype, device: torch.device, ranks: list[dict]
) -> str:
    c = ck.config
    moe = (
        f"{c.num_experts} routed experts in each of MoE layers {spans(c.moe_layers)}"
        if c.moe_layers
        else "no MoE layers"
    )
    ep_groups = sorted({tuple(r["ep_ranks"]) for r in ranks})
    edp_groups = sorted({tuple(r["edp_ranks"]) for r in ranks})
    lines = [
        f"checkpoint {ck.path}: {c.family}, {c.num_layers} layers, {moe}",
        f"world {state.world} = edp {state.edp_size} x ep {state.ep_size}",
        f"ep groups (exchange tokens, split the experts): {' '.join(map(group, ep_groups))}",
        f"edp groups (hold the same experts): {' '.join(map(group, edp_groups))}",
        f"weights in {str(dtype).removeprefix('torch.')}, estimated from the manifest (no weight read); "
        f"planned peak on {device.type}: calibration holds one layer at a time",
        "",
    ]
    on_gpu = ranks[0]["host_peak"] is not None
    rows = [
        (
            "rank",
            "edp rank",
            "ep rank",
            "experts per MoE layer",
            "dense",
            "experts",
            "total",
            "planned peak",
            *(("host",) if on_gpu else ()),
        )
    ]
    for r in ranks:
        rows.append(
            (
                str(r["rank"]),
                str(r["edp_rank"]),
                str(r["ep_rank"]),
                expert_ranges(r["experts"]),
                size(r["dense"]),
                size(r["expert_bytes"]),
                size(r["dense"] + r["expert_bytes"]),
                size(r["peak"]),
                *((size(r["host_peak"]),) if on_gpu else ()),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += [
        "  ".join(cell.ljust(w) if i == 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def expert_ranges(by_layer: dict[int, tuple[int, int]]) -> str:
    """'[first, first+count)', once when every MoE layer holds the same range, else per layer."""
    ranges = {layer: f"[{first}, {first + count})" for layer, (first, count) in by_layer.items()}
    if len(set(ranges.values())) <= 1:
        return next(iter(ranges.values()), "-")
    return " ".join(f"L{layer} {text}" for layer, text in ranges.items())


def spans(layers) -> str:
    """The layer list with runs folded: 0, 2, 5-9."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def group(ranks) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


size = format_bytes
