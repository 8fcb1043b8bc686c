"""The work directory of a layer-major calibration: what a killed run resumes from.

After each decoder layer, every rank saves, atomically, its sequences' hidden states (and block
snapshots) at that layer boundary with its statistics so far, as `rank-RRRRR/layer-NNNNN.safetensors`:
written beside, synced, renamed. The write runs on a thread of its own while the next layer
computes, from a copy of what it saves on the host (one save in flight at most: the memory plan's
`saving`, or on a GPU its host term `saved`). A rank drops its previous layer's file only once every
rank has saved the new one durably (a barrier on the host, at the next save or the end of the
layers), so the ranks always share a last completed layer. What each algorithm
decided at the layer (its `Resumable` state: GPTQ's codes, AWQ's folds) goes, once, to its own
`rank-RRRRR/ALGORITHM-NNNNN.safetensors`, written the same way before the layer file and kept to the
end: the work written grows with the layers, not with their square. A run started again with the same
arguments and inputs (eprt.quant.run.fingerprint) and `--resume` continues after the last layer file, with
every algorithm's state of every layer up to it, and computes the same bits as a run never stopped.

The directory is removed when the run ends, so eprt works only in one it made: a new (or empty)
directory, which it marks with MARKER, or one that holds that marker. It refuses a directory that
holds other files, and one that is, lies inside or holds an input or the output. It removes only
what it wrote there (its layer and algorithm files, their rank directories, the marker), and the directory
itself only where it made it and nothing else is left. The ranks share it (rank 0 marks it), so it
must lie on a file system every rank sees, as the output does.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eprt.errors import ConfigError, EprtError
from eprt.parallel import ParallelState
from eprt.parallel.barrier import host_barrier
from eprt.progress import logger
from eprt.quant.algorithms.registry import ALGORITHMS
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.sequences import LayerState
from eprt.quant.run import workdir_lock
from eprt.quant.run.fingerprint import differences, saved_fingerprint
from eprt.storage.atomic import fsync_path, naming_refused_writes, read_dirs, replacing, write_file
from eprt.storage.paths import within
from eprt.storage.safetensors_io import save_tensors

MARKER = ".eprt-work-dir.json"
WORK_DISK = "give a --work-dir on another disk (it holds one layer's hidden states)"
RANK_DIR = re.compile(r"rank-\d{5}")
LAYER_FILE = re.compile(r"layer-(\d{5})\.safetensors")
# a registered algorithm's state that a layer gained (eprt.quant.algorithms.registry)
ALGORITHM_FILE = re.compile(rf"({'|'.join(ALGORITHMS)})-(\d{{5}})\.safetensors")
SIDE_FILES = "side_files"  # a layer file's metadata: the algorithm files it relies on, name -> SHA-256
# a work file being written (eprt.storage.atomic.replacing)
PARTIAL_FILE = re.compile(rf"\.(layer|{'|'.join(ALGORITHMS)})-\d{{5}}\.safetensors\.partial-\d+-[0-9a-f]+")


class Resumable(NamedTuple):
    """An algorithm's state as a layer boundary saves it: `tensors()`, everything it decided so far
    by a name that stays (a boundary writes the names it has not written yet), and `load(tensors)`,
    what a resume gives it back."""

    algorithm: str
    tensors: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[dict[str, torch.Tensor]], None]


def check_work_dir(path: str, inputs: tuple[str, ...], out: str) -> str:
    """Refuse, before anything is written, a work directory eprt may not remove what it writes in:
    one that overlaps (is, lies inside, or holds) an input or the output, or that exists holding
    files without MARKER. Returns its real path."""
    work = os.path.realpath(path)
    for src in read_dirs(inputs):
        if within(work, src) or within(src, work):
            raise ConfigError(
                f"--work-dir {path} overlaps {src}, which this run reads; the work directory is "
                "removed when the run ends: give a --work-dir outside every input (and not holding "
                "one)"
            )
    out = os.path.realpath(out)
    if within(work, out) or within(out, work):
        raise ConfigError(
            f"--work-dir {path} overlaps the output {out}; the work directory is removed when the run "
            "ends: give a --work-dir outside the output and not holding it (the default is OUT.work)"
        )
    if os.path.lexists(work):
        if not os.path.isdir(work):
            raise ConfigError(f"--work-dir {path} exists and is not a directory: give a new directory")
        if os.listdir(work) and not os.path.isfile(os.path.join(work, MARKER)):
            raise ConfigError(
                f"--work-dir {path} exists and holds files eprt did not write (it has no {MARKER}); "
                "eprt removes its work directory when the run ends: give a new or empty directory"
            )
    return work


class WorkDir:
    def __init__(self, path: str, state: ParallelState, fingerprint: dict, base: str = ""):
        """`path`: checked by `check_work_dir` on every rank; `base`: the checkpoint the
        fingerprint pins, whose files a refused resume names."""
        self.path, self.state, self.base = path, state, base
        self.fingerprint = fingerprint
        self.mine = os.path.join(path, f"rank-{state.rank:05d}")
        self.saved: dict[str, set[str]] = {}  # algorithm -> the names its files hold
        self.side_files: dict[str, str] = {}  # this rank's algorithm files so far: name -> SHA-256
        self.lock: int | None = None  # rank 0: the descriptor holding the directory's lock
        self.writer: ThreadPoolExecutor | None = None  # writes a save while the next layer computes
        self.in_flight: tuple[int, Future] | None = None  # the save being written: (layer, its write)

    def prepare(self, resume: bool) -> None:
        """On rank 0: make and mark the directory, or, in one marked already, without `resume`,
        drop an earlier run's files. Every rank then calls `check_shared` (in a later guard)."""
        if self.state.rank != 0:
            return
        marker = os.path.join(self.path, MARKER)
        if os.path.isfile(marker):
            self.lock = workdir_lock.hold(self.path)  # before anything here is removed or written
            if not resume:
                for rank_dir in self._rank_dirs():
                    remove_own_files(rank_dir)
            return
        created = not os.path.isdir(self.path)
        with self.refused_writes(marker):
            os.makedirs(self.path, exist_ok=True)
            marked = json.dumps({"eprt": "work directory", "created": created})
            write_file(marker, marked, f"the work directory {self.path}", WORK_DISK)
            self.lock = workdir_lock.hold(self.path)
            fsync_path(os.path.dirname(self.path))

    def check_shared(self) -> None:
        """Refuse a work directory rank 0 made that this rank does not see."""
        if not os.path.isfile(os.path.join(self.path, MARKER)):
            raise EprtError(
                f"--work-dir {self.path}, made by rank 0, is not visible here; give a --work-dir on a "
                "file system every rank shares"
            )

    def refused_writes(self, path: str):
        return naming_refused_writes(
            path,
            f"the work directory {self.path}",
            WORK_DISK,
        )

    def _rank_dirs(self) -> list[str]:
        return [os.path.join(self.path, d) for d in sorted(os.listdir(self.path)) if RANK_DIR.fullmatch(d)]

    def _layers(self) -> list[int]:
        if not os.path.isdir(self.mine):
            return []
        return sorted(int(m.group(1)) for f in os.listdir(self.mine) if (m := LAYER_FILE.fullmatch(f)))

    def _file(self, layer: int) -> str:
        return os.path.join(self.mine, f"layer-{layer:05d}.safetensors")

    def _algorithm_file(self, algorithm: str, layer: int) -> str:
        return os.path.join(self.mine, f"{algorithm}-{layer:05d}.safetensors")

    def _saved_layers(self, algorithm: str) -> list[int]:
        """The layers whose state of `algorithm` the resumed layer file vouches for (`side_files`; a
        later one's, from a layer not every rank completed, is written again when that layer is)."""
        found = (ALGORITHM_FILE.fullmatch(f) for f in self.side_files)
        return sorted(int(m.group(2)) for m in found if m and m.group(1) == algorithm)

    def last_completed(self, resume: bool) -> int:
        """The last layer every rank has saved (-1: none, and always without `resume`), agreed over the world."""
        layers = self._layers() if resume else []
        last = torch.tensor(layers[-1] if layers else -1, device=self.state.device)
        self.state.all_reduce(last, over="dp", op=dist.ReduceOp.MIN)
        return int(last)

    def save(
        self, layer: int, ls: LayerState, cal: Calibrator, held=None, algorithms: tuple[Resumable, ...] = ()
    ) -> None:
        """With `held` (the quality report's held-out streams, eprt.quant.loop.passes.quality.QualityStreams), its two
        streams and what the report measured so far are saved too; of each of `algorithms`, what it
        gained since the last save, in the layer's file of that algorithm (AWQ's clip steps are a byte
        per quantization block: written again at every layer, they would make the work written grow
        with the square of the layers).

        The files are written in the background while the next layer computes: this call finishes
        the save before it (`finish`), copies what this one holds to the host (the next layer
        replaces the hidden states in place) and hands the copy to the writer; an error of the
        writer is raised by the next `save` or `finish`, naming the file."""
        self.finish()
        tensors = {k: host_copy(v) for k, v in {**states("", ls), **stats(cal)}.items()}
        metadata = {"fingerprint": json.dumps(self.fingerprint, sort_keys=True)}
        if held is not None:
            streams = {**states("eval.ref.", held.ref), **states("eval.quant.", held.quant)}
            tensors.update({k: host_copy(v) for k, v in streams.items()})
            metadata["quality"] = held.report.saved()
        sides = []
        for a in algorithms:
            saved = self.saved.setdefault(a.algorithm, set())
            # what an algorithm decided stays as it is: written without a copy
            gained = {n: t for n, t in a.tensors().items() if n not in saved}
            if gained:
                sides.append((self._algorithm_file(a.algorithm, layer), gained))
                saved.update(gained)
        if self.writer is None:
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="eprt-work-dir")
        self.in_flight = (layer, self.writer.submit(self._write_layer, layer, tensors, metadata, sides))

    def _write_layer(self, layer: int, tensors: dict, metadata: dict[str, str], sides: list) -> None:
        """On the writer's thread: the layer's algorithm files, then the layer file that vouches for them."""
        path = self.mine
        try:
            if not os.path.isdir(self.mine):
                with self.refused_writes(self.mine):
                    os.makedirs(self.mine)
                    fsync_path(self.path)
            for path, gained in sides:  # written before the layer file, which vouches for them
                self._write_side(path, gained, metadata)
            path = self._file(layer)
            # the layer file lists every algorithm file it relies on with its digest: --resume checks each
            self._write(path, tensors, {**metadata, SIDE_FILES: json.dumps(self.side_files, sort_keys=True)})
        except EprtError:
            raise
        except Exception as e:
            raise EprtError(
                f"{path}: saving layer {layer} to the work directory failed: {type(e).__name__}: {e}"
            ) from e

    def finish(self) -> None:
        """Wait for the save being written; once every rank has written it, drop the older layer files."""
        if self.in_flight is None:
            return
        (layer, written), self.in_flight = self.in_flight, None
        written.result()  # the writer's error, raised here on the main thread
        # once every rank holds `layer` durably, the older files are no longer the common last layer
        # (a barrier on the host: on NCCL a collective does not hold the host back)
        host_barrier(self.state, f"layer {layer} saved")
        for old in self._layers():
            if old < layer:
                os.remove(self._file(old))

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around the layers that `save`: on leaving, the last save is finished; on an error, the write
        in flight is waited for (no write outlives the run) and, with peers, not finished: a rank
        failing cannot know its peers wrote theirs, so its older file stays for --resume."""
        try:
            yield
            self.finish()
        except BaseException:
            if self.in_flight is not None:
                if self.in_flight[1].exception() is None and self.state.world == 1:
                    self.finish()
                self.in_flight = None
            raise
        finally:
            if self.writer is not None:
                self.writer.shutdown(wait=True)
                self.writer = None

    def _write(self, path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        # durable before it takes its name (eprt.storage.atomic): a crash leaves the old or the new
        with replacing(path, f"the work directory {self.path}", WORK_DISK) as tmp:
            save_tensors(tmp, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata)

    def _write_side(self, path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        self._write(path, tensors, metadata)
        with open(path, "rb") as f:
            self.side_files[os.path.basename(path)] = hashlib.file_digest(f, "sha256").hexdigest()

    def _vouched(self, layer: int, metadata: dict[str, str]) -> dict[str, str]:
        """The side files the saved `layer` relies on, each checked whole against its digest;
        refused by name where one is missing, edited, or the layer lists none (an older record)."""
        if SIDE_FILES not in metadata:
            raise ConfigError(
                f"{self._file(layer)}: lists no side files (saved by an earlier eprt); run without --resume to start over"
            )
        listed = json.loads(metadata[SIDE_FILES])
        for name, digest in listed.items():
            path = os.path.join(self.mine, name)
            if not (ALGORITHM_FILE.fullmatch(name) and os.path.isfile(path)):
                raise ConfigError(
                    f"{path}: missing; the saved layer {layer} relies on it: run without --resume to start over"
                )
            with open(path, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                    raise ConfigError(
                        f"{path}: changed since it was saved (its SHA-256 differs from the one layer {layer} "
                        "recorded); run without --resume to start over"
                    )
        return listed

    def _read(self, path: str, device) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A saved file's tensors and metadata, refused when another run saved it or it is damaged."""
        try:
            with safe_open(path, "pt") as f:
                metadata = f.metadata() or {}
            found = saved_fingerprint(metadata.get("fingerprint"))
            differ = differences(found, self.fingerprint, self.base)
            if differ:
                raise ConfigError(
                    f"{path}: saved by a run with other arguments or inputs ({'; '.join(differ)} "
                    f"differ); run without --resume to start over, or resume with the arguments and "
                    "inputs of the run that saved it"
                )
            return load_file(path, device=str(device)), metadata
        except SafetensorError as e:
            raise ConfigError(
                f"{path}: the saved layer is truncated or corrupt ({e}); run without --resume to start over"
            ) from None

    def load(
        self, layer: int, cal: Calibrator, device, held=None, algorithms: tuple[Resumable, ...] = ()
    ) -> LayerState:
        tensors, metadata = self._read(self._file(layer), device)
        self.side_files = self._vouched(layer, metadata)
        load_stats(cal, tensors)
        for a in algorithms:
            for done in self._saved_layers(a.algorithm):
                a.load(self._read(self._algorithm_file(a.algorithm, done), "cpu")[0])
            self.saved[a.algorithm] = set(a.tensors())
        if held is not None:
            held.ref, held.quant = from_states("eval.ref.", tensors), from_states("eval.quant.", tensors)
            held.report.restore(metadata["quality"])
        if self.state.rank == 0:
            logger().info("resuming after layer %d from %s", layer, self.path)
        return from_states("", tensors)

    def remove(self) -> None:
        """Once the output is written: every rank drops its own files, then rank 0 the marker and
        the directory, where eprt made it and nothing else is left in it."""
        remove_own_files(self.mine)
        host_barrier(self.state, "work files removed")
        if self.state.rank != 0:
            return
        marker = os.path.join(self.path, MARKER)
        created = read_marker(marker).get("created") is True
        workdir_lock.release(self.path, self.lock)
        if os.path.isfile(marker):
            os.remove(marker)
        if created:
            try:
                os.rmdir(self.path)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise


