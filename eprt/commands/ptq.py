"""Post-training quantization of an eprt checkpoint, expert parallel over the ranks of a run.

    eprt-ptq --nproc-per-node N CKPT --recipe nvfp4 --out OUT [--ep E] [--kv-cache fp8]   # N local ranks
    eprt-ptq CKPT --dry-run                                                              # a world of one
    torchrun --nnodes M --nproc-per-node N ... $(which eprt-ptq) CKPT ...                # several nodes

The world factors as edp x ep: the ranks of an ep group hold one share of the routed experts
each and exchange tokens; ep defaults to the world size. --dry-run prints the layout, each
rank's weight bytes and planned peak memory, computed from the checkpoint's manifest without
reading a weight, and exits; with --device cuda it plans GPU ranks (their device and their host
memory) from a machine without GPUs.
"""

import sys

from eprt.cli import command_parser, run
from eprt.commands.launch import Stopped
from eprt.errors import ConfigError
from eprt.flags import add_flags, from_flags
from eprt.quant.run.args import PTQArgs


def parse_args(argv: list[str] | None = None) -> tuple[PTQArgs, int | None]:
    """The run's settings and --nproc-per-node (the launcher's, not the run's)."""
    ap = command_parser(__doc__, "launch")
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N ranks on this machine and run on them (one machine; several nodes use torchrun)",
    )
    ap.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and the GPUs that run each")
    add_flags(ap, PTQArgs)
    ns = ap.parse_args(argv)
    return from_flags(PTQArgs, ns), ns.nproc_per_node


def ptq(argv: list[str] | None = None) -> int:
    """Start the local ranks (--nproc-per-node), once what can be refused from the manifest and the
    arguments is not, or join the run, read the checkpoint's manifest on every rank, then the dry
    run or calibration."""
    argv = sys.argv[1:] if argv is None else argv
    if "--list-recipes" in argv:
        from eprt.hf.serving import list_recipes

        print(list_recipes())
        return 0
    a, nproc_per_node = parse_args(argv)
    if not a.dry_run and not ((a.recipe or a.auto_quantize is not None) and a.out):
        raise ConfigError(
            "--recipe and --out are required (--auto-quantize BUDGET in place of --recipe; or --dry-run to "
            "print the layout only)"
        )
    if a.estimate_time and not (a.dry_run and a.recipe):
        raise ConfigError("--estimate-time is for --dry-run with --recipe: the recipe sets the runs a layer takes")
    if a.save_every < 0 or (a.resume and a.save_every == 0):
        raise ConfigError(
            f"--save-every {a.save_every}: give N >= 1 to save every N-th layer (0, never, saves nothing "
            "--resume could continue from)"
        )
    # the model code loads only now: the parser above and `--help` need none of it
    from eprt.commands.ptq_run import run_command

    return run_command(argv, a, nproc_per_node)


def main() -> int:
    try:
        return run(ptq)
    except Stopped as e:  # the ranks stop on their own signal, each removing its partial output
        print(f"error: stopped by {e}; every rank was stopped and no output was written", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
