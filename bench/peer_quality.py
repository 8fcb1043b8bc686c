"""eprt's weight algorithms against llm-compressor's on one trained model, both scored alike.

    python bench/peer_quality.py --hf TRAINED_HF_DIR --calib CALIB.jsonl --eval EVAL.txt \
        --peer-python PEER_VENV/bin/python --recipes int4_g32 nvfp4_a16 --calib-size 64 --seq-len 256 --eval-size 32

--recipes takes recipe names or YAML paths (a rule's `grid: kimi`, say); by default the recipes of
every weight format both tools write and the scorer decodes: INT4 in groups of 32 and 128 (on the
source's grid), NVFP4, FP8 per tensor (scored by its weights alone), in blocks and per channel, and
MXFP4 (MXFP8's `mxfp8-quantized` layout is not among the compressed-tensors formats eprt's decoding
reads, eprt.storage.encodings.CT_FORMATS). A
recipe eprt refuses on the model (INT4's groups of 128 beside a narrower input dim) and a run the
peer fails (a format it does not write) are said on stderr and left out of the table.

Both sides calibrate on the same token sequences (eprt's reading of --calib) and quantize the
same modules in the same format: the peer (bench/peer_llmcompressor.py, run by --peer-python, an
environment with llm-compressor) takes its scheme and ignore list from eprt's compressed-tensors
export of the recipe. Each export, eprt's and the peer's, is then decoded by the compressed-tensors
library, module by module, into a plain bf16 checkpoint (AWQ's folds are in its norms and
routers), which transformers runs on --eval-size sequences of --eval: the mean per-token
KL(unquantized || quantized), its 99th percentile and the top-1 agreement, against the unquantized
checkpoint run the same way. The recipes are weight-only (inputs quantized at run time are not in
a decoded checkpoint). The figure to read is each side's ratio to its own GPTQ and the two sides'
KL on the same algorithm; eprt's own quality report (its `KL report` column, the same held-out
sequences) checks the decoding."""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.quality import checkpoint, run  # noqa: E402
from eprt.data import calibration_samples  # noqa: E402
from eprt.errors import EprtError  # noqa: E402
from eprt.storage.encodings import CT_PREFIX, decoder, matches  # noqa: E402

EPRT_ALGORITHMS = ("max", "gptq", "awq", "awq+gptq")
PEER_OF = {"max": "rtn", "gptq": "gptq", "awq": "awq", "awq+gptq": "awq+gptq"}
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_llmcompressor.py")


def scheme_of(qc: dict, module: str) -> tuple[str, dict] | None:
    """(format, scheme) of the config group that quantizes `module`, None where none does."""
    if matches(module, qc.get("ignore") or []):
        return None
    for group in qc["config_groups"].values():
        if matches(module, group["targets"]):
            return group.get("format", qc["format"]), {k: v for k, v in group.items() if k != "format"}
    return None