def read_marker(path: str) -> dict:
    """What MARKER says, or {} where it is gone or unreadable (then the directory is left in place)."""
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def remove_own_files(rank_dir: str) -> None:
    """A rank directory's layer and algorithm files (whole or half-written), then the directory if nothing else is in it."""
    if not os.path.isdir(rank_dir):
        return
    for name in os.listdir(rank_dir):
        if any(p.fullmatch(name) for p in (LAYER_FILE, ALGORITHM_FILE, PARTIAL_FILE)):
            os.remove(os.path.join(rank_dir, name))
    if not os.listdir(rank_dir):
        os.rmdir(rank_dir)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to the host, contiguous, as a save writes it: its own memory whatever `t` does next."""
    return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def states(prefix: str, ls: LayerState) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}hidden": ls.hidden,
        **{f"{prefix}block.{j}": b for j, b in enumerate(ls.blocks)},
        **{f"{prefix}carried.{name}": t for name, t in ls.carried.items()},
    }


def from_states(prefix: str, tensors: dict[str, torch.Tensor]) -> LayerState:
    count = sum(k.startswith(f"{prefix}block.") for k in tensors)
    carried = {k.removeprefix(f"{prefix}carried."): t for k, t in tensors.items() if k.startswith(f"{prefix}carried.")}
    return LayerState(tensors[f"{prefix}hidden"], [tensors[f"{prefix}block.{j}"] for j in range(count)], carried)


def stats(cal: Calibrator) -> dict[str, torch.Tensor]:
    out = {f"input_amax/{n}": t for n, t in cal.input_amax.items()}
    for n, (x_amax, h_amax) in cal.expert_amax.items():  # saved under the gated shape's names, for every shape
        out[f"w13_amax/{n}"], out[f"w2_amax/{n}"], out[f"tokens/{n}"] = x_amax, h_amax, cal.expert_tokens[n]
    out.update({f"all_tokens/{n}": t for n, t in cal.expert_all_tokens.items()})
    for n, (k, v) in cal.kv_amax.items():
        out[f"k_amax/{n}"], out[f"v_amax/{n}"] = k, v
    return out


def load_stats(cal: Calibrator, tensors: dict[str, torch.Tensor]) -> None:
    """Refill the statistics `stats` saved (observers installed later keep adding to them)."""
    got = {kind: {} for kind in ("input_amax", "w13_amax", "w2_amax", "tokens", "all_tokens", "k_amax", "v_amax")}
    for key, t in tensors.items():
        kind, _, name = key.partition("/")
        if kind in got:
            got[kind][name] = t  # on the device `load` read them to, where the observers add to them
    cal.input_amax.update(got["input_amax"])
    cal.expert_amax.update({n: (t, got["w2_amax"][n]) for n, t in got["w13_amax"].items()})
    cal.expert_tokens.update(got["tokens"])
    cal.expert_all_tokens.update(got["all_tokens"])
    cal.kv_amax.update({n: (t, got["v_amax"][n]) for n, t in got["k_amax"].items()})
