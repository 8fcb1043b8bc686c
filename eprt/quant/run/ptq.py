"""The PTQ job: `run_ptq` sends a run down its path (the format search first under
--auto-quantize, eprt.quant.algorithms.search.auto_quantize_run; a data-free recipe, eprt.quant.run.datafree; else
calibration), and `run_calibration` plans each rank's memory (eprt.quant.run.setup), reads its data
(eprt.quant.run.data), calibrates layer by layer (eprt.quant.loop.engine) on each rank's own data and
saves the calibration.

Every rank runs this with the same arguments; each step that can fail alone runs inside a
fail-together guard, so a failure on one rank stops every rank with the same message.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import replace

import torch

from eprt.data import parse_sources
from eprt.errors import ConfigError
from eprt.loading.loader import load_parallel
from eprt.parallel import ParallelState
from eprt.parallel.guard import fail_together
from eprt.parallel.output import write_together
from eprt.progress import logger
from eprt.quant.act_headroom import headroom_targets
from eprt.quant.algorithms.program import ProgramRun, program_of
from eprt.quant.algorithms.registry import option_flags
from eprt.quant.algorithms.search.auto_quantize import RECIPE_FILE, SearchResult
from eprt.quant.algorithms.search.auto_quantize_run import search_formats
from eprt.quant.calibrated import write_calibrated
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.loop.passes.quality import QualityStreams
from eprt.quant.loop.sequences import own_sequences
from eprt.quant.mxfp4_sources import mxfp4_blocks_kept
from eprt.quant.preview import fake_quantize, greedy
from eprt.quant.quality import QualityReport
from eprt.quant.recipe import Recipe, load_recipe
from eprt.quant.rotation.rotated import RotatedCheckpoint, say_rotation
from eprt.quant.run.args import PTQArgs, algorithm_options
from eprt.quant.run.data import check_data_settings, describe_calib, report_data
from eprt.quant.run.datafree import data_free, run_data_free, say_calibrated, say_data_free
from eprt.quant.run.expert_coverage import report_coverage, starved_experts
from eprt.quant.run.fingerprint import (
    agree_over_ranks,
    check_base_read,
    check_base_unchanged,
    check_pins_as_start,
    run_fingerprint,
)
from eprt.quant.run.process_memory import measured_peak
from eprt.quant.run.save_time import saves_after
from eprt.quant.run.setup import open_unquantized, plan_recipe, plan_run, run_shape
from eprt.quant.run.workdir import WorkDir, check_work_dir
from eprt.quant.size import recipe_size
from eprt.quant.source_grid import checkpoint_int4_grid
from eprt.storage.atomic import naming_refused_writes, write_file
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.units import format_bytes


def run_ptq(state: ParallelState, a: PTQArgs, on_weight=None, ck: Checkpoint | None = None) -> dict:
    """Write `a.out`, the calibrated checkpoint of `a.ckpt` under `a.recipe`: with --auto-quantize,
    the format search first (`run_auto_quantize`, which then calibrates its choice); without data
    or a forward pass where nothing needs them (eprt.quant.run.datafree: the recipe takes no statistic,
    and neither --eval nor --preview asks for the model to run), else by calibration
    (`run_calibration`). Returns {"out", "calibration_s", "tokens", "resumed_after", "quality"}."""
    if a.auto_quantize is not None:
        return run_auto_quantize(state, a, on_weight, ck)
    try:
        recipe = load_recipe(a.recipe, a.kv_cache, a.algorithm)
    except ConfigError:  # refused by the calibration's checks, in their order, on every rank together
        return run_calibration(state, a, on_weight, ck)
    if not data_free(recipe, a):
        if state.rank == 0:
            say_calibrated(recipe)
        return run_calibration(state, a, on_weight, ck)
    if state.rank == 0:
        say_data_free(a, recipe)
    return run_data_free(state, a.ckpt, a.out, recipe, overwrite=a.overwrite, ck=ck)


def run_calibration(
    state: ParallelState, a: PTQArgs, on_weight=None, ck: Checkpoint | None = None, search: SearchResult | None = None
) -> dict:
    """Calibrate and write `a.out`; returns {"out", "calibration_s", "tokens" (on this rank),
    "resumed_after" (the layer a --resume continued after, -1 for none), "quality" (the report,
    None without one)}. `on_weight(tensor name, weight)` sees each weight as the quality report
    fake-quantizes it (this rank's rows of routed experts). `ck`: `a.ckpt` as the command opened
    it (default: opened here); the run closes it. `search`: what --auto-quantize chose, for the
    output's recipe file and report, and the data it read; with its statistics, the run keeps them
    and runs the held-out sequences alone."""
    log = logger()
    kept = search is not None and search.statistics is not None
    ck, recipe, targets, run, work_path = settle(state, a, ck, search)
    rc, cfg, hf_dir = run.rc, ck.config, ck.hf_files_dir()
    with ck:
        # planned from the sizes alone, before the data is read: a run too large for its memory
        # builds nothing of that size
        with fail_together(state, "planning memory"):
            plan, preview = plan_run(state, rc, a, run.program)
        with fail_together(state, "reading the calibration data"):
            samples, eval_ids, used = search.data if search is not None else report_data(a, hf_dir, cfg.vocab_size)
            identity = fingerprint(ck, a, state, samples, eval_ids, recipe)
        with fail_together(state, "comparing the ranks' inputs"):
            agree_over_ranks(state, identity, ck.path)  # every rank gets here: the guard above passed on all
        model = load_parallel(rc, state) if preview else None
        before = preview_text(model, hf_dir, a.preview, state.rank, "before") if preview else None
        kv = recipe.kv_cache is not None
        cal = (
            search.chosen_statistics(targets, kv)
            if kept
            else Calibrator(
                None, targets, kv=kv, all_experts=a.calibrate_all_experts, headroom=headroom_targets(recipe, targets)
            )
        )
        run.begin(state, cal, tokens=samples.numel(), options=algorithm_options(a), expert_stack=plan.expert_stack)
        work = WorkDir(work_path, state, identity, ck.path)
        with fail_together(state, "preparing the work directory"):
            work.prepare(a.resume)
        with fail_together(state, "preparing the work directory"):
            work.check_shared()
        start = time.perf_counter()
        with fail_together(state, "calibrating"), torch.inference_mode():
            report = quality_report(state, a, ck, recipe, targets, eval_ids, on_weight)
            resumed = calibrate_layers(state, run, cal, samples, a, work, report, kept)
            if not kept:  # the search's are reduced
                cal.check_finite(state.rank)  # before the reduction spreads one rank's NaN to all
                cal.reduce(state)
            check_base_unchanged(ck, identity)
        seconds = time.perf_counter() - start + (search.seconds if kept else 0.0)
        log.info("peak memory %s, planned %s", format_bytes(measured_peak(state.device)), format_bytes(plan.allocated))
        coverage = report_coverage(cal, state, cfg.num_experts)
        quality = report.result if report is not None else None
        if report is not None:
            report.log()
        if preview:
            # the model was loaded before the algorithms decided
            quantized = run.apply(
                model, rc, state.placement(cfg.num_experts).range if cfg.moe_layers else None, state.device
            )
            fake_quantize(model, targets, recipe, cal, state, source_dtype=rc.source_dtype, quantized=quantized)
            after = preview_text(model, hf_dir, a.preview, state.rank, f"after ({recipe.name}, fake-quantized)")
        summary = run_summary(state, a, ck, run, used)
        if report is not None:  # the page's additions to the report (eprt.report)
            report.describe_run(
                summary,
                starved_experts(coverage, summary),
                {"prompt": a.preview, "before": before, "after": after} if preview else None,
            )
            quality["model"] = model_identity(ck, identity)
            quality["size"] = recipe_size(rc.layout, recipe, ck.config.num_experts_per_tok, ck.config.num_experts)
            if search is not None:
                quality["auto_quantize"] = {**search.summary, "measured_kl": quality["kl_mean"]}
        write_output(state, a, ck, run, cal, summary, quality, search, identity)
        with fail_together(state, "removing the work directory"):
            work.remove()
    if state.rank == 0:
        log.info("calibrated %d tokens in %.2f s (%.0f tokens/s)", samples.numel(), seconds, samples.numel() / seconds)
        log.info("calibrated %s with %s -> %s", a.ckpt, recipe.name, a.out)
    mine = len(own_sequences(samples.shape[0], state.rank, state.world)) * samples.shape[1]
    return {"out": a.out, "calibration_s": seconds, "tokens": mine, "resumed_after": resumed, "quality": quality}


def settle(
    state: ParallelState, a: PTQArgs, ck: Checkpoint | None, search: SearchResult | None
) -> tuple[Checkpoint, Recipe, list[str], ProgramRun, str]:
    """What the run settles before it plans, on every rank together: the checkpoint, its recipe and
    the modules it quantizes, the run's program (started: the checkpoint as the run reads it,
    through the algorithms' views) and the work directory's path."""
    with fail_together(state, "reading the checkpoint and the recipe"):
        ck, rc = open_unquantized(state, a, ck)
        if search is not None and search.statistics is not None:  # they come from the base as the search read it
            check_base_unchanged(ck, {"base": search.base})
        recipe, targets = plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm)
        cfg = ck.config
        state.check_experts(cfg.num_experts)
        warn_beyond_positions(cfg, a.seq_len, state.rank)
        algorithm_options(a)  # refused by flag before anything is planned
        if recipe.rotates:  # the run reads its layers rotated; the algorithms' views (AWQ's folds) read them so
            rc = dataclasses.replace(rc, ck=RotatedCheckpoint(ck))
            say_rotation(rc.ck.plan, state.rank)
        # the views hold this rank's routed experts' rows (AWQ's clips)
        run = program_of(recipe, targets).start(rc, state.placement(cfg.num_experts).first if cfg.moe_layers else 0)
        check_data_settings(a)
        work_path = check_work_dir(a.work_dir or a.out.rstrip("/") + ".work", run_inputs(ck, a), a.out)
    return ck, recipe, targets, run, work_path


def preview_text(model, hf_dir: str, prompt: str, rank: int, when: str) -> str:
    """The preview's greedy text (every rank runs it: the experts need all of them), logged by rank 0."""
    text = greedy(model, hf_dir, prompt)
    if rank == 0:
        logger().info("%s: %r -> %r", when, prompt, text)
    return text


def quality_report(
    state: ParallelState,
    a: PTQArgs,
    ck: Checkpoint,
    recipe: Recipe,
    targets: list[str],
    eval_ids: torch.Tensor | None,
    on_weight=None,
) -> QualityReport | None:
    """The quality report on the held-out sequences `eval_ids`; None without them."""
    if eval_ids is None:
        return None
    data = describe_calib(a.calib) or "the built-in corpus"
    held_out = (
        a.eval or f"the last {a.eval_size} of {a.calib_size + a.eval_size} sequences of {data}, held out of calibration"
    )
    return QualityReport(state, ck, recipe, targets, eval_ids, held_out, on_weight)


def run_summary(state: ParallelState, a: PTQArgs, ck: Checkpoint, run: ProgramRun, used) -> dict:
    """The calibration summary the calibrated checkpoint records: the data, every algorithm's own
    part, the sources read, and an MXFP4 source's experts (of `ck`, as stored) kept value for value."""
    recipe = run.program.recipe
    summary = {
        "algorithm": "+".join(recipe.algorithms),
        "samples": a.calib_size,
        "seq_len": a.seq_len,
        "tokens": a.calib_size * a.seq_len,
        "data": describe_calib(a.calib) or "built-in corpus",
        "all_experts": a.calibrate_all_experts,
    }
    summary.update(run.summary())
    summary["sources"] = [u.to_json() for u in used]
    reencoded = mxfp4_blocks_kept(ck, run.rc.layout, {m: recipe.format_of(m) for m in run.program.targets})
    if reencoded is not None:  # an MXFP4 source's experts, kept value for value where NVFP4 can
        summary["mxfp4_reencoded"] = reencoded
        if state.rank == 0:
            logger().info(
                "the source's MXFP4 experts re-encoded value for value: %d of %d blocks of 32 exact; %d lie "
                "more than 17 binades below their expert's largest block and are rounded",
                reencoded["kept"],
                reencoded["blocks"],
                reencoded["blocks"] - reencoded["kept"],
            )
    return summary


def write_output(
    state: ParallelState,
    a: PTQArgs,
    ck: Checkpoint,
    run: ProgramRun,
    cal: Calibrator,
    summary: dict,
    quality: dict | None,
    search: SearchResult | None,
    identity: dict,
) -> None:
    """`a.out` written by every rank together (the record with every algorithm's part; with the
    format search, its recipe), published only if it pins the base as this run read it."""

    def write(tmp: str) -> None:
        with naming_refused_writes(tmp, f"the output {a.out}", "write the output elsewhere"):
            write_calibrated(tmp, a.out, state, cal, ck, run.program.recipe, summary, quality, **run.record())
            if search is not None and state.rank == 0:
                write_file(os.path.join(tmp, RECIPE_FILE), search.recipe_yaml)

    write_together(
        state,
        a.out,
        write,
        overwrite=a.overwrite,
        inputs=ck.input_dirs(),
        check_fn=lambda tmp: check_pinned_as_read(tmp, ck, identity),
    )


def run_auto_quantize(state: ParallelState, a: PTQArgs, on_weight=None, ck: Checkpoint | None = None) -> dict:
    """--auto-quantize: the format search (eprt.quant.algorithms.search.auto_quantize_run), then the chosen recipe
    written into `a.out` with the recipe (RECIPE_FILE), so that `--recipe OUT/auto_recipe.yaml`
    reproduces the export: under max and mse with the search's statistics (its quality report on
    the held-out sequences alone measured again), else calibrated again with --algorithm. Returns
    what run_ptq returns."""
    search = search_formats(state, a, ck)
    with tempfile.TemporaryDirectory() as d:  # each rank reads its own copy of the same recipe
        path = os.path.join(d, RECIPE_FILE)
        write_file(path, search.recipe_yaml)
        return run_calibration(state, replace(a, recipe=path, auto_quantize=None), on_weight, search=search)


def model_identity(ck: Checkpoint, identity: dict) -> dict:
    """The model a report measured (eprt.report says when runs compared are of different models):
    its type, its base's manifest digest, which tells two models apart, and the source's own name
    where its config.json gives one (a directory's name would differ between two copies)."""
    name = ck.source_config.get("_name_or_path")
    return {
        "model_type": ck.config.model_type,
        "manifest_sha256": identity["base"]["manifest_sha256"],
        **({"name": name} if isinstance(name, str) and name else {}),
    }


def fingerprint(
    ck: Checkpoint,
    a: PTQArgs,
    state: ParallelState,
    samples: torch.Tensor,
    eval_ids: torch.Tensor | None,
    recipe: Recipe | None = None,
) -> dict:
    """What a saved layer boundary and the output depend on (eprt.quant.run.fingerprint): a run
    resumes only from its own (batch and chunk sizes change no bit, so they may differ).
    `recipe`: as the run parsed it (default: `a`'s, parsed now)."""
    recipe = recipe or load_recipe(a.recipe, a.kv_cache, a.algorithm).on_source(checkpoint_int4_grid(ck))
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
            **{field: getattr(a, field) for field in option_flags()},
            "all_experts": a.calibrate_all_experts,
            "seed": a.seed,
            "calib_rows": a.calib_rows,
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
    run: ProgramRun,
    cal: Calibrator,
    samples: torch.Tensor,
    a: PTQArgs,
    work: WorkDir,
    report: QualityReport | None = None,
    kept: bool = False,
) -> int:
    """The layer-major engine over this rank's share of `samples` (and with `report`, of the
    held-out sequences), through the run's passes (its program's), each layer boundary saved in
    `work` (with every algorithm's state so far, `run.rc` reading its checkpoint through
    them); with --resume, from the last one saved. `kept`: `cal`'s statistics are final already
    (the format search's), so the calibration sequences stay out and the held-out ones run alone.
    Returns the layer it resumed after (-1: none)."""
    rc = run.rc
    ck = rc.ck
    shape = run_shape(a, state, ck.config)
    quality = QualityStreams(state, report, shape.schedule_of(report.eval_ids.shape[0])) if report else None
    passes = run.passes(cal, quality=quality, statistics=not kept)
    samples = samples[:0] if kept else samples
    engine = LayerEngine(state, rc, samples, passes, schedule=shape.schedule_of(samples.shape[0]), progress=a.progress)
    done = work.last_completed(a.resume)
    ls = work.load(done, cal, state.device, quality, run.resumable()) if done >= 0 else engine.embed()

    def after_layer(i: int, ls_) -> None:
        check_base_read(ck, work.fingerprint)  # the files this layer read are the ones pinned at the start
        if saves_after(i, a.save_every):
            work.save(i, ls_, cal, quality, run.resumable())

    with work.saving():  # a save is written while the next layer computes
        engine.run(done + 1, ls, after_layer=after_layer)
    return done


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
