"""`stream_export`: a Hugging Face checkpoint -> its quantized export under a data-free recipe,
shard by shard, without a model definition or a converted checkpoint (eprt.hf.streaming).

The output shards are spread over processes: `workers` on this host (a process pool), and the
ranks of a launched run (`eprt-export --nproc-per-node N`, torchrun), each rank's over its own
workers. Each writes whole shards: it reads the source tensors they hold, once, quantizes each
Linear as it goes and writes it. A shard is written as `NAME.partial` and renamed when complete,
in a work directory beside the output (`.OUT.streaming`) whose `plan.json` pins the source's
files, the recipe and the settings: a run interrupted and started again with the same ones keeps
the shards already written and writes the rest, and one with others starts over. When every
shard is there, the index, config.json (with the quantization config of what was quantized) and
the source's other files are written, the export is checked (eprt.hf.check_export), and the work
directory is renamed into place (eprt.storage.atomic.publish): the output appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
from collections import Counter
from dataclasses import dataclass

import torch

from eprt import __version__
from eprt.errors import ConfigError, EprtError
from eprt.families import load_hf_config, read_hf_config, reader_for, supported_model_types
from eprt.hf import compressed_tensors_export as ct
from eprt.hf.check_export import check_export
from eprt.hf.export import DEFAULT_SHARD_BYTES, produced_ahead, shard
from eprt.hf.export_quantized import LAYOUTS, refuse_modelopt_layout
from eprt.hf.model_card import base_model_id, model_card
from eprt.hf.quant_configs import ct_config, modelopt_configs
from eprt.hf.streaming.memory import plan_memory
from eprt.hf.streaming.plan import Quantized, StreamPlan, plan_stream
from eprt.hf.streaming.produce import Producer
from eprt.hf.streaming.source import StreamSource
from eprt.hf.tensors import OutTensor
from eprt.kernels.cpu_workers import cpu_workers
from eprt.parallel import ParallelState, fail_together
from eprt.progress import bar, logger
from eprt.quant.recipe import Recipe, available, load_recipe
from eprt.quant.run.datafree import statistics_needed
from eprt.quant.source_grid import hf_int4_grid
from eprt.storage.atomic import check_output_dir, copy_files, publish, write_file
from eprt.storage.hf_files import CARD, CONFIG, QUANT_CONFIG, served_file, shard_name, write_index, write_json
from eprt.storage.pins import weight_pin
from eprt.storage.safetensors_io import SafetensorsWriter
from eprt.units import format_bytes

PLAN_FILE = "plan.json"  # the work directory's pin of what it is being written from
PARTIAL = ".partial"  # a shard being written


@dataclass(frozen=True)
class Settings:
    """What an export is a function of, besides the source's bytes: the same settings give the same output."""

    hf_dir: str
    recipe: str
    algorithm: str | None
    layout: str
    max_shard_bytes: int


