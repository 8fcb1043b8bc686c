"""The PTQ job: plan each rank's memory, calibrate layer by layer (eprt.quant.engine) on each
rank's own data, save the calibration.

Every rank runs this with the same arguments; each step that can fail alone runs inside a
fail-together guard, so a failure on one rank stops every rank with the same message.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from eprt.data import Calibration, calibration_samples, check_sources, parse_sources, read_calibration
from eprt.errors import ConfigError
from eprt.flags import flag, flag_name
from eprt.models.loader import load_parallel, weight_bytes
from eprt.models.resolved import ResolvedCheckpoint, place_tensors
from eprt.parallel import ParallelState
from eprt.parallel.guard import fail_together
from eprt.parallel.output import write_together
from eprt.progress import logger
from eprt.quant.auto_quantize import (
    DEFAULT_CANDIDATES,
    RECIPE_FILE,
    UNQUANTIZED_BITS,
    SearchResult,
    SearchSpace,
    check_algorithm,
    parse_budget,
    parse_candidates,
    search_summary,
)
from eprt.quant.awq_folds import FoldedCheckpoint, Folds
from eprt.quant.calibrate import Calibrator
from eprt.quant.calibrated import refuse_calibrated, write_calibrated
from eprt.quant.datafree import run_data_free, statistics_needed
from eprt.quant.engine import LayerEngine
from eprt.quant.feasibility import quantized_modules
from eprt.quant.fingerprint import (
    agree_over_ranks,
    check_base_read,
    check_base_unchanged,
    check_pins_as_start,
    run_fingerprint,
)
from eprt.quant.formats.kv import KV_CACHE_FORMATS
from eprt.quant.gptq_layer import ALGORITHM, DEFAULT_MIN_TOKENS, GPTQRun
from eprt.quant.mxfp4_sources import mxfp4_blocks_kept
from eprt.quant.passes import layer_passes
from eprt.quant.passes.auto_quantize import FormatErrors
from eprt.quant.passes.awq import AWQ
from eprt.quant.passes.quality import QualityStreams
from eprt.quant.plan import (
    MemoryPlan,
    Planner,
    RunShape,
    available_memory,
    check_host_memory,
    check_memory,
    current_rss,
    measured_peak,
    memory_in_use,
)
from eprt.quant.preview import DEFAULT_PROMPT, fake_quantize, greedy
from eprt.quant.quality import QualityReport
from eprt.quant.recipe import ALGORITHMS, Recipe, load_recipe
from eprt.quant.sequences import group_tokens, own_sequences
from eprt.quant.workdir import WorkDir, check_work_dir
from eprt.storage.atomic import check_output_dir, naming_refused_writes
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.units import format_bytes, parse_size

# `--dtype`: the dtype the model runs in
RUN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _max_memory(text: str) -> int:
    return parse_size(text, "--max-memory")


def _max_host_memory(text: str) -> int:
    return parse_size(text, "--max-host-memory")


@dataclass(frozen=True)
class PTQArgs:
    """A PTQ run's settings; each flag field is also its command-line flag (eprt.flags)."""

    ckpt: str = flag(help="the eprt checkpoint to quantize (eprt-convert writes one)", positional=True)
    recipe: str | None = flag(help="a recipe of eprt/configs/ptq (fp8, nvfp4, nvfp4_experts_only) or a YAML path")
    out: str | None = flag(help="where to write the quantized eprt checkpoint")
    ep: int | None = flag(
        help="expert-parallel degree; divides the world size and the routed experts (default: the world size)"
    )
    kv_cache: str | None = flag(choices=sorted(KV_CACHE_FORMATS), help="also quantize the KV cache")
    auto_quantize: float | None = flag(
        type=parse_budget,
        metavar="BUDGET",
        help="search each module group's format under BUDGET effective bits per active parameter (e.g. "
        "4.8bits) instead of --recipe; writes the chosen recipe into OUT (docs/quality.md, 'Format search')",
    )
    auto_quantize_formats: str = flag(
        ",".join(DEFAULT_CANDIDATES),
        metavar="FORMATS",
        help=f"the formats --auto-quantize chooses from, comma-separated (default {','.join(DEFAULT_CANDIDATES)})",
    )
    algorithm: str = flag(
        ALGORITHMS[0],
        choices=ALGORITHMS,
        help=f"how weight scales are chosen, for the recipe rules that name no algorithm: "
        f"{', '.join(ALGORITHMS)} (default {ALGORITHMS[0]}; docs/export.md, 'Weight scales')",
    )
    gptq_min_tokens: int = flag(
        DEFAULT_MIN_TOKENS,
        help=f"with gptq, a routed expert with fewer calibration tokens keeps max rounding "
        f"and is listed (default {DEFAULT_MIN_TOKENS})",
    )
    calib: tuple[str, ...] = flag(
        (),
        metavar="DATA[:SHARE]",
        help="calibration data: .txt, .jsonl (text or chat messages), .parquet, a saved "
        "dataset directory, .npy or .safetensors (default: built-in text); repeat with "
        "a share each to mix sources (--calib chat.jsonl:0.7 --calib code.txt:0.3)",
    )
    calib_column: str | None = flag(
        help="the column (JSONL field) of every --calib source to read (default: text, "
        "else messages, rendered with the checkpoint's chat template)"
    )
    calib_size: int = flag(64, help="calibration sequences, over all ranks")
    seq_len: int = flag(256, help="tokens per calibration sequence")
    eval_size: int = flag(
        8,
        help="held-out sequences of the quality report (KL, top-1 agreement, perplexity, "
        "per-layer errors; docs/quality.md), taken after the calibration sequences unless "
        "--eval; 0: no report",
    )
    eval: str | None = flag(
        help="the quality report's held-out data (.txt, .jsonl, .npy or .safetensors) instead of "
        "the sequences after the calibration ones"
    )
    batch_size: int = flag(1, help="sequences per forward on each rank")
    dtype: str = flag("bf16", choices=list(RUN_DTYPES), help="the dtype the model runs in")
    preview: str | None = flag(
        const=DEFAULT_PROMPT,
        metavar="PROMPT",
        help="print the greedy continuation of PROMPT (or of a built-in one) before and after quantization",
    )
    chunk_size: int | None = flag(
        help="calibration sequences per step of each layer, over all ranks (default: "
        "--batch-size x the world size); changes no result"
    )
    calibrate_all_experts: bool = flag(
        False,
        help="also run every token through every routed expert of its layer, "
        "for the statistics only (the layer's output still uses its "
        "top-k): no expert goes uncalibrated",
    )
    max_memory: int | None = flag(
        type=_max_memory,
        help="refuse a run whose planned peak per rank on its device exceeds this (e.g. "
        "64GiB; default: the device's free memory, or on CPU the host's available "
        "RAM)",
    )
    max_host_memory: int | None = flag(
        type=_max_host_memory,
        help="with GPUs, refuse a run whose ranks on one host together plan more "
        "host memory than this (e.g. 1TiB; default: the host's available RAM)",
    )
    work_dir: str | None = flag(help="where each layer boundary is saved for --resume (default: OUT.work)")
    resume: bool = flag(False, help="continue a killed run (same arguments) after its last completed layer")
    dry_run: bool = flag(False, help="print the layout, each rank's weight bytes and planned peak memory, and exit")
    estimate_time: bool = flag(
        False,
        help="with --dry-run and --recipe, also estimate the calibration's wall time: a probe runs one layer "
        "of each kind at random on this machine's device (on the GPU node the run will use)",
    )
    device: str | None = flag(
        choices=["cpu", "cuda"],
        help="with --dry-run, plan for ranks on this device (default: this machine's), e.g. "
        "GPU ranks planned from a login node without GPUs",
    )
    overwrite: bool = flag(False, help="replace a non-empty OUT once the new one is complete")
    progress: bool = True
    group_tokens: int | None = None  # tokens per expert work unit's group of sequences (default: from the model)


