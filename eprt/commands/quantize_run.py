"""eprt-quantize's steps: checked before any work, each writing one output of the work directory
(atomically, so a step whose output exists is done and a run started again continues after it),
then the export, its check, the summary, and the work directory removed.

    WORK/checkpoint     the eprt checkpoint, reading HF_DIR's weight files in place (eprt-convert --reference)
    WORK/calibrated     the calibrated checkpoint (eprt-ptq; its own WORK/calibrated.work resumes a layer)
    OUT                 the export with its model card (eprt-export), checked against HF_DIR (eprt-check)

A recipe that takes no activation statistic needs neither the model code nor the work directory:
the export streams HF_DIR's tensors, each quantized as it is written (eprt.hf.streaming), for any
model_type, and resumes shard by shard.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from argparse import Namespace
from dataclasses import dataclass

from eprt.commands.launch import launched_rank
from eprt.commands.ptq import parse_args, ptq
from eprt.data import check_sources
from eprt.errors import ConfigError, EprtError
from eprt.families import load_hf_config, read_hf_config
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.export_quantized import holding_layout
from eprt.hf.model_card import serve_commands
from eprt.hf.mxfp4_blocks_export import NAME as MXFP4_LAYOUT
from eprt.hf.serving import DEFAULT_RECIPE, check_target, describe_gpus, generation_of, gpus_needed
from eprt.hf.streaming import stream_export
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.progress import logger, quiet
from eprt.quant.recipe import Recipe, load_recipe
from eprt.quant.run.args import PTQArgs
from eprt.quant.run.datafree import data_free, say_data_free
from eprt.quant.run.setup import plan_recipe, run_dtype
from eprt.samples import first_sample
from eprt.storage.atomic import check_output_dir, write_file
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.hf_files import CARD
from eprt.units import format_bytes

SETTINGS = "eprt-quantize.json"  # in the work directory: the settings of the run it belongs to
FIRST_SAMPLE_CHARS = 400
TINY_PARAMETERS = 10**9  # above this, the built-in text is refused unless asked for (--calib builtin)


def streamed(recipe: Recipe, settings: PTQArgs) -> bool:
    """Whether the run streams HF_DIR into OUT (eprt.hf.streaming): its recipe takes no activation
    statistic (eprt.quant.run.datafree.data_free) and rotates nothing, a rotation rewriting the
    model's residual stream, which takes the converted model."""
    return data_free(recipe, settings) and not recipe.rotates


