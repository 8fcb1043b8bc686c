"""Where a rotation moves the quantization error: each module kind's relative error of its input and
of its weight in a format, on one model read as it is and read rotated (eprt.quant.rotation).

    python bench/rotation_error.py --hf TRAINED_HF --calib CALIB.jsonl [--format nvfp4] [--calib-size 8]

For every Linear and the routed experts' two projections: ||q(x) - x|| / ||x|| of the inputs over
the calibration tokens (each call's input fake-quantized under the per-tensor scale of its own amax,
as a calibrated static input scale would be), and ||q(W) - W|| / ||W|| of the weight (max's
scales), summed per module kind over the layers, for the model unrotated and rotated, and their
ratio. The model runs unquantized: each figure is one module's own error on the same stream. And
what the rotation alone costs in the model's dtype (its weights rounded once more): the mean
per-token KL(unrotated || rotated) of the two models' next-token distributions.

With --outlier-channels N the model is first given N outlier channels in its residual stream (its
embedding's first N columns times --outlier-scale), the kind large trained models grow and a
rotation is for: it shows what the rotation does where there are outliers to spread.
"""

import argparse
import glob
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from contextlib import ExitStack

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.loading.loader import load_parallel  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.models.layers import Linear  # noqa: E402
from eprt.models.moe import Experts  # noqa: E402
from eprt.models.taps import tapped  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.formats import weight_format  # noqa: E402
from eprt.quant.numerics import abs_amax  # noqa: E402
from eprt.quant.rotation.rotated import RotatedCheckpoint  # noqa: E402
from eprt.quant.run.args import PTQArgs  # noqa: E402
from eprt.quant.run.data import report_data  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402


def kind(name: str) -> str:
    """A module's kind: its name without the layer index."""
    parts = name.split(".")
    return ".".join(p for p in parts[parts.index("layers") + 2 :]) if "layers" in parts else name


class Errors:
    """Squared error and squared norm sums per (kind, what)."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.sums = defaultdict(lambda: torch.zeros(2, dtype=torch.float64))

    def add(self, key, x: torch.Tensor, q: torch.Tensor) -> None:
        self.sums[key] += torch.stack([(q.double() - x.double()).square().sum(), x.double().square().sum()])

    def input(self, key, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if x.numel():
            self.add(key, x, self.fmt.fake_quantize_input(x, self.fmt.scale(abs_amax(x))))

    def weight(self, key, w: torch.Tensor) -> None:
        w = w.float()
        self.add(key, w, self.fmt.fake_quantize_weight(w, self.fmt.scale(abs_amax(w)), False, torch.float32))

    def relative(self) -> dict:
        return {k: (s[0] / s[1]).sqrt().item() for k, s in self.sums.items()}


def measure(model, ids: torch.Tensor, fmt) -> tuple[dict, torch.Tensor]:
    """(each module kind's relative errors, the log-probabilities of every token of `ids`)."""
    errors = Errors(fmt)
    with ExitStack() as stack:
        for name, m in model.named_modules():
            if isinstance(m, Linear) and ".layers." in name and not name.endswith(("gate", "shared_expert_gate")):
                errors.weight((kind(name), "weight"), m.weight)
                hook = m.register_forward_pre_hook(lambda _m, args, n=name: errors.input((kind(n), "input"), args[0]))
                stack.callback(hook.remove)
            elif isinstance(m, Experts):
                for e in range(m.w13.shape[0]):
                    errors.weight((kind(name) + ".w13", "weight"), m.w13[e])
                    errors.weight((kind(name) + ".w2", "weight"), m.w2[e])

                def routed(x, h, _counts, n=name):
                    errors.input((kind(n) + ".w13", "input"), x)
                    errors.input((kind(n) + ".w2", "input"), h)

                stack.enter_context(tapped(m, routed=routed))
        with torch.inference_mode():
            logp = torch.cat([torch.log_softmax(model(row[None]).float(), -1)[0] for row in ids])
    return errors.relative(), logp


def with_outliers(hf: str, channels: int, scale: float, out: str) -> str:
    """A copy of `hf` in `out` whose embedding's first `channels` columns are `scale` times larger."""
    shutil.copytree(hf, out)
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        tensors = load_file(path)
        if "model.embed_tokens.weight" in tensors:
            tensors["model.embed_tokens.weight"][:, :channels] *= scale
            save_file(tensors, path, metadata={"format": "pt"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--calib-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--outlier-channels", type=int, default=0)
    p.add_argument("--outlier-scale", type=float, default=20.0)
    args = p.parse_args()
    fmt = weight_format(args.format)
    state = ParallelState.single()
    with tempfile.TemporaryDirectory() as d:
        hf = args.hf
        if args.outlier_channels:
            hf = with_outliers(hf, args.outlier_channels, args.outlier_scale, os.path.join(d, "hf"))
        ck_dir = convert_hf(hf, os.path.join(d, "ck"), progress=False)
        with Checkpoint(ck_dir) as ck:
            a = PTQArgs(ck_dir, "nvfp4", "", calib=(args.calib,), calib_size=args.calib_size, seq_len=args.seq_len)
            ids = report_data(a, ck.hf_files_dir(), ck.config.vocab_size)[0]
            plain, p = measure(load_parallel(ResolvedCheckpoint.of(ck, torch.bfloat16), state), ids, fmt)
            rotated, q = measure(
                load_parallel(ResolvedCheckpoint.of(RotatedCheckpoint(ck), torch.bfloat16), state), ids, fmt
            )
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    print(f"the rotation alone, unquantized: KL(unrotated || rotated) {kl:.3g} per token")
    print(f"{args.format}: relative quantization error per module kind, {args.calib_size} x {args.seq_len} tokens")
    print(f"{'module':<34} {'what':<7} {'plain':>8} {'rotated':>8} {'ratio':>6}")
    for key in sorted(k for k in plain if plain[k] > 0):  # a weight-only format leaves the inputs as they are
        print(f"{key[0]:<34} {key[1]:<7} {plain[key]:>8.4f} {rotated[key]:>8.4f} {rotated[key] / plain[key]:>6.3f}")


if __name__ == "__main__":
    main()