# what only calibration reads: a data-free run names those given as unused
CALIBRATION_SETTINGS = (
    "ep",
    "calib",
    "calib_column",
    "calib_size",
    "seq_len",
    "eval_size",
    "batch_size",
    "chunk_size",
    "dtype",
    "calibrate_all_experts",
    "gptq_min_tokens",
    "work_dir",
    "resume",
    "max_memory",
    "max_host_memory",
    "device",
)


def run_ptq(
    state: ParallelState, a: PTQArgs, on_weight=None, ck: Checkpoint | None = None, search: SearchResult | None = None
) -> dict:
    """Write `a.out`, the calibrated checkpoint of `a.ckpt` under `a.recipe`: with --auto-quantize,
    the format search first (`run_auto_quantize`, which then calibrates its choice, `search`);
    without data or a forward pass where nothing needs them (eprt.quant.datafree: the recipe takes
    no statistic, and neither --eval nor --preview asks for the model to run), else by calibration
    (`run_calibration`). Returns {"out", "calibration_s", "tokens", "resumed_after", "quality"}."""
    if a.auto_quantize is not None:
        return run_auto_quantize(state, a, on_weight, ck)
    try:
        recipe = load_recipe(a.recipe, a.kv_cache, a.algorithm)
    except ConfigError:  # refused by the calibration's checks, in their order, on every rank together
        return run_calibration(state, a, on_weight, ck, search)
    if search is not None or not data_free(recipe, a):  # the search's choice is written beside the calibration
        return run_calibration(state, a, on_weight, ck, search)
    if state.rank == 0:
        say_data_free(a, recipe)
    return run_data_free(state, a.ckpt, a.out, recipe, overwrite=a.overwrite, ck=ck)


