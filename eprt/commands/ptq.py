"""Post-training quantization of an eprt checkpoint, expert parallel over the ranks of a run.

    eprt-ptq --nproc-per-node N CKPT --recipe nvfp4 --out OUT [--ep E] [--kv-cache fp8]   # N local ranks
    eprt-ptq CKPT --dry-run                                                              # a world of one
    torchrun --nnodes M --nproc-per-node N ... $(which eprt-ptq) CKPT ...                # several nodes

The world factors as edp x ep: the ranks of an ep group hold one share of the routed experts
each and exchange tokens; ep defaults to the world size. --dry-run prints the layout, each
rank's weight bytes and planned peak memory, computed from the checkpoint's manifest without
reading a weight, and exits.
"""

import argparse
import sys

import torch
import torch.distributed as dist

from eprt.cli import run
from eprt.commands.launch import Stopped, launch
from eprt.errors import ConfigError
from eprt.models.loader import open_checkpoint, weight_bytes
from eprt.parallel import ParallelState, fail_together
from eprt.quant.preview import DEFAULT_PROMPT
from eprt.quant.plan import Planner, format_bytes, memory_in_use, parse_size
from eprt.quant.ptq import RUN_DTYPES, PTQArgs, plan_recipe, run_ptq, schedule
from eprt.quant.gptq_layer import ALGORITHM, DEFAULT_MIN_TOKENS
from eprt.quant.recipe import ALGORITHMS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="the eprt checkpoint to quantize (eprt-convert writes one)")
    ap.add_argument("--nproc-per-node", type=int, metavar="N",
                    help="start N ranks on this machine and run on them (one machine; several nodes use torchrun)")
    ap.add_argument("--recipe", help="a recipe of eprt/configs/ptq (fp8, nvfp4, nvfp4_experts_only) or a YAML path")
    ap.add_argument("--out", help="where to write the quantized eprt checkpoint")
    ap.add_argument("--ep", type=int, help="expert-parallel degree; divides the world size and the routed "
                                           "experts (default: the world size)")
    ap.add_argument("--kv-cache", choices=["fp8"], help="also quantize the KV cache")
    ap.add_argument("--algorithm", choices=ALGORITHMS, default=ALGORITHMS[0],
                    help=f"how weight scales are chosen, for the recipe rules that name no algorithm: "
                         f"{', '.join(ALGORITHMS)} (default {ALGORITHMS[0]}; docs/export.md, 'Weight scales')")
    ap.add_argument("--gptq-min-tokens", type=int, default=DEFAULT_MIN_TOKENS,
                    help=f"with gptq, a routed expert with fewer calibration tokens keeps max rounding and is "
                         f"listed (default {DEFAULT_MIN_TOKENS})")
    ap.add_argument("--calib", action="append", metavar="DATA[:SHARE]",
                    help="calibration data: .txt, .jsonl (text or chat messages), .parquet, a saved dataset "
                         "directory, .npy or .safetensors (default: built-in text); repeat with a share each to "
                         "mix sources (--calib chat.jsonl:0.7 --calib code.txt:0.3)")
    ap.add_argument("--calib-column", help="the column (JSONL field) of every --calib source to read (default: "
                                           "text, else messages, rendered with the checkpoint's chat template)")
    ap.add_argument("--calib-size", type=int, default=64, help="calibration sequences, over all ranks")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    ap.add_argument("--eval-size", type=int, default=8,
                    help="held-out sequences of the quality report (KL, top-1 agreement, perplexity, per-layer "
                         "errors; docs/quality.md), taken after the calibration sequences unless --eval; 0: no report")
    ap.add_argument("--eval", help="the quality report's held-out data (.txt, .jsonl, .npy or .safetensors) instead "
                                   "of the sequences after the calibration ones")
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per forward on each rank")
    ap.add_argument("--dtype", choices=list(RUN_DTYPES), default="bf16", help="the dtype the model runs in")
    ap.add_argument("--preview", nargs="?", const=DEFAULT_PROMPT, metavar="PROMPT",
                    help="print the greedy continuation of PROMPT (or of a built-in one) before and after quantization")
    ap.add_argument("--chunk-size", type=int, help="calibration sequences per step of each layer, over all ranks "
                                                   "(default: --batch-size x the world size); changes no result")
    ap.add_argument("--calibrate-all-experts", action="store_true",
                    help="also run every token through every routed expert of its layer, for the statistics only "
                         "(the layer's output still uses its top-k): no expert goes uncalibrated")
    ap.add_argument("--max-memory", type=parse_size, help="refuse a run whose planned peak per rank exceeds this "
                                                         "(e.g. 64GiB; default: the host's available RAM, or the "
                                                         "device's free memory)")
    ap.add_argument("--work-dir", help="where each layer boundary is saved for --resume (default: OUT.work)")
    ap.add_argument("--resume", action="store_true", help="continue a killed run (same arguments) after its last "
                                                          "completed layer")
    ap.add_argument("--dry-run", action="store_true", help="print the layout, each rank's weight bytes and planned "
                                                           "peak memory, and exit")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT once the new one is complete")
    return ap.parse_args(argv)


