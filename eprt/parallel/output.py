"""One output directory written by every rank: it appears, complete, only if every rank's write succeeded.

    write_together(state, out, lambda tmp: save_tensors(f"{tmp}/rank-{state.rank}.safetensors", mine))

Rank 0 names and prepares the temp directory beside `out` (`eprt.storage.atomic.temp_dir_for`, unique to
the run; the other ranks learn the name through the run's store), every rank writes
its own files into it, and rank 0 renames it into place (`eprt.storage.atomic.publish`) once every rank
has reported success; after a failure anywhere it removes the temp directory instead. `out` and
its temp directory must lie on a file system every rank sees.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from eprt.errors import EprtError
from eprt.parallel.guard import fail_together
from eprt.parallel.state import ParallelState
from eprt.storage.atomic import check_output_dir, publish, sync_tree, temp_dir_for


def write_together(
    state: ParallelState,
    out: str,
    write_fn: Callable[[str], object],
    *,
    overwrite: bool = False,
    inputs: tuple[str, ...] = (),
    check_fn: Callable[[str], object] | None = None,
) -> str:
    """Run `write_fn(tmp_dir)` on every rank and publish `tmp_dir` as `out`; returns `out`'s real path.

    Every rank of `state` must call it. `write_fn` writes this rank's files (names no other rank
    uses); every rank then syncs the directory, so that its own writes are on disk also where
    ranks sit on different machines. An existing non-empty `out` is refused unless `overwrite`,
    and replaced only once the new one is complete. `check_fn(tmp_dir)`, if given, runs on rank 0
    once every rank has written, and may refuse the whole output by raising. On any rank's
    failure every rank raises `RankFailure` naming it, and nothing new is left behind: an old
    `out` stays as it was, and the temp directory is removed.
    """
    tmp = shared_temp_dir(state, out)
    try:
        # Every rank checks: a rank may see another file system, or other permissions, than rank 0.
        with fail_together(state, "preparing the output"):
            out = check_output_dir(out, overwrite, inputs)
            if state.rank == 0:
                os.makedirs(tmp)
        # A guard returns on a rank only once every rank has reported, so tmp exists from here on.
        with fail_together(state, "writing the output"):
            if not os.path.isdir(tmp):
                raise EprtError(
                    f"{tmp}, made by rank 0, is not visible here; write the output to a file system every rank shares"
                )
            write_fn(tmp)
            sync_tree(tmp)
        with fail_together(state, "publishing the output"):
            if state.rank == 0:
                if check_fn is not None:
                    check_fn(tmp)
                publish(tmp, out, overwrite)
    except BaseException:
        if state.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def shared_temp_dir(state: ParallelState, out: str) -> str:
    """Rank 0's fresh temp directory name for `out`, the same on every rank."""
    if state.world == 1 or state.store is None:
        return temp_dir_for(out)
    key = f"output/temp/{state.guards_entered}"  # every rank has entered as many guards so far
    if state.rank == 0:
        state.store.set(key, temp_dir_for(out).encode())
    return state.store.get(key).decode()