def data_free(recipe: Recipe, a: PTQArgs) -> bool:
    """Whether the run needs no data and no forward pass: `recipe` takes no statistic, and neither
    the quality report on --eval data nor the preview asks for the model to run."""
    return not statistics_needed(recipe) and a.eval is None and a.preview is None


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


def run_calibration(
    state: ParallelState, a: PTQArgs, on_weight=None, ck: Checkpoint | None = None, search: SearchResult | None = None
) -> dict:
    """Calibrate and write `a.out`; returns {"out", "calibration_s", "tokens" (on this rank),
    "resumed_after" (the layer a --resume continued after, -1 for none), "quality" (the report,
    None without one)}. `on_weight(tensor name, weight)` sees each weight as the quality report
    fake-quantizes it (this rank's rows of routed experts). `ck`: `a.ckpt` as the command opened
    it (default: opened here); the run closes it. `search`: what --auto-quantize chose, for the
    output's recipe file and report."""
    log = logger()
    with fail_together(state, "reading the checkpoint and the recipe"):
        ck, rc = open_unquantized(state, a, ck)
        recipe, targets = plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm)
        cfg, hf_dir = ck.config, ck.hf_files_dir()
        state.check_experts(cfg.num_experts)
        warn_beyond_positions(cfg, a.seq_len, state.rank)
        if a.gptq_min_tokens < 1:
            raise ConfigError(f"--gptq-min-tokens {a.gptq_min_tokens} must be positive")
        folds = Folds() if any(recipe.balanced(m) for m in targets) else None
        if folds is not None:
            if a.calibrate_all_experts:
                raise ConfigError(
                    "--calibrate-all-experts with AWQ: AWQ measures its folded layers' statistics again from the "
                    "routed tokens alone; leave out --calibrate-all-experts, or choose another --algorithm"
                )
            rc = dataclasses.replace(rc, ck=FoldedCheckpoint(ck, folds))  # the run reads its layers folded
        check_data_settings(a)
        work_path = check_work_dir(a.work_dir or a.out.rstrip("/") + ".work", run_inputs(ck, a), a.out)
    with ck:
        # planned from the sizes alone, before the data is read: a run too large for its memory
        # builds nothing of that size
        with fail_together(state, "planning memory"):
            plan, preview = plan_run(
                state,
                rc,
                a,
                targets,
                mtp=recipe.mtp,
                gptq=gptq_formats(recipe, targets),
                awq=[m for m in targets if recipe.balanced(m)],
            )
        with fail_together(state, "reading the calibration data"):
            samples, eval_ids, used = report_data(a, hf_dir, cfg.vocab_size)
            identity = fingerprint(ck, a, state, samples, eval_ids, recipe)
        with fail_together(state, "comparing the ranks' inputs"):
            agree_over_ranks(state, identity, ck.path)  # every rank gets here: the guard above passed on all
        model = None
        if preview:
            model = load_parallel(rc, state)
            text = before = greedy(model, hf_dir, a.preview)  # every rank runs it: the experts need all of them
            if state.rank == 0:
                log.info("before: %r -> %r", a.preview, text)
        cal = Calibrator(None, targets, kv=recipe.kv_cache is not None, all_experts=a.calibrate_all_experts)
        gptq = (
            GPTQRun(
                state,
                rc,
                recipe,
                targets,
                tokens=samples.numel(),
                min_tokens=a.gptq_min_tokens,
                expert_stack=plan.expert_stack,
            )
            if ALGORITHM in recipe.roundings
            else None
        )
        work = WorkDir(work_path, state, identity, ck.path)
        with fail_together(state, "preparing the work directory"):
            work.prepare(a.resume)
        with fail_together(state, "preparing the work directory"):
            work.check_shared()
        start = time.perf_counter()
        with fail_together(state, "calibrating"), torch.inference_mode():
            data = describe_calib(a.calib) or "the built-in corpus"
            report = (
                QualityReport(
                    state,
                    ck,
                    recipe,
                    targets,
                    eval_ids,
                    a.eval
                    or f"the last {a.eval_size} of "
                    f"{a.calib_size + a.eval_size} sequences of {data}, held out of calibration",
                    on_weight,
                )
                if eval_ids is not None
                else None
            )
            resumed = calibrate_layers(state, rc, cal, recipe, samples, a, work, report, gptq, folds)
            cal.check_finite(state.rank)  # before the reduction spreads one rank's NaN to all
            cal.reduce(state)
            check_base_unchanged(ck, identity)
        seconds = time.perf_counter() - start
        log.info("peak memory %s, planned %s", format_bytes(measured_peak(state.device)), format_bytes(plan.peak))
        coverage = report_coverage(cal, state, cfg.num_experts)
        quality = report.result if report is not None else None
        if report is not None:
            report.log()
        if preview:
            first = state.placement(cfg.num_experts).first if cfg.moe_layers else 0
            if folds is not None:  # the model was loaded before calibration folded it
                mine = rc.holding(state.placement(cfg.num_experts).range if cfg.moe_layers else None)
                place_tensors(mine, model, folds.tensor_names(), device=state.device)
            quantized = gptq.results.apply(model, rc.ck, gptq.formats, first) if gptq is not None else ()
            fake_quantize(model, targets, recipe, cal, state, source_dtype=rc.source_dtype, quantized=quantized)
            text = greedy(model, hf_dir, a.preview)
            if state.rank == 0:
                log.info("after (%s, fake-quantized): %r -> %r", recipe.name, a.preview, text)
        summary = {
            "algorithm": "+".join(recipe.algorithms),
            "samples": a.calib_size,
            "seq_len": a.seq_len,
            "tokens": a.calib_size * a.seq_len,
            "data": describe_calib(a.calib) or "built-in corpus",
            "all_experts": a.calibrate_all_experts,
        }
        if gptq is not None:
            summary.update(gptq_min_tokens=a.gptq_min_tokens, gptq_skipped_experts=gptq.results.summary())
        summary["sources"] = [u.to_json() for u in used]
        reencoded = mxfp4_blocks_kept(ck, rc.layout, {m: recipe.format_of(m) for m in targets})
        if reencoded is not None:  # an MXFP4 source's experts, kept value for value where NVFP4 can
            summary["mxfp4_reencoded"] = reencoded
            if state.rank == 0:
                log.info(
                    "the source's MXFP4 experts re-encoded value for value: %d of %d blocks of 32 exact; %d lie "
                    "more than 17 binades below their expert's largest block and are rounded",
                    reencoded["kept"],
                    reencoded["blocks"],
                    reencoded["blocks"] - reencoded["kept"],
                )
        if report is not None:  # the page's additions to the report (eprt.report)
            report.describe_run(
                summary,
                starved_experts(coverage, summary),
                {"prompt": a.preview, "before": before, "after": text} if preview else None,
            )
            if search is not None:
                quality["auto_quantize"] = {**search.summary, "measured_kl": quality["kl_mean"]}
        results = gptq.results if gptq is not None else None

        def write(tmp: str) -> None:
            with naming_refused_writes(tmp, f"the output {a.out}", "write the output elsewhere"):
                write_calibrated(tmp, a.out, state, cal, ck, recipe, summary, quality, results, folds)
                if search is not None and state.rank == 0:
                    with open(os.path.join(tmp, RECIPE_FILE), "w", encoding="utf-8") as f:
                        f.write(search.recipe_yaml)

        write_together(
            state,
            a.out,
            write,
            overwrite=a.overwrite,
            inputs=ck.input_dirs(),
            check_fn=lambda tmp: check_pinned_as_read(tmp, ck, identity),
        )
        with fail_together(state, "removing the work directory"):
            work.remove()
    if state.rank == 0:
        log.info("calibrated %d tokens in %.2f s (%.0f tokens/s)", samples.numel(), seconds, samples.numel() / seconds)
        log.info("calibrated %s with %s -> %s", a.ckpt, recipe.name, a.out)
    mine = len(own_sequences(samples.shape[0], state.rank, state.world)) * samples.shape[1]
    return {"out": a.out, "calibration_s": seconds, "tokens": mine, "resumed_after": resumed, "quality": quality}


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
    if a.dtype not in RUN_DTYPES:
        raise ConfigError(f"--dtype {a.dtype!r}: choose one of {', '.join(RUN_DTYPES)}")
    return ck, ResolvedCheckpoint.of(ck, RUN_DTYPES[a.dtype])  # the one resolution the whole run reads


