"""eprt checkpoint -> Hugging Face directory: sharded safetensors with an index, plus every non-weight file.

The writer takes a list of output tensors (`eprt.hf.tensors`), each produced on demand, so that the
unquantized and the quantized export share sharding, indexing and atomic output.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from eprt.errors import CheckpointError, ConfigError, EprtError
from eprt.families import reader_for
from eprt.hf.check_engine_quirks import engine_warnings
from eprt.hf.check_export import check_export
from eprt.hf.export_quantized import QuantizedExport
from eprt.hf.model_card import base_model_id, model_card
from eprt.hf.mxfp4_blocks_export import NAME as MXFP4_LAYOUT
from eprt.hf.mxfp4_blocks_export import quantization_config as mxfp4_blocks_config
from eprt.hf.tensors import OutTensor, source_tensors
from eprt.kernels.cpu_workers import cpu_workers
from eprt.parallel import ParallelState, fail_together, write_together
from eprt.progress import bar, logger
from eprt.quant.formats import weight_format
from eprt.quant.run.datafree import data_free_recipe
from eprt.quant.source_grid import checkpoint_int4_grid
from eprt.report import page_path
from eprt.storage import encodings
from eprt.storage.atomic import copy_file, copy_files, write_file
from eprt.storage.bounded import read_json_object
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.hf_files import (
    CARD,
    CONFIG,
    QUALITY,
    QUALITY_PAGE,
    QUANT_CONFIG,
    served_file,
    shard_name,
    write_index,
    write_json,
)
from eprt.storage.paths import resolve_inside
from eprt.storage.safetensors_io import SafetensorsWriter

DEFAULT_SHARD_BYTES = 5 * 1024**3
PRODUCE_AHEAD_BYTES = 64 * 1024**2  # of output tensors computed ahead of the writing
# Consecutive output tensors produced by one call on the producing thread, up to this many bytes together:
# a call's hand-over costs about as much as producing a small tensor (a norm's weight, a scale), and a
# trillion-parameter export has a quarter of a million of them.
PRODUCE_BATCH_BYTES = 1024**2


def shard(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    return shards + [cur] if cur else shards


def produced_ahead(
    tensors: list[OutTensor], ahead_bytes: int = PRODUCE_AHEAD_BYTES, batch_bytes: int = PRODUCE_BATCH_BYTES
) -> Iterator[tuple[OutTensor, object]]:
    """Each tensor with what its writing needs (its bytes, or where they lie as stored), in order,
    computed on a second thread up to `ahead_bytes` of tensors ahead of the caller: reading and
    quantizing the next tensors overlaps writing this one (torch's kernels and the file system
    calls release the GIL). That one thread makes every call, in order, as the producers' caches
    of a row they share expect, and it alone reads the checkpoint. Consecutive tensors go to it in
    batches of up to `batch_bytes` (one call each; a larger tensor alone), cut as shards are."""
    pending: deque = deque()
    queued = 0
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eprt-export")
    try:
        for batch in shard(tensors, batch_bytes):
            pending.append((batch, pool.submit(_inference, [t.stored or t.produce for t in batch])))
            queued += sum(t.nbytes for t in batch)
            while queued > ahead_bytes:
                done, result = pending.popleft()
                queued -= sum(t.nbytes for t in done)
                yield from zip(done, result.result())
        while pending:
            done, result = pending.popleft()
            yield from zip(done, result.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _inference(produce: list) -> list:
    """What the producing thread runs: torch's inference mode is a thread's own, and without
    autograd's bookkeeping the quantizers' many small operations dispatch faster."""
    with torch.inference_mode():
        return [p() for p in produce]


def write_hf_dir(
    tmp: str, tensors: list[OutTensor], *, max_shard_bytes: int, progress: bool, rank: int = 0, world: int = 1
) -> None:
    """Write the shards (this rank's: every world-th) and, on rank 0, the index into `tmp`.

    Every rank plans the same shards from the same tensor list, so the index needs nothing
    from the other ranks."""
    shards = shard(tensors, max_shard_bytes)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    mine = range(rank, len(shards), world)
    with (
        bar(sum(t.nbytes for i in mine for t in shards[i]), "export", unit="B", enabled=progress) as pb,
        contextlib.closing(produced_ahead([t for i in mine for t in shards[i]])) as ahead,
    ):
        for i in mine:
            w = SafetensorsWriter(os.path.join(tmp, names[i]), [(t.name, t.dtype, t.shape) for t in shards[i]])
            for t, got in itertools.islice(ahead, len(shards[i])):
                if t.stored is not None:
                    w.copy_range(t.name, *got)
                else:
                    w.write(t.name, got)
                pb.update(t.nbytes)
            w.close()
    if rank == 0:
        write_index(
            tmp, {t.name: names[i] for i, group in enumerate(shards) for t in group}, sum(t.nbytes for t in tensors)
        )


def export_hf(
    ckpt_dir: str,
    out_dir: str,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    dequantize: bool = False,
    parallel: ParallelState | None = None,
    fmt: str | None = None,
    recipe: str | None = None,
    algorithm: str | None = None,
    base_model: str | None = None,
) -> str:
    """Write an eprt checkpoint in the Hugging Face layout: the source layout back for an
    unquantized checkpoint, for a calibrated one the quantized layout `fmt` (modelopt or
    compressed-tensors; None: the one that holds the recipe; checked before it appears) with its
    model card. With `recipe` (and `algorithm`
    for its rules that name none), an unquantized checkpoint is quantized on the way out under
    that data-free recipe (eprt.quant.run.datafree): the bytes its calibration and export write. An
    option that cannot apply to the checkpoint is refused rather than ignored (`refuse_inapplicable`).

    Weights the source stored compressed or in block FP8 go back as they came, byte for byte;
    with `dequantize`, decoded (bf16), under a config.json without its quantization_config. A
    quantized export always starts from the decoded weights.

    With `parallel`, every rank of the run calls it and writes every world-th shard; rank 0
    writes the index and the configs, and the output appears once every rank has written."""
    state = parallel or ParallelState.single()
    with fail_together(state, "reading the checkpoint"):
        ck = Checkpoint(ckpt_dir)
    with ck:
        refuse_inapplicable(ck, fmt, dequantize, recipe)
        if algorithm is not None and recipe is None:
            raise ConfigError(f"--algorithm {algorithm} applies to a --recipe's rules: give --recipe, or leave it out")
        quantize = (
            data_free_recipe(recipe, algorithm, ckpt_dir).on_source(checkpoint_int4_grid(ck))
            if recipe is not None
            else None
        )
        exp = QuantizedExport(ck, fmt, quantize) if ck.quantization is not None or quantize else None
        if exp is not None and fmt is None and exp.target != "modelopt":
            logger().info(
                "writing the %s layout: the ModelOpt layout does not hold %s (--format modelopt is refused for it)",
                exp.target,
                ", ".join(f for f in exp.recipe.formats if not weight_format(f).modelopt_layout),
            )
        if exp is not None:  # it resolved the checkpoint's layout: the export's one resolution
            tensors = exp.tensors()
        else:
            layout = reader_for(ck.config.model_type, ck.path).layout(ck.config)
            tensors = list(source_tensors(ck, layout, dequantize=dequantize))

        def write(tmp: str) -> None:
            write_hf_dir(
                tmp, tensors, max_shard_bytes=max_shard_bytes, progress=progress, rank=state.rank, world=state.world
            )
            if state.rank == 0:
                write_configs(ck, exp, tmp, dequantize, base_model)

        def check(tmp: str) -> None:
            problems = check_export(tmp, library=False)  # its config is eprt's, built without the library
            if problems:
                raise EprtError(
                    f"the export of {ckpt_dir} fails its checks, so it was not written:\n  " + "\n  ".join(problems)
                )

        # torch's thread count (OMP_NUM_THREADS; 1 a rank under torchrun) in workers that quantize
        # whole chunks; the check's many small operations also run best on one intra-op thread
        with cpu_workers(torch.get_num_threads()) if exp else contextlib.nullcontext():
            write_together(
                state, out_dir, write, overwrite=overwrite, inputs=ck.input_dirs(), check_fn=check if exp else None
            )
    if state.rank == 0:
        logger().info("exported %s -> %s (%d tensors)", ckpt_dir, out_dir, len(tensors))
        for warning in engine_warnings(out_dir) if exp else ():
            logger().warning(warning)
    return out_dir


def refuse_inapplicable(ck: Checkpoint, fmt: str | None, dequantize: bool, recipe: str | None = None) -> None:
    """Refuse an option the export of `ck` would silently do nothing with: a quantized layout for an
    unquantized checkpoint exported without a recipe (its export is the source layout), a recipe for
    a calibrated one (its export applies its own), --dequantize for a quantized export (it always
    starts from the decoded weights) or for one with nothing to decode."""
    if recipe is not None and ck.quantization is not None:
        raise ConfigError(
            f"--recipe {recipe}: {ck.path} is calibrated, and its export applies the recipe it was "
            "calibrated with; export without --recipe, or give --recipe with the checkpoint it was calibrated from"
        )
    if recipe is not None and dequantize:
        raise ConfigError(
            f"--dequantize with --recipe {recipe}: a quantized export always starts from the decoded "
            "weights; export without --dequantize"
        )
    if ck.quantization is None and fmt is not None and recipe is None:
        raise ConfigError(
            f"--format {fmt}: {ck.path} is not calibrated, so its export is the source's own layout, "
            f"not a quantized one; calibrate it first (eprt-ptq), give a data-free --recipe, or export without --format"
        )
    if ck.quantization is not None and dequantize:
        raise ConfigError(
            f"--dequantize: {ck.path} is calibrated, and its quantized export always starts from the "
            "decoded weights; export without --dequantize, or export the checkpoint it was "
            "calibrated from with --dequantize for its weights in bf16"
        )
    if (
        dequantize
        and not any(meta.encoded for meta in ck.tensors.values())
        and encodings.without_quantization(ck.source_config) == ck.source_config
    ):
        raise ConfigError(
            f"--dequantize: {ck.path} holds no weight stored compressed or in block FP8 and its "
            "config.json no quantization_config, so there is nothing to decode; export without "
            "--dequantize"
        )


def write_configs(
    ck: Checkpoint, exp: QuantizedExport | None, tmp: str, dequantize: bool, base_model: str | None = None
) -> None:
    """config.json and every other non-weight file of the source: copied byte for byte unless the
    export changes the config (quantized, or dequantized). A quantized export carries only the
    files serving it reads, and its own model card (eprt.hf.model_card; `base_model`: the Hub id it
    names, else the one the source says)."""
    if exp and exp.target == "modelopt":
        config, hf_quant = exp.configs()
        write_json(os.path.join(tmp, QUANT_CONFIG), hf_quant)
    elif exp and exp.target == MXFP4_LAYOUT:
        config = mxfp4_blocks_config(ck.source_config)
    elif exp:
        config = exp.ct_config()
    else:
        config = encodings.without_quantization(ck.source_config) if dequantize else ck.source_config
    rewrite = config != ck.source_config
    # a quantized export carries what serving it reads, not what describes the source (served_file)
    carried = [f for f in ck.hf_files if not (rewrite and f == CONFIG) and (not exp or served_file(f))]
    copy_files(ck.hf_files_dir(), carried, tmp)
    if rewrite:
        write_json(os.path.join(tmp, CONFIG), config)
    report = (ck.quantization or {}).get("quality")
    quality = None
    if exp and report:  # the PTQ run's quality report, beside the weights, under a name no engine reads
        src = resolve_inside(ck.path, report, f"{ck.path} (quantization.quality)")
        copy_file(src, os.path.join(tmp, QUALITY))
        quality = read_json_object(src, "calibrate again", CheckpointError)
        if os.path.isfile(os.path.join(ck.path, page_path(report))):  # its page, where the run wrote one
            page = resolve_inside(ck.path, page_path(report), f"{ck.path} (the quality report's page)")
            copy_file(page, os.path.join(tmp, QUALITY_PAGE))
    if exp:
        write_file(
            os.path.join(tmp, CARD),
            model_card(
                ck.source_config,
                exp.recipe,
                exp.target,
                exp.quantized,
                base_model or base_model_id(ck.source_config, (ck.base or ck).source_dir),
                quality,
                ck.quantization,
            ),
            "the model card",
        )