class Stream:
    """The source, recipe and plan of one model-free export, opened alike by every process."""

    def __init__(self, s: Settings):
        self.settings = s
        if s.layout not in LAYOUTS:
            raise ConfigError(f"--format {s.layout!r}: choose one of {', '.join(LAYOUTS)}")
        self.recipe: Recipe = model_free_recipe(s.recipe, s.algorithm, s.hf_dir)
        model_type = read_hf_config(s.hf_dir).get("model_type")
        layout = None
        if model_type in supported_model_types():  # a family eprt models: its own table
            _, cfg = load_hf_config(s.hf_dir)
            layout = reader_for(cfg.model_type, s.hf_dir).layout(cfg)
        self.src = StreamSource(s.hf_dir, layout)
        self.recipe = self.recipe.on_source(hf_int4_grid(self.src.config, self.src.quant))
        try:
            self.plan: StreamPlan = plan_stream(self.src, self.recipe, layout)
            quantized = [q for q in self.plan.items if isinstance(q, Quantized)]
            if not quantized:
                raise ConfigError(
                    f"{s.hf_dir}: recipe {self.recipe.name} quantizes none of its tensors (no 2-D Linear weight or "
                    "stack of experts matches a rule and escapes the ignore list); check the recipe's patterns"
                )
            if s.layout == "modelopt":
                refuse_modelopt_layout({q.linear.module: q.format.name for q in quantized}, s.hf_dir)
            producer = Producer(self.src, self.plan, s.layout)
            self.tensors: list[OutTensor] = [t for item in self.plan.items for t in producer.tensors(item)]
            self.shards = shard(self.tensors, s.max_shard_bytes)
            self.names = [shard_name(i, len(self.shards)) for i in range(len(self.shards))]
        except BaseException:
            self.src.close()
            raise

    def pin(self) -> dict:
        """What the work directory is written from: the settings, the recipe, the source's weight files."""
        return {
            "eprt": __version__,
            "settings": {**self.settings.__dict__, "hf_dir": os.path.realpath(self.settings.hf_dir)},
            "recipe": self.recipe.to_json(),
            "sources": {name: weight_pin(f.path) for name, f in sorted(self.src.src.files.items())},
            "shards": self.names,
        }

    def write_shard(self, work: str, i: int, progress=None, span: tuple[int, int] | None = None) -> None:
        """Shard i into `work`, whole: written under a temporary name (a stopped run's replaced) and
        renamed when complete; with
        `span` (a, b), its tensors a to b - 1 only, into the temporary file `prepare_parts` made,
        which the caller renames once every span of it is written."""
        path = os.path.join(work, self.names[i])
        tensors = self.shards[i]
        if span is None:
            remove_partial(path)
        w = SafetensorsWriter(path + PARTIAL, [(t.name, t.dtype, t.shape) for t in tensors], span=span)
        with contextlib.closing(produced_ahead(tensors if span is None else tensors[span[0] : span[1]])) as ahead:
            for t, got in ahead:
                if t.stored is not None:
                    w.copy_range(t.name, *got)
                else:
                    w.write(t.name, got)
                if progress is not None:
                    progress.update(t.nbytes)
        w.close()
        if span is None:
            os.replace(path + PARTIAL, path)

    def prepare_parts(self, work: str, i: int, parts: int) -> list[tuple[int, int]]:
        """Shard i's temporary file, made for `parts` writers of its spans side by side, and its spans: up to `parts` runs of consecutive tensors
        of about equal bytes."""
        path = os.path.join(work, self.names[i])
        remove_partial(path)
        tensors = self.shards[i]
        SafetensorsWriter.create_for_parts(path + PARTIAL, [(t.name, t.dtype, t.shape) for t in tensors])
        total, done, cuts = sum(t.nbytes for t in tensors), 0, [0]
        for j, t in enumerate(tensors[:-1]):
            done += t.nbytes
            if len(cuts) < parts and done * parts >= total * len(cuts):
                cuts.append(j + 1)
        return list(zip(cuts, cuts[1:] + [len(tensors)]))

    def close(self) -> None:
        self.src.close()


def remove_partial(shard: str) -> None:
    """Shard path `shard`'s temporary file, where a run stopped while writing it left one."""
    if os.path.lexists(shard + PARTIAL):
        os.remove(shard + PARTIAL)


def model_free_recipe(spec: str, algorithm: str | None, hf_dir: str) -> Recipe:
    """Recipe `spec` for a model-free export, refused where it needs calibration (and so the model)."""
    recipe = load_recipe(spec, None, algorithm)
    if recipe.rotates:
        raise ConfigError(
            f"--recipe {spec}: its rotation folds the norms into the Linears and rotates every reader and writer "
            f"of the residual stream, which takes a model eprt models; convert {hf_dir} (eprt-convert) and export "
            "the checkpoint with the same recipe (eprt-export CKPT OUT --recipe ...)"
        )
    needs = statistics_needed(recipe)
    if needs:
        free = [r for r in available() if not statistics_needed(load_recipe(r))]
        raise ConfigError(
            f"--recipe {spec}: {'; '.join(needs)}, so it needs calibration data and the model; the model-free "
            f"export takes a data-free recipe ({', '.join(free)}); or convert {hf_dir} (eprt-convert), calibrate "
            f"it (eprt-ptq CKPT --recipe {spec} --out Q) and export Q"
        )
    return recipe