def run_auto_quantize(state: ParallelState, a: PTQArgs, on_weight=None, ck: Checkpoint | None = None) -> dict:
    """--auto-quantize (eprt.quant.auto_quantize): the search's layer-major pass, the choice, then
    the chosen recipe calibrated as any recipe is, into `a.out` with the recipe (RECIPE_FILE), so that
    `--recipe OUT/auto_recipe.yaml` reproduces the export. Returns what run_ptq returns."""
    with fail_together(state, "reading the checkpoint and the search's settings"):
        if a.recipe is not None:
            raise ConfigError(
                f"--recipe {a.recipe} with --auto-quantize: the search writes the recipe; give one or the other"
            )
        if a.auto_quantize <= 0:
            raise ConfigError(f"--auto-quantize {a.auto_quantize}: give a positive budget of bits, e.g. 4.8bits")
        check_algorithm(a.algorithm)
        if a.eval_size < 1:
            raise ConfigError(
                f"--auto-quantize with --eval-size {a.eval_size}: the search fits its KL estimate on the quality "
                "report's held-out sequences; give a positive --eval-size"
            )
        if a.resume:
            raise ConfigError("--resume with --auto-quantize: the search does not resume; run it again")
        ck, rc = open_unquantized(state, a, ck)
        cfg = ck.config
        space = SearchSpace.of(
            rc.layout, parse_candidates(a.auto_quantize_formats), cfg.num_experts_per_tok, cfg.num_experts
        )
        space.check_budget(a.auto_quantize)
        if "none" in space.candidates and a.auto_quantize >= space.effective_bits(
            {g.name: "none" for g in space.groups}
        ):
            raise ConfigError(
                f"--auto-quantize {a.auto_quantize:g}bits leaves every module unquantized: nothing to export; "
                f"give a budget below {UNQUANTIZED_BITS} bits"
            )
        state.check_experts(cfg.num_experts)
        check_data_settings(a)
    with ck:
        with fail_together(state, "planning memory"):
            plan_run(state, rc, replace(a, preview=None), space.targets, search=True)
        with fail_together(state, "reading the calibration data"):
            samples, eval_ids, _ = report_data(a, ck.hf_files_dir(), cfg.vocab_size)
        with fail_together(state, "searching the formats"), torch.inference_mode():
            errors, smallest_kl = measure_format_errors(state, rc, space, samples, eval_ids, a)
    choice = space.choose(a.auto_quantize, errors)
    smallest_error = space.loss(space.smallest(), errors)
    kl_per_error = smallest_kl / smallest_error if smallest_error > 0 else 0.0
    summary = search_summary(space, a.auto_quantize, choice, errors, kl_per_error, smallest_kl)
    text = space.recipe_yaml(choice, a.kv_cache, a.auto_quantize, a.algorithm)
    if state.rank == 0:
        logger().info(
            "auto-quantize: %.4f effective bits (budget %g), estimated KL %.6g; the recipe: %s",
            summary["effective_bits"],
            a.auto_quantize,
            summary["estimated_kl"],
            os.path.join(a.out, RECIPE_FILE),
        )
    with tempfile.TemporaryDirectory() as d:  # each rank reads its own copy of the same recipe
        path = os.path.join(d, RECIPE_FILE)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return run_ptq(
            state, replace(a, recipe=path, auto_quantize=None), on_weight, search=SearchResult(summary, text)
        )