def ptq() -> int:
    """Start the local ranks (--nproc-per-node), or join the run, read the checkpoint's manifest
    on every rank, then the dry run or calibration."""
    argv = sys.argv[1:]
    a = parse_args(argv)
    if not a.dry_run and not (a.recipe and a.out):
        raise ConfigError("--recipe and --out are required (or --dry-run to print the layout only)")
    if a.nproc_per_node is not None:
        return launch("eprt.commands.ptq", without_nproc(argv), a.nproc_per_node)
    with ParallelState.from_env(ep=a.ep) as state:
        ck = open_checkpoint(a.ckpt, state)
        args = PTQArgs(a.ckpt, a.recipe, a.out, kv_cache=a.kv_cache, calib=tuple(a.calib) if a.calib else None,
                       calib_size=a.calib_size,
                       seq_len=a.seq_len, batch_size=a.batch_size, dtype=a.dtype, preview=a.preview,
                       overwrite=a.overwrite, chunk_size=a.chunk_size, max_memory=a.max_memory, resume=a.resume,
                       work_dir=a.work_dir, algorithm=a.algorithm, gptq_min_tokens=a.gptq_min_tokens,
                       calibrate_all_experts=a.calibrate_all_experts, eval_size=a.eval_size, eval=a.eval,
                       calib_column=a.calib_column)
        if a.dry_run:
            # what PTQ would refuse about this recipe and model, refused now; the plan runs its MTP
            # layers and counts GPTQ's Hessians
            recipe, targets = plan_recipe(ck, a.recipe, a.kv_cache, a.algorithm) if a.recipe else (None, [])
            dry_run(state, ck, RUN_DTYPES[a.dtype], args, targets, mtp=bool(recipe and recipe.mtp),
                    gptq=bool(recipe and ALGORITHM in recipe.algorithms))
            return 0
        run_ptq(state, args)
    return 0


def without_nproc(argv: list[str]) -> list[str]:
    """The command line each rank runs: the same, less --nproc-per-node and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


# --- dry run ---------------------------------------------------------------------------------

def dry_run(state: ParallelState, ck, dtype: torch.dtype, args: PTQArgs, targets: list[str],
            mtp: bool = False, gptq: bool = False) -> None:
    """Every rank works out its own share and memory plan from the manifest (with the MTP layers
    when the recipe runs them, GPTQ's Hessians when it runs GPTQ); rank 0 prints them all."""
    with fail_together(state, "planning the layout"):
        c = ck.config
        held = state.placement(c.num_experts).range
        dense, experts = weight_bytes(ck, dtype=dtype, expert_range=held if c.moe_layers else None)
        n_eval = max(args.eval_size, 0)
        plan = Planner.of(ck, dtype, state.device, targets, mtp=mtp, gptq=gptq).plan(
            rank=state.rank, world=state.world, ep=state.ep_size, num_sequences=args.calib_size,
            seq_len=args.seq_len, schedule=schedule(args, state, c, args.calib_size),
            baseline=memory_in_use(state.device), all_experts=args.calibrate_all_experts, eval_sequences=n_eval,
            eval_schedule=schedule(args, state, c, n_eval) if n_eval else None)
        mine = {"rank": state.rank, "edp_rank": state.edp_rank, "ep_rank": state.ep_rank,
                "ep_ranks": state.ep_ranks, "edp_ranks": state.edp_ranks,
                "experts": {layer: held for layer in c.moe_layers}, "dense": dense, "expert_bytes": experts,
                "peak": plan.peak}
    ranks = [mine]
    if state.world > 1:
        ranks = [None] * state.world if state.rank == 0 else None
        dist.gather_object(mine, ranks, dst=0, group=state.dp_group)
    if state.rank == 0:
        print(layout_table(state, ck, dtype, ranks))


def layout_table(state: ParallelState, ck, dtype: torch.dtype, ranks: list[dict]) -> str:
    c = ck.config
    moe = (f"{c.num_experts} routed experts in each of MoE layers {spans(c.moe_layers)}" if c.moe_layers
           else "no MoE layers")
    ep_groups = sorted({tuple(r["ep_ranks"]) for r in ranks})
    edp_groups = sorted({tuple(r["edp_ranks"]) for r in ranks})
    lines = [
        f"checkpoint {ck.path}: {c.family}, {c.num_layers} layers, {moe}",
        f"world {state.world} = edp {state.edp_size} x ep {state.ep_size}",
        f"ep groups (exchange tokens, split the experts): {' '.join(map(group, ep_groups))}",
        f"edp groups (hold the same experts): {' '.join(map(group, edp_groups))}",
        f"weights in {str(dtype).removeprefix('torch.')}, estimated from the manifest (no weight read); "
        "planned peak: calibration holds one layer at a time",
        "",
    ]
    rows = [("rank", "edp rank", "ep rank", "experts per MoE layer", "dense", "experts", "total", "planned peak")]
    for r in ranks:
        rows.append((str(r["rank"]), str(r["edp_rank"]), str(r["ep_rank"]), expert_ranges(r["experts"]),
                     size(r["dense"]), size(r["expert_bytes"]), size(r["dense"] + r["expert_bytes"]),
                     size(r["peak"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) if i == 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              .rstrip() for row in rows]
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


def main() -> int:
    try:
        return run(ptq)
    except Stopped as e:  # the ranks stop on their own signal, each removing its partial output
        print(f"error: stopped by {e}; every rank was stopped and no output was written", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
