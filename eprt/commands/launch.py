"""`eprt-ptq --nproc-per-node N ...`: N local ranks started by torch's elastic launcher (the engine
torchrun runs on), and one line at the end when a rank fails.

Under torchrun a refused run ends with the rank's own line, then torchrun's ChildFailedError
traceback, so the last thing a user reads is the launcher's, not the cause. Here every rank files
its one-line verdict in the error file the launcher names in TORCHELASTIC_ERROR_FILE
(`eprt.cli.file_verdict`); when a rank fails, the launcher stops the others and ends with the first
verdict, its rank and its exit code. Several nodes keep torchrun (or srun running torchrun): the
ranks read the same environment either way (docs/launch.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid

from eprt.cli import LAUNCHED
from eprt.errors import ConfigError

# What the ranks' verdicts say when no rank filed one: how a process ends without a word.
SILENT_DEATHS = {
    signal.SIGKILL: "killed by SIGKILL (the kernel's out-of-memory killer, or by hand)",
    signal.SIGSEGV: "crashed (SIGSEGV)",
    signal.SIGABRT: "aborted (SIGABRT)",
    signal.SIGBUS: "crashed (SIGBUS: a file it mapped shrank, or the disk failed)",
}


class Stopped(Exception):
    """The launcher itself got SIGINT or SIGTERM; its ranks were stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def launched_rank() -> bool:
    """True in a process some launcher started as one rank of a run (torchrun, srun, this one)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(module: str, argv: list[str], nproc: int) -> int:
    """Run `python -m module *argv` as `nproc` ranks on this machine; 0 when every rank succeeded,
    else one line on stderr for the first rank that failed, and its exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc}: the number of local ranks must be at least 1")
    if launched_rank():
        raise ConfigError(
            "--nproc-per-node starts the ranks itself, but this process is already rank "
            f"{os.environ['RANK']} of a launched run: leave --nproc-per-node out under torchrun or srun"
        )
    # torchrun gives each rank one thread when it starts several; here each rank gets its share of
    # the cores instead, as its CPU workers take whole pieces and move no bit (docs/architecture.md)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
    )
    # the agent's own lines (its config, each worker's start and exit) would bury the verdict
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    # the ranks inherit it: a rank's refusal is printed once, by this launcher, not by every rank too
    os.environ[LAUNCHED] = "1"
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        code = failure.exitcode
        how = f"exit code {code}" if code >= 0 else signal.Signals(-code).name
        print(f"error (rank {rank} of {nproc}, {how}): {verdict(failure)}", file=sys.stderr)
        return code if code > 0 else 1
    except SignalException as e:
        raise Stopped(int(e.sigval)) from None
    finally:
        del os.environ[LAUNCHED]
    return 0


def first_failure(failures: dict) -> tuple[int, object]:
    """The rank that failed first: by the time its verdict was filed, ranks the launcher stopped
    (SIGTERM, sent to the rest once one failed) last."""

    def order(item):
        rank, f = item
        filed = f.error_file_data.get("eprt_time") if isinstance(f.error_file_data, dict) else None
        return (f.exitcode == -signal.SIGTERM, filed if filed is not None else f.timestamp, rank)

    return min(failures.items(), key=order)


def verdict(failure) -> str:
    """The rank's own line where it filed one, else how it ended."""
    if isinstance(failure.message, str) and failure.error_file_data.get("eprt_time") is not None:
        return failure.message
    if failure.exitcode < 0:
        sig = signal.Signals(-failure.exitcode)
        return SILENT_DEATHS.get(sig, f"ended by {sig.name}") + "; the other ranks were stopped"
    return "it ended without saying why (its output is above)"


def without_nproc(argv: list[str]) -> list[str]:
    """The command line each rank runs: the same, less --nproc-per-node and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out