def stream_export(
    hf_dir: str,
    out: str,
    recipe: str,
    *,
    algorithm: str | None = None,
    fmt: str | None = None,
    workers: int = 1,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    parallel: ParallelState | None = None,
    base_model: str | None = None,
) -> str | dict:
    """Quantize Hugging Face checkpoint `hf_dir` into `out` under data-free `recipe` (a name of
    eprt/configs/ptq or a YAML path; `algorithm` for its rules that name none), in layout `fmt`
    (modelopt, the default, or compressed-tensors), on `workers` processes (and, with `parallel`,
    on every rank of the run, each with its own workers). Returns `out`; with `dry_run`, writes
    nothing and returns the plan's summary (also logged). `base_model`: the Hub id the model card
    names (default: the source's own, eprt.hf.model_card.base_model_id)."""
    state = parallel or ParallelState.single()
    if workers < 1:
        raise ConfigError(f"--workers {workers}: the number of processes must be at least 1")
    settings = Settings(hf_dir, recipe, algorithm, fmt or "modelopt", max_shard_bytes)
    with guarded(state, "planning the export"):
        if not os.path.isdir(hf_dir):
            raise ConfigError(f"{hf_dir}: not a directory")
        stream = Stream(settings)
    try:
        if dry_run:
            summary = describe(stream, workers, state.world)
            if state.rank == 0:
                for line in summary["lines"]:
                    logger().info("%s", line)
            return summary
        work = work_dir_for(out)
        with guarded(state, "preparing the output"):
            check_output_dir(out, overwrite, (hf_dir,))
            if state.rank == 0:
                prepare_work_dir(work, stream.pin())
        with guarded(state, "writing the shards"):
            mine = [i for i in range(state.rank, len(stream.shards), state.world)]
            todo = [i for i in mine if not os.path.isfile(os.path.join(work, stream.names[i]))]
            if len(todo) < len(mine) and state.rank == 0:
                logger().info("resuming %s: %d of %d shards already written", out, len(mine) - len(todo), len(mine))
            write_shards(stream, work, todo, workers, progress)
        with guarded(state, "publishing the output"):
            if state.rank == 0:
                finish(stream, work, out, overwrite, base_model)
    finally:
        stream.close()
    if state.rank == 0:
        logger().info("exported %s -> %s (%d tensors, model-free)", hf_dir, out, len(stream.tensors))
    return out


def guarded(state: ParallelState, what: str):
    """A step every rank of a launched run fails together (eprt.parallel.guard); alone, as it is."""
    return fail_together(state, what) if state.world > 1 else contextlib.nullcontext()


def work_dir_for(out: str) -> str:
    """The work directory of output `out`: the same name for every run writing it, so a run resumes another's."""
    parent, name = os.path.split(os.path.realpath(out))
    return os.path.join(parent, f".{name}.streaming")


def prepare_work_dir(work: str, pin: dict) -> None:
    """A work directory for `pin`: the one there if it was started from the same (resume), else a new one."""
    path = os.path.join(work, PLAN_FILE)
    if os.path.isdir(work):
        try:
            with open(path) as f:
                same = json.load(f) == pin
        except (OSError, ValueError):
            raise EprtError(
                f"{work}: a directory without a readable {PLAN_FILE}, so not a model-free export's work "
                "directory; move it away or remove it"
            ) from None
        if same:
            return
        logger().info("%s was started from another source, recipe or settings: starting over", work)
        shutil.rmtree(work)
    os.makedirs(work)
    write_json(path + PARTIAL, pin)
    os.replace(path + PARTIAL, path)


