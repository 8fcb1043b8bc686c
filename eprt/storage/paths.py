"""Every path a checkpoint names stays inside its directory.

A path read from a checkpoint (an index's shard, a manifest's weight file or carried file) must be
relative, without `..`, and must resolve, links followed, inside the checkpoint's directory. One
exception keeps the Hugging Face cache working: a snapshot directory
`models--ORG--NAME/snapshots/REV/` holds links into its own repository's `blobs/`
(`../../blobs/HASH`), so under such a directory a link may also resolve inside that `blobs/`.
"""

from __future__ import annotations

import os

from eprt.errors import CheckpointError


def within(path: str, root: str) -> bool:
    root = root.rstrip(os.sep) or os.sep
    return path == root or path.startswith(root if root == os.sep else root + os.sep)


def hf_cache_blobs(root_real: str) -> str | None:
    """The `blobs/` directory of the Hugging Face cache repository whose snapshot `root_real` is, if it is one."""
    snapshots = os.path.dirname(root_real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return os.path.join(repo, "blobs")
    return None


def check_relative(rel, where: str) -> str:
    """`rel` as a checkpoint may name a file: a relative path with no `..`; refused otherwise."""
    if (
        not isinstance(rel, str)
        or not rel
        or "\0" in rel
        or os.path.isabs(rel)
        or ".." in rel.replace("\\", "/").split("/")
    ):
        raise CheckpointError(
            f"{where}: names the path {rel!r}, which leaves its directory; a checkpoint names "
            "only files inside its own directory: the checkpoint is corrupt or crafted, "
            "do not use it"
        )
    return rel


def resolve_inside(root: str, rel, where: str) -> str:
    """The path of `rel` under `root`, once it is known to resolve (links followed) inside `root`,
    or inside the `blobs/` of the Hugging Face cache repository `root` is a snapshot of."""
    path = os.path.join(root, check_relative(rel, where))
    real, root_real = os.path.realpath(path), os.path.realpath(root)
    blobs = hf_cache_blobs(root_real)
    if not (within(real, root_real) or (blobs is not None and within(real, blobs))):
        raise CheckpointError(
            f"{where}: {rel} links to {real}, outside {root}; eprt reads only files inside the "
            "checkpoint's directory: copy the file itself there in place of the link"
        )
    return path