@dataclass
class Run:
    a: Namespace
    ptq_args: list[str]  # eprt-ptq's arguments passed on
    recipe: str
    work: str
    settings: PTQArgs  # eprt-ptq's settings of the run, as it parses them
    parsed: Recipe  # `recipe` under those settings

    @property
    def free(self) -> bool:
        """Streamed, not calibrated (`streamed`); GPT-OSS's release layout is written from the model only."""
        return streamed(self.parsed, self.settings) and self.a.format != MXFP4_LAYOUT

    @classmethod
    def of(cls, a: Namespace, ptq_args: list[str]) -> "Run":
        """The run, once everything its arguments and HF_DIR's headers can refuse is not."""
        if launched_rank():
            raise ConfigError(
                "eprt-quantize starts its ranks itself (--nproc-per-node N): run it once, not under torchrun or "
                "srun; on several nodes run eprt-convert, eprt-ptq under torchrun, then eprt-export"
            )
        if not os.path.isdir(a.hf_dir):
            raise ConfigError(f"{a.hf_dir}: not a directory; give the Hugging Face model's directory")
        recipe = a.recipe or (DEFAULT_RECIPE[generation_of(a.target)] if a.target else None)
        if recipe is None:
            raise ConfigError("give --recipe NAME (eprt-quantize --list-recipes), or --target GPU to pick one")
        # eprt-ptq's own refusals of its options
        settings, _ = parse_args(["-", "--recipe", recipe, "--out", "-", *ptq_args])
        parsed = load_recipe(recipe, settings.kv_cache, settings.algorithm)
        if streamed(parsed, settings):
            read_hf_config(a.hf_dir)  # any model_type streams; a config.json it can read is all it needs
        else:
            load_hf_config(a.hf_dir)  # calibration runs eprt's model: an unsupported model is refused by name
        if a.target:
            warning = check_target(parsed.formats, a.target, recipe)
            if warning:
                logger().warning(warning)
        work = os.path.abspath(a.work_dir or f"{a.out.rstrip(os.sep)}.work")
        check_output_dir(a.out, a.overwrite, (a.hf_dir, work))
        check_output_dir(work, True, (a.hf_dir,))
        if a.calib:
            check_sources(a.calib)
        if a.chat_template is not None and not os.path.isfile(a.chat_template):
            raise ConfigError(f"--chat-template {a.chat_template}: no such file; give a Jinja chat template file")
        return cls(a, ptq_args, recipe, work, settings, parsed)

    # --- the steps ---------------------------------------------------------------------------
    def run(self) -> int:
        if self.free:
            return self.stream()
        a = self.a
        self.claim_work_dir()
        ckpt = self.convert()
        ptq_argv = [ckpt, "--recipe", self.recipe, "--out", self.path("calibrated"), *self.ptq_args]
        pa, _ = parse_args(ptq_argv)
        with Checkpoint(ckpt) as ck:
            recipe, targets = plan_recipe(
                ResolvedCheckpoint.of(ck, run_dtype(pa.dtype)), self.recipe, pa.kv_cache, pa.algorithm
            )
            layout = a.format or holding_layout(recipe.formats)
            say_plan(recipe, len(targets), f"calibrated on {a.nproc_per_node or 1} rank(s)", layout)
            self.check_data(ck)
        code = self.calibrate(ptq_argv)
        if code:
            return code
        say_data_used(self.path("calibrated"))
        export_hf(
            self.path("calibrated"),
            a.out,
            fmt=a.format,
            overwrite=a.overwrite,
            base_model=a.base_model,
            progress=not quiet(),
        )
        self.check()
        print(summary(a.out, a.hf_dir, recipe, layout, "auto_map" in ck.source_config))
        shutil.rmtree(self.work)
        return 0

    def stream(self) -> int:
        """The data-free export, streamed from HF_DIR (its workers: --nproc-per-node), checked, summarized."""
        a, recipe = self.a, self.parsed
        say_data_free(self.settings, recipe)
        layout = a.format or holding_layout(recipe.formats)
        workers = a.nproc_per_node or 1
        say_plan(recipe, None, f"streamed from the weights on {workers} process(es)", layout)
        stream_export(
            a.hf_dir,
            a.out,
            self.recipe,
            algorithm=self.settings.algorithm,
            fmt=layout,
            workers=workers,
            overwrite=a.overwrite,
            progress=not quiet(),
            base_model=a.base_model,
        )
        self.check()
        print(summary(a.out, a.hf_dir, recipe, layout, "auto_map" in read_hf_config(a.hf_dir)))
        return 0

    def path(self, step: str) -> str:
        return os.path.join(self.work, step)

    def claim_work_dir(self) -> None:
        """Make the work directory, or continue the run whose settings it holds; refuse one of other settings."""
        a = self.a
        settings = {
            "hf_dir": os.path.realpath(a.hf_dir),
            "recipe": self.recipe,
            "format": a.format,
            "chat_template": a.chat_template and os.path.realpath(a.chat_template),
            "ptq": self.ptq_args,
        }
        marker = self.path(SETTINGS)
        if os.path.isdir(self.work) and os.listdir(self.work):
            if not os.path.isfile(marker):
                raise ConfigError(
                    f"{self.work} exists and is not the work directory of an eprt-quantize run: give another "
                    "--work-dir, or remove it"
                )
            with open(marker) as f:
                theirs = json.load(f)
            differ = [k for k in settings if theirs.get(k) != settings[k]]
            if differ:
                raise ConfigError(
                    f"{self.work} holds a run with other settings ({', '.join(differ)}): run that command "
                    "again to continue it, or remove the directory to start this one"
                )
            logger().info("continuing the run in %s", self.work)
            return
        os.makedirs(self.work, exist_ok=True)
        write_file(marker, json.dumps(settings, indent=1), "the run's settings")

    def convert(self) -> str:
        """The eprt checkpoint of HF_DIR, reading its weight files in place (done once)."""
        ckpt = self.path("checkpoint")
        if not os.path.isdir(ckpt):
            convert_hf(self.a.hf_dir, ckpt, reference=True, chat_template=self.a.chat_template, progress=not quiet())
        return ckpt

    def check_data(self, ck: Checkpoint) -> None:
        """Refuse the built-in text for a model that is not tiny unless asked for; show the first
        sample of the data as the model will read it (a chat rendered by its template)."""
        calib = self.a.calib
        if not calib and not self.a.builtin:
            params = sum(math.prod(t.shape) for t in ck.tensors.values())
            if params > TINY_PARAMETERS:
                raise ConfigError(
                    f"no --calib: calibrating this {params / 1e9:.1f}B-parameter model on eprt's built-in text "
                    "(1,135 tokens, repeated to fill every sequence) sets its scales from too little data: give "
                    "--calib DATA (your chat or text data, .jsonl or .txt), or --calib builtin to use it anyway"
                )
            return
        if not calib:
            return
        text = first_sample(calib, ck.hf_files_dir(), self.a.calib_column, FIRST_SAMPLE_CHARS)
        if text is not None:
            logger().info("first calibration sample of %s, as the model reads it:\n%s [...]", calib[0], text)

    def calibrate(self, ptq_argv: list[str]) -> int:
        """The calibrated checkpoint (done once; a killed calibration resumes after its last layer)."""
        out = self.path("calibrated")
        if os.path.isdir(out):
            return 0
        resume = ["--resume"] if os.path.isdir(f"{out}.work") else []
        nproc = ["--nproc-per-node", str(self.a.nproc_per_node)] if self.a.nproc_per_node else []
        return ptq([*ptq_argv, *resume, *nproc])

    def check(self) -> None:
        """OUT against HF_DIR: exactly its tensors, each quantized Linear's weight replaced by its scales."""
        library = importlib.util.find_spec("compressed_tensors") is not None
        problems = check_export(self.a.out, self.a.hf_dir, library=library)
        if problems:
            raise EprtError(
                f"{self.a.out} was written but fails its check against {self.a.hf_dir} (a bug in eprt):\n  "
                + "\n  ".join(problems)
            )