def measure_format_errors(
    state: ParallelState,
    rc: ResolvedCheckpoint,
    space: SearchSpace,
    samples: torch.Tensor,
    eval_ids: torch.Tensor,
    a: PTQArgs,
) -> tuple[dict[tuple[str, str], float], float]:
    """The search's layer-major pass: max statistics of every module a candidate quantizes, each
    group's error in each candidate on the calibration sequences (eprt.quant.passes.auto_quantize),
    and the quality report of every group in its smallest candidate on the held-out ones (the KL
    estimate's constant). Returns the errors and that report's mean KL."""
    shape = run_shape(a, state, rc.ck.config)
    cal = Calibrator(None, space.targets, kv=False, all_experts=a.calibrate_all_experts)
    smallest = space.recipe(space.smallest(), None, a.algorithm)
    targets = list(quantized_modules(rc.layout, smallest, rc.ck.path))
    report = QualityReport(state, rc.ck, smallest, targets, eval_ids, "held out")
    calibration = shape.schedule_of(samples.shape[0])
    errors = FormatErrors(state, cal, rc, space, samples, calibration, a.algorithm)
    held_out = QualityStreams(state, report, shape.schedule_of(eval_ids.shape[0]))
    passes = layer_passes(cal, smallest, rc, quality=held_out, format_errors=errors)
    engine = LayerEngine(state, rc, samples, passes, schedule=calibration, progress=a.progress)
    engine.run(0, engine.embed())
    return errors.errors, report.result["kl_mean"]


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


