"""The PTQ job: load each rank's share, calibrate on each rank's own data, save the calibration.

Every rank runs this with the same arguments; each step that can fail alone runs inside a
fail-together guard, so a failure on one rank stops every rank with the same message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eprt.data import calibration_samples, rank_batches
from eprt.errors import ConfigError
from eprt.families import reader_for
from eprt.models.loader import load_model
from eprt.parallel.guard import fail_together
from eprt.parallel.output import write_together
from eprt.progress import bar, logger
from eprt.quant.calibrate import Calibrator
from eprt.quant.calibrated import write_calibrated
from eprt.quant.feasibility import quantized_modules
from eprt.quant.preview import fake_quantize, greedy
from eprt.quant.recipe import Recipe, load_recipe
from eprt.storage.atomic import check_output_dir
from eprt.storage.checkpoint import Checkpoint

# `--dtype`: the dtype the model runs in
RUN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class PTQArgs:
    ckpt: str
    recipe: str
    out: str
    kv_cache: str | None = None
    calib: str | None = None
    calib_size: int = 64
    seq_len: int = 256
    batch_size: int = 1
    dtype: str = "bf16"
    preview: str | None = None  # a prompt, or None for no preview
    overwrite: bool = False
    progress: bool = True


def run_ptq(state, a: PTQArgs) -> dict:
    """Calibrate and write `a.out`; returns {"out", "calibration_s", "tokens"} (tokens on this rank)."""
    log = logger()
    with fail_together(state, "reading the checkpoint and the recipe"):
        check_output_dir(a.out, a.overwrite, (a.ckpt,))  # before calibrating: refused again when it is written
        ck = Checkpoint(a.ckpt)
        if ck.quantization is not None:
            ck.close()
            raise ConfigError(f"{a.ckpt} is already calibrated; run PTQ on the unquantized checkpoint")
        recipe, targets = plan_recipe(ck, a.recipe, a.kv_cache)
        cfg, hf_dir = ck.config, ck.hf_files_dir()
        state.check_experts(cfg.num_experts)
        if a.dtype not in RUN_DTYPES:
            raise ConfigError(f"--dtype {a.dtype!r}: choose one of {', '.join(RUN_DTYPES)}")
        warn_beyond_positions(cfg, a.seq_len, state.rank)
        samples = calibration_samples(a.calib, hf_dir, num_samples=a.calib_size, seq_len=a.seq_len,
                                      vocab_size=cfg.vocab_size)
        batches = rank_batches(samples, state.rank, state.world, a.batch_size)
    with ck:
        model = load_model(a.ckpt, dtype=RUN_DTYPES[a.dtype], parallel=state)
        if a.preview:
            text = greedy(model, hf_dir, a.preview)  # every rank runs it: the experts need all of them
            if state.rank == 0:
                log.info("before: %r -> %r", a.preview, text)
        cal = Calibrator(model, targets, kv=recipe.kv_cache == "fp8")
        start = time.perf_counter()
        with fail_together(state, "calibrating"), torch.inference_mode():
            with bar(len(batches), "calibrate", unit="batch", enabled=a.progress) as pb:
                for batch in batches:
                    model(batch)
                    pb.update(1)
            cal.check_finite(state.rank)  # before the reduction spreads one rank's NaN to all
            cal.reduce(state)
        seconds = time.perf_counter() - start
        report_coverage(cal, state, cfg.num_experts)
        if a.preview:
            fake_quantize(model, targets, recipe, cal, state)
            text = greedy(model, hf_dir, a.preview)
            if state.rank == 0:
                log.info("after (%s, fake-quantized): %r -> %r", recipe.name, a.preview, text)
        summary = {"algorithm": "max", "samples": a.calib_size, "seq_len": a.seq_len,
                   "tokens": a.calib_size * a.seq_len, "data": a.calib or "built-in corpus"}
        write_together(state, a.out, lambda tmp: write_calibrated(tmp, a.out, state, cal, ck, recipe, summary),
                       overwrite=a.overwrite, inputs=ck.input_dirs())
    if state.rank == 0:
        log.info("calibrated %s with %s -> %s", a.ckpt, recipe.name, a.out)
    return {"out": a.out, "calibration_s": seconds, "tokens": sum(b.numel() for b in batches)}


def plan_recipe(ck: Checkpoint, spec: str, kv_cache: str | None = None) -> tuple[Recipe, list[str]]:
    """The recipe `spec` and the modules it quantizes in `ck`, from the manifest alone: whatever
    export would refuse about this recipe and this model is refused here, before a weight is read."""
    recipe = load_recipe(spec, kv_cache)
    layout = reader_for(ck.config.model_type, ck.path).layout(ck.config)
    return recipe, list(quantized_modules(layout, recipe, ck.path))


def warn_beyond_positions(cfg, seq_len: int, rank: int) -> None:
    """Calibrating past the positions the model was trained for records activations no deployment
    sees; allowed (a user may mean it), said once."""
    if seq_len > cfg.max_position_embeddings and rank == 0:
        logger().warning("--seq-len %d is beyond the model's max_position_embeddings %d; the calibration "
                         "sees positions the model was not trained for: lower --seq-len", seq_len,
                         cfg.max_position_embeddings)


def report_coverage(cal: Calibrator, state, num_experts: int) -> None:
    """Rank 0 prints, per MoE layer, the tokens each expert received and the experts none reached."""
    log = logger()
    for module, tokens in cal.expert_tokens.items():
        first = state.ep_rank * tokens.shape[0]
        full = torch.zeros(num_experts, dtype=torch.int64)
        full[first:first + tokens.shape[0]] = tokens
        state.all_reduce(full, over="ep", op=dist.ReduceOp.SUM)
        if state.rank != 0:
            continue
        unreached = (full == 0).nonzero().view(-1).tolist()
        log.info("%s: tokens per expert min %d / median %d / max %d%s", module, int(full.min()),
                 int(full.median()), int(full.max()),
                 f"; no token reached experts {unreached} (they get the layer's input scale)" if unreached else "")