def say_data_used(calibrated: str) -> None:
    """One line per calibration source: the documents it gave, and how many were cut short or repeated."""
    with Checkpoint(calibrated) as ck:
        sources = ck.quantization["calibration"].get("sources", [])
    for s in sources:
        docs = "token ids" if s["documents"] is None else f"{s['documents']} documents ({s['truncated']} cut short)"
        logger().info(
            "calibration data %s: %s, %d tokens for %d sequences%s",
            s["path"],
            docs,
            s["tokens"],
            s["sequences"],
            "; it repeats from its start to fill them" if s["repeated"] else "",
        )


def say_plan(recipe: Recipe, modules: int | None, how: str, layout: str) -> None:
    logger().info(
        "plan: recipe %s (%s)%s, %s; the %s layout; serves on %s",
        recipe.name,
        ", ".join(recipe.formats),
        "" if modules is None else f" on {modules} modules",
        how,
        layout,
        describe_gpus(recipe.formats),
    )


def summary(out: str, hf_dir: str, recipe: Recipe, layout: str, remote_code: bool) -> str:
    """Where the output is, which GPUs serve it, and the commands that serve it."""
    out = os.path.abspath(out)
    weights = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    needs = gpus_needed(weights, recipe.formats)
    gpus = needs[-1][2] if needs else 8  # on the newest generation that serves it
    commands = serve_commands(layout, recipe.formats, recipe.kv_cache, remote_code)
    return "\n".join(
        [
            f"quantized model: {out} ({format_bytes(weights)} of weights; recipe {recipe.name}: "
            f"{', '.join(recipe.formats)}, in the {layout} layout), checked against {hf_dir}",
            f"serves on: {describe_gpus(recipe.formats)}",
            "its weights fit, with a fifth of each GPU left for the KV cache: "
            + (" or ".join(f"{n} x {gpu} ({gb} GB)" for gpu, gb, n in needs) or "no single GPU generation"),
            f"model card: {os.path.join(out, CARD)}",
            f"serve it on {gpus} GPU{'s' if gpus > 1 else ''} of one node:",
            *("  " + c.replace("$MODEL", out).replace("$GPUS", str(gpus)) for c in commands),
        ]
    )