def gptq_formats(recipe: Recipe, targets: list[str]) -> dict[str, str] | None:
    """The modules `recipe` runs GPTQ on, each with its format; None where it runs GPTQ on none."""
    if ALGORITHM not in recipe.roundings:
        return None
    return {m: recipe.format_of(m) for m in targets if recipe.rounding_of(m) == ALGORITHM}


def ranks_on_this_host(state: ParallelState) -> int:
    """The ranks that share this rank's host memory: torchrun's LOCAL_WORLD_SIZE (the world, where
    no launcher says)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", state.world))


def plan_run(
    state: ParallelState,
    rc: ResolvedCheckpoint,
    a: PTQArgs,
    targets: list[str],
    mtp: bool = False,
    gptq: dict[str, str] | None = None,
    search: bool = False,
    awq: list[str] = (),
) -> tuple[MemoryPlan, bool]:
    """Refuse, before any weight or token is read, a run whose planned peak exceeds --max-memory
    (on a GPU, or whose ranks' host memory on this host exceeds --max-host-memory); the plan, and
    whether the preview's whole model fits beside it (rank 0 says so when it does not). `mtp`: the
    recipe runs the multi-token-prediction layers; `gptq`: the modules it runs GPTQ on, with their
    formats (the plan counts their Hessians and codes); `search`: the format search's pass (its streams);
    `awq`: the modules AWQ balances (the plan counts its samples)."""
    c = rc.ck.config
    planner = Planner.of(rc, state.device, targets, mtp=mtp, gptq=gptq, awq=awq)
    shape = replace(run_shape(a, state, c), search=search)
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


def fingerprint(
    ck: Checkpoint,
    a: PTQArgs,
    state: ParallelState,
    samples: torch.Tensor,
    eval_ids: torch.Tensor | None,
    recipe: Recipe | None = None,
) -> dict:
    """What a saved layer boundary and the output depend on (eprt.quant.fingerprint): a run
    resumes only from its own (batch and chunk sizes change no bit, so they may differ).
    `recipe`: as the run parsed it (default: `a`'s, parsed now)."""
    recipe = recipe or load_recipe(a.recipe, a.kv_cache, a.algorithm)
    return run_fingerprint(
        ck,
        recipe,
        samples,
        eval_ids,
        {
            "dtype": a.dtype,
            "world": state.world,
            "ep": state.ep_size,
            "group_size": run_shape(a, state, ck.config).schedule_of(samples.shape[0]).group_size,
            "gptq_min_tokens": a.gptq_min_tokens,
            "all_experts": a.calibrate_all_experts,
        },
    )


def run_inputs(ck: Checkpoint, a: PTQArgs) -> tuple[str, ...]:
    """Every path the run reads: the checkpoint (with its base), the data, a recipe given as a file."""
    calib = [s.path for s in parse_sources(a.calib)] if a.calib else []
    files = (*calib, a.eval, a.recipe if os.path.isfile(a.recipe) else None)
    return (*ck.input_dirs(), *(f for f in files if f is not None))


def check_pinned_as_read(tmp: str, ck: Checkpoint, identity: dict) -> None:
    """The output about to appear pins the base as it was when this run started and read it."""
    with open(os.path.join(tmp, MANIFEST)) as f:
        pins = json.load(f)["base"]["weights"]
    check_pins_as_start(ck.path, identity, pins, "while the output was written")


def calibrate_layers(
    state: ParallelState,
    rc: ResolvedCheckpoint,
    cal: Calibrator,
    recipe: Recipe,
    samples: torch.Tensor,
    a: PTQArgs,
    work: WorkDir,
    report: QualityReport | None = None,
    gptq: GPTQRun | None = None,
    folds: Folds | None = None,
) -> int:
    """The layer-major engine over this rank's share of `samples` (and with `report`, of the
    held-out sequences), through the run's passes (eprt.quant.passes), each layer boundary saved in
    `work` (with GPTQ's results and AWQ's `folds` so far, `rc` reading its checkpoint through
    them); with --resume, from the last one saved. Returns the layer it resumed after (-1: none)."""
    ck = rc.ck
    shape = run_shape(a, state, ck.config)
    quality = QualityStreams(state, report, shape.schedule_of(report.eval_ids.shape[0])) if report else None
    awq = AWQ(cal, recipe, folds, writes=gptq is None) if folds is not None else None
    passes = layer_passes(cal, recipe, rc, quality=quality, awq=awq, gptq=gptq)
    engine = LayerEngine(state, rc, samples, passes, schedule=shape.schedule_of(samples.shape[0]), progress=a.progress)
    results = gptq.results if gptq is not None else None
    done = work.last_completed(a.resume)
    ls = work.load(done, cal, state.device, quality, results, folds) if done >= 0 else engine.embed()

    def after_layer(i: int, ls_) -> None:
        check_base_read(ck, work.fingerprint)  # the files this layer read are the ones pinned at the start
        work.save(i, ls_, cal, quality, results, folds)

    engine.run(done + 1, ls, after_layer=after_layer)
    return done


def check_data_settings(a: PTQArgs) -> None:
    """Refuse the data settings before the memory plan, which runs before any data is read."""
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size {a.batch_size} must be positive")
    if a.eval_size < 0:
        raise ConfigError(f"--eval-size {a.eval_size}: give a positive size, or 0 for no quality report")
    if a.eval_size == 0 and a.eval is not None:
        raise ConfigError(f"--eval {a.eval} with --eval-size 0: give a positive --eval-size, or leave out --eval")
    check_sources(a.calib)
    if a.eval is not None:
        check_sources(a.eval, "--eval")


def describe_calib(calib: str | tuple[str, ...] | None) -> str | None:
    """--calib as given, for the report and the summary."""
    return calib if isinstance(calib, str) or calib is None else ", ".join(calib)


def report_data(a: PTQArgs, hf_dir: str, vocab_size: int) -> Calibration:
    """The calibration sequences, the quality report's held-out ones (None with --eval-size 0) and
    what each source gave: the last --eval-size of calib_size + eval_size sequences of the data
    (of each source, its share), or --eval-size of --eval FILE."""
    data = read_calibration(
        a.calib,
        hf_dir,
        num_samples=a.calib_size,
        held_out=a.eval_size if a.eval is None else 0,
        seq_len=a.seq_len,
        vocab_size=vocab_size,
        column=a.calib_column,
    )
    if a.eval_size and a.eval is not None:
        data = data._replace(
            held_out=calibration_samples(
                a.eval, hf_dir, num_samples=a.eval_size, seq_len=a.seq_len, vocab_size=vocab_size, column=a.calib_column
            )
        )
    return data


def plan_recipe(
    rc: ResolvedCheckpoint, spec: str, kv_cache: str | None = None, algorithm: str | None = None
) -> tuple[Recipe, list[str]]:
    """The recipe `spec` (its rules that name no algorithm get `algorithm`) and the modules it
    quantizes in `rc`, from the manifest alone: whatever export would refuse about this recipe
    and this model is refused here, before a weight is read."""
    recipe = load_recipe(spec, kv_cache, algorithm)
    return recipe, list(quantized_modules(rc.layout, recipe, rc.ck.path))


def warn_beyond_positions(cfg, seq_len: int, rank: int) -> None:
    """Calibrating past the positions the model was trained for records activations no deployment
    sees; allowed (a user may mean it), said once."""
    if seq_len > cfg.max_position_embeddings and rank == 0:
        logger().warning(
            "--seq-len %d is beyond the model's max_position_embeddings %d; the calibration "
            "sees positions the model was not trained for: lower --seq-len",
            seq_len,
            cfg.max_position_embeddings,
        )


def report_coverage(
    cal: Calibrator, state: ParallelState, num_experts: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Rank 0 prints, per MoE layer, the tokens the router sent each expert and the experts none
    reached; with --calibrate-all-experts, also the tokens each expert saw for statistics only.
    Returns both counts per MoE module, on every rank."""
    log = logger()
    counts = {}
    for module, tokens in cal.expert_tokens.items():
        full = every_expert(tokens, state, num_experts)
        seen = every_expert(cal.expert_all_tokens[module], state, num_experts) if cal.all_experts else None
        counts[module] = full, seen
        if state.rank != 0:
            continue
        unreached = (full == 0).nonzero().view(-1).tolist()
        if seen is not None:
            unreached_note = f"; the router sent no token to experts {unreached}" if unreached else ""
            log.info(
                "%s: routed tokens per expert min %d / median %d / max %d%s; all-experts statistics: "
                "tokens per expert min %d / max %d",
                module,
                int(full.min()),
                int(full.median()),
                int(full.max()),
                unreached_note,
                int(seen.min()),
                int(seen.max()),
            )
            continue
        log.info(
            "%s: tokens per expert min %d / median %d / max %d%s",
            module,
            int(full.min()),
            int(full.median()),
            int(full.max()),
            f"; no token reached experts {unreached} (they get the layer's input scale; "
            "--calibrate-all-experts calibrates them)"
            if unreached
            else "",
        )
    return counts


def starved_experts(coverage: dict[str, tuple[torch.Tensor, torch.Tensor | None]], summary: dict) -> list[dict]:
    """Per MoE module, for the quality report: the calibration tokens the router sent each expert,
    those --calibrate-all-experts gave it, and what was done for the experts that starved."""
    gptq_skipped = summary.get("gptq_skipped_experts", {})
    out = []
    for module, (full, seen) in coverage.items():
        unreached = (full == 0).nonzero().view(-1).tolist()
        out.append(
            {
                "module": module,
                "tokens": full.tolist(),
                "all_experts_tokens": None if seen is None else seen.tolist(),
                "unreached": unreached,
                "gptq_max_rounding": gptq_skipped.get(module, []),
                "unreached_handling": ""
                if not unreached
                else "calibrated on every token of the layer (--calibrate-all-experts)"
                if seen is not None
                else "the layer's input scale (no token reached them; --calibrate-all-experts calibrates them)",
            }
        )
    return out


def every_expert(rows: torch.Tensor, state: ParallelState, num_experts: int) -> torch.Tensor:
    """A per-expert count of this rank's experts (reduced over edp) as one for all of them, on every rank."""
    first = state.placement(num_experts).first
    full = torch.zeros(num_experts, dtype=torch.int64, device=rows.device)
    full[first : first + rows.shape[0]] = rows
    return state.all_reduce(full, over="ep", op=dist.ReduceOp.SUM).cpu()