def dequantized(export: str, out: str) -> str:
    """The compressed-tensors export `export` as a bf16 checkpoint in `out`: each quantized
    module's weight decoded by the library, every other tensor as it is."""
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(export, "*.safetensors"))):
        tensors.update(load_file(path))
    modules = {name.rsplit(".", 1)[0] for name in tensors if name.endswith((".weight_packed", ".weight_scale"))}
    # a quantized module's tensors are its encoding (weight, scales, shapes) but for its bias
    plain = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in modules or k.endswith(".bias")}
    for module in sorted(modules):
        found = scheme_of(qc, module)
        if found is None:
            raise SystemExit(f"{export}: {module} has quantized tensors but no config group quantizes it")
        d = decoder(CT_PREFIX + found[0], found[1], f"{export}: {module}")
        weight = d.decode({c: tensors[f"{module}.{c}"] for c in d.components})
        plain[f"{module}.weight"] = weight.to(torch.bfloat16).contiguous()  # a partial block's decoding is a view
    os.makedirs(out)
    save_file(plain, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@torch.no_grad()
def logprobs(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    return torch.cat([torch.log_softmax(model(t[None]).logits[0].float(), -1) for t in tokens])


def scored(ref: torch.Tensor, q: torch.Tensor) -> dict:
    kl = (ref.exp() * (ref - q)).sum(-1)
    return {
        "kl_mean": kl.mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "top1": (ref.argmax(-1) == q.argmax(-1)).float().mean().item(),
    }


def peer_run(args, tokens: str, scheme: str, algorithm: str, out: str) -> float | None:
    """The peer's run's seconds; None where it failed (a format it does not write), said on stderr."""
    start = time.perf_counter()
    cmd = [args.peer_python, PEER, "--hf", args.hf, "--tokens", tokens, "--scheme", scheme]
    done = subprocess.run([*cmd, "--algorithm", algorithm, "--out", out], capture_output=True, text=True)
    if done.returncode:
        print(f"the peer's {algorithm} run of {scheme} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True, help="a trained Hugging Face checkpoint")
    p.add_argument("--calib", required=True)
    p.add_argument("--eval", required=True, help="held-out text, scored by both sides' decoded exports")
    p.add_argument("--peer-python", required=True, help="the Python of an environment with llm-compressor")
    # the formats both tools write, by their weights (a decoded checkpoint has no input quantization)
    p.add_argument(
        "--recipes",
        nargs="+",
        default=["int4_g32", "int4", "nvfp4_a16", "fp8_block", "fp8_channel", "fp8", "mxfp4"],
    )
    p.add_argument("--algorithms", nargs="+", default=list(EPRT_ALGORITHMS), choices=EPRT_ALGORITHMS)
    p.add_argument(
        "--peer-algorithms", nargs="+", choices=EPRT_ALGORITHMS, help="the peer's runs (default: --algorithms)"
    )
    p.add_argument("--calib-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-size", type=int, default=32)
    a = p.parse_args()
    args = SimpleNamespace(**vars(a), kv_cache=None, export_format="compressed-tensors")
    with open(os.path.join(a.hf, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    with tempfile.TemporaryDirectory() as d:
        calib = calibration_samples(a.calib, a.hf, num_samples=a.calib_size, seq_len=a.seq_len, vocab_size=vocab)
        held = calibration_samples(a.eval, a.hf, num_samples=a.eval_size, seq_len=a.seq_len, vocab_size=vocab)
        tokens = os.path.join(d, "calib.pt")
        torch.save(calib, tokens)
        ref = logprobs(a.hf, held)
        ck = checkpoint(a.hf, args, d)
        print(
            f"{a.calib_size} x {a.seq_len} calibration tokens, {a.eval_size} held-out sequences of {a.eval}, "
            f"both sides decoded and run by transformers; {a.hf}"
        )
        print(
            f"{'recipe':<13} {'side':<15} {'algorithm':<9} {'KL mean':>9} {'/ gptq':>7} {'KL p99':>8} {'top-1':>7} "
            f"{'KL report':>9} {'ptq s':>6}"
        )
        for recipe in a.recipes:
            rows = []
            try:
                for algorithm in a.algorithms:
                    r = run(ck, recipe, algorithm, args, d)
                    rows.append(("eprt", algorithm, r["export"], r["quality"]["kl_mean"], r["ptq_s"]))
            except EprtError as e:  # a format whose blocks the model's widths do not fill, say
                print(f"eprt refuses {recipe} on {a.hf}, left out: {e}", file=sys.stderr)
                continue
            label = os.path.splitext(os.path.basename(recipe))[0]
            with open(os.path.join(rows[0][2], "config.json")) as f:
                scheme = os.path.join(d, f"{label}-scheme.json")
                with open(scheme, "w") as g:
                    json.dump(json.load(f)["quantization_config"], g)
            for algorithm in a.peer_algorithms or a.algorithms:
                out = f"{d}/{label}-peer-{algorithm}"
                seconds = peer_run(a, tokens, scheme, PEER_OF[algorithm], out)
                if seconds is not None:
                    rows.append(("llm-compressor", algorithm, out, None, seconds))
            results = {}
            for side, algorithm, export, report, seconds in rows:
                plain = dequantized(export, export + "-bf16")
                results[side, algorithm] = (scored(ref, logprobs(plain, held)), report, seconds)
                shutil.rmtree(plain)
            for (side, algorithm), (s, report, seconds) in results.items():
                gptq = results.get((side, "gptq"))
                ratio = f"{s['kl_mean'] / gptq[0]['kl_mean']:>7.3f}" if gptq else f"{'':>7}"
                print(
                    f"{label:<13} {side:<15} {algorithm:<9} {s['kl_mean']:>9.4g} {ratio} {s['kl_p99']:>8.4g} "
                    f"{100 * s['top1']:>6.2f}% {report if report is None else f'{report:.4g}'!s:>9} {seconds:>6.1f}"
                )


if __name__ == "__main__":
    main()
