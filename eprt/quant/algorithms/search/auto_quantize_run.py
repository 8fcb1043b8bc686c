"""The format search's first phase (`--auto-quantize BUDGET`): its settings checked, the checkpoint
opened and the memory planned as for calibration (eprt.quant.run.setup), the data read, every
candidate's errors measured in one layer-major pass (eprt.quant.algorithms.search.passes) and a format
chosen for each module group (eprt.quant.algorithms.search.auto_quantize). Under max and mse that pass's statistics
are the chosen recipe's: they are kept, with --kv-cache the KV cache's too, and the second phase
(eprt.quant.run.ptq) only measures the chosen recipe's quality report on the held-out sequences and
writes the output; under GPTQ and AWQ the pass measures with max, and the second phase calibrates
the chosen recipe with the asked algorithm.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from eprt.errors import ConfigError
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.parallel.guard import fail_together
from eprt.progress import logger
from eprt.quant.algorithms.program import program_of
from eprt.quant.algorithms.registry import rotated
from eprt.quant.algorithms.search.auto_quantize import (
    RECIPE_FILE,
    SEARCHABLE_ALGORITHMS,
    SearchResult,
    SearchSpace,
    parse_candidates,
    search_algorithm,
    search_summary,
)
from eprt.quant.algorithms.search.budget import UNQUANTIZED_BITS, check_budget
from eprt.quant.algorithms.search.passes import FormatErrors
from eprt.quant.feasibility import quantized_modules
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.loop.passes.quality import QualityStreams
from eprt.quant.quality import QualityReport
from eprt.quant.rotation.rotated import RotatedCheckpoint
from eprt.quant.run.args import PTQArgs, algorithm_options
from eprt.quant.run.data import check_data_settings, report_data
from eprt.quant.run.fingerprint import check_base_read
from eprt.quant.run.setup import check_kv_cache, open_unquantized, plan_run, run_shape
from eprt.storage.checkpoint import Checkpoint, manifest_digest
from eprt.storage.pins import weight_pins


def search_formats(state: ParallelState, a: PTQArgs, ck: Checkpoint | None = None) -> SearchResult:
    """--auto-quantize (eprt.quant.algorithms.search.auto_quantize): the search's layer-major pass and the choice, said
    by rank 0; returns its summary, the chosen recipe (the run writes it into `a.out`, RECIPE_FILE)
    and, under max or mse, the statistics the chosen recipe keeps. `ck`: `a.ckpt` as the command
    opened it; the search closes it."""
    with fail_together(state, "reading the checkpoint and the search's settings"):
        if a.recipe is not None:
            raise ConfigError(
                f"--recipe {a.recipe} with --auto-quantize: the search writes the recipe; give one or the other"
            )
        check_budget(a.auto_quantize)
        if a.eval_size < 1:
            raise ConfigError(
                f"--auto-quantize with --eval-size {a.eval_size}: the search fits its KL estimate on the quality "
                "report's held-out sequences; give a positive --eval-size"
            )
        if a.resume:
            raise ConfigError("--resume with --auto-quantize: the search does not resume; run it again")
        ck, rc = open_unquantized(state, a, ck)
        if rotated(a.algorithm):  # the errors of the model the choice is calibrated as: rotated
            rc = replace(rc, ck=RotatedCheckpoint(ck))
        cfg = ck.config
        check_kv_cache(a.kv_cache, cfg, ck.path)  # the chosen recipe's, refused before the search
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
            plan_run(state, rc, replace(a, preview=None), program_of(None, space.targets, search=True))
        with fail_together(state, "reading the calibration data"):
            data = report_data(a, ck.hf_files_dir(), cfg.vocab_size)
            samples, eval_ids, _ = data
            base = {"manifest_sha256": manifest_digest(ck.path), "weights": weight_pins(ck)}
        start = time.perf_counter()
        with fail_together(state, "searching the formats"), torch.inference_mode():
            errors, smallest_kl, cal = measure_format_errors(state, rc, space, samples, eval_ids, a, base)
        seconds = time.perf_counter() - start
    choice = space.choose(a.auto_quantize, errors)
    smallest_error = space.loss(space.smallest(), errors)
    kl_per_error = smallest_kl / smallest_error if smallest_error > 0 else 0.0
    summary = search_summary(space, a.auto_quantize, choice, errors, kl_per_error, smallest_kl, a.algorithm)
    text = space.recipe_yaml(choice, a.kv_cache, a.auto_quantize, a.algorithm)
    reuse = a.algorithm in SEARCHABLE_ALGORITHMS
    if state.rank == 0:
        logger().info(
            "auto-quantize: %.4f effective bits (budget %g), estimated KL %.6g; the recipe: %s; %s",
            summary["effective_bits"],
            a.auto_quantize,
            summary["estimated_kl"],
            os.path.join(a.out, RECIPE_FILE),
            f"it keeps the search's {a.algorithm} statistics"
            if reuse
            else f"searched with {search_algorithm(a.algorithm)} statistics, now calibrated with {a.algorithm}",
        )
    return SearchResult(summary, text, data, base, seconds, cal if reuse else None)


def measure_format_errors(
    state: ParallelState,
    rc: ResolvedCheckpoint,
    space: SearchSpace,
    samples: torch.Tensor,
    eval_ids: torch.Tensor,
    a: PTQArgs,
    base: dict,
) -> tuple[dict[tuple[str, str], float], float, Calibrator]:
    """The search's layer-major pass: max statistics of every module a candidate quantizes (with
    --kv-cache, of the KV cache too), each group's error in each candidate on the calibration
    sequences (eprt.quant.algorithms.search.passes), and the quality report of every group in its
    smallest candidate on the held-out ones (the KL estimate's constant). Each layer's weight
    files must be those pinned in `base` as the search read them. Returns the errors, that
    report's mean KL and the statistics, reduced over the ranks."""
    shape = run_shape(a, state, rc.ck.config)
    cal = Calibrator(None, space.targets, kv=a.kv_cache is not None, all_experts=a.calibrate_all_experts)
    algorithm = search_algorithm(a.algorithm)
    smallest = space.recipe(space.smallest(), None, algorithm)
    targets = list(quantized_modules(rc.layout, smallest, rc.ck.path))
    report = QualityReport(state, rc.ck, smallest, targets, eval_ids, "held out")
    calibration = shape.schedule_of(samples.shape[0])
    errors = FormatErrors(state, cal, rc, space, samples, calibration, algorithm)
    held_out = QualityStreams(state, report, shape.schedule_of(eval_ids.shape[0]))
    run = (
        program_of(smallest, targets)
        .start(rc, 0)
        .begin(state, cal, tokens=samples.numel(), options=algorithm_options(a), expert_stack=1)
    )
    passes = run.passes(cal, quality=held_out, format_errors=errors)
    engine = LayerEngine(state, rc, samples, passes, schedule=calibration, progress=a.progress)
    engine.run(0, engine.embed(), after_layer=lambda *_: check_base_read(rc.ck, {"base": base}))
    cal.check_finite(state.rank)  # before the reduction spreads one rank's NaN to all
    cal.reduce(state)
    return errors.errors, report.result["kl_mean"], cal