def write_shards(stream: Stream, work: str, todo: list[int], workers: int, progress: bool) -> None:
    """The shards `todo`, on `workers` processes (torch on one thread each), each shard cut into as
    many spans as there are workers and written by them side by side into one file: a model of
    fewer shards than workers (every export under 5 GiB is one) keeps them all busy, and the last
    shard does not run alone."""
    total = sum(t.nbytes for i in todo for t in stream.shards[i])
    with bar(total, "export", unit="B", enabled=progress) as pb:
        if workers == 1 or not todo:
            with cpu_workers(1):
                for i in todo:
                    stream.write_shard(work, i, pb)
            return
        tasks = [(work, i, span) for i in todo for span in stream.prepare_parts(work, i, workers)]
        left = Counter(i for _, i, _ in tasks)
        # forked, the workers inherit the plan and the open source files (pread: no shared offset)
        # rather than importing torch and planning again each (seconds a process); each runs torch
        # on one thread, whose operations start no thread pool of their own
        global _STREAM
        _STREAM = stream
        ctx = multiprocessing.get_context("fork")
        try:
            with ctx.Pool(min(workers, len(tasks)), initializer=torch.set_num_threads, initargs=(1,)) as pool:
                for i, nbytes in pool.imap_unordered(_write, tasks):
                    pb.update(nbytes)
                    left[i] -= 1
                    if not left[i]:  # every span written: the shard is complete
                        path = os.path.join(work, stream.names[i])
                        os.replace(path + PARTIAL, path)
        finally:
            _STREAM = None


_STREAM: Stream | None = None  # what a forked worker writes from


def _write(args: tuple[str, int, tuple[int, int]]) -> tuple[int, int]:
    work, i, span = args
    with cpu_workers(1):
        _STREAM.write_shard(work, i, span=span)
    return i, sum(t.nbytes for t in _STREAM.shards[i][span[0] : span[1]])


def finish(stream: Stream, work: str, out: str, overwrite: bool, base_model: str | None) -> None:
    """The index, the configs and the source's other files beside the shards; checked, then published."""
    missing = [n for n in stream.names if not os.path.isfile(os.path.join(work, n))]
    if missing:
        raise EprtError(f"{work}: shard {missing[0]} was not written; run the export again to resume it")
    write_index(
        work,
        {t.name: stream.names[i] for i, group in enumerate(stream.shards) for t in group},
        sum(t.nbytes for t in stream.tensors),
    )
    q = stream.plan.quantized_linears(stream.src.config, stream.recipe)
    if stream.settings.layout == ct.NAME:
        config = ct_config(q)
    else:
        config, hf_quant = modelopt_configs(q)
        write_json(os.path.join(work, QUANT_CONFIG), hf_quant)
    # what serving reads, not what describes the source (served_file), as the modeled export carries
    copy_files(stream.src.dir, [f for f in stream.src.files if f != CONFIG and served_file(f)], work)
    write_json(os.path.join(work, CONFIG), config)
    source_config = stream.src.config
    card = model_card(
        source_config,
        stream.recipe,
        stream.settings.layout,
        {item.linear.module for item in stream.plan.items if isinstance(item, Quantized)},
        base_model or base_model_id(source_config, stream.src.dir),
    )
    write_file(os.path.join(work, CARD), card, "the model card")
    problems = check_export(work, library=False)
    if problems:
        shutil.rmtree(work)  # nothing of it is worth resuming
        raise EprtError(
            f"the export of {stream.src.dir} fails its checks, so it was not written:\n  " + "\n  ".join(problems)
        )
    os.remove(os.path.join(work, PLAN_FILE))
    publish(work, out, overwrite)


def describe(stream: Stream, workers: int, world: int) -> dict:
    """The dry run's plan: shards, what is quantized in which format, and the memory of each process."""
    quantized = [q for q in stream.plan.items if isinstance(q, Quantized)]
    by_format: dict[str, int] = {}
    for q in quantized:
        by_format[q.format.name] = by_format.get(q.format.name, 0) + 1
    memory = plan_memory(stream, workers)
    lines = [
        f"{stream.src.dir}: model-free export under {stream.recipe.name} "
        f"({'its family table' if stream.plan.modeled else 'name patterns'}, {stream.settings.layout} layout)",
        f"  {len(stream.tensors)} tensors in {len(stream.shards)} shards, "
        f"{format_bytes(sum(t.nbytes for t in stream.tensors))}; quantized Linears: "
        + ", ".join(f"{n} {f}" for f, n in sorted(by_format.items())),
        f"  {world} rank(s) x {workers} worker process(es); each {memory.summary()}",
    ]
    return {"lines": lines, "shards": len(stream.shards), "quantized": by_format, "peak_bytes": memory.peak}
