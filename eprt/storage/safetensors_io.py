"""Reading and writing safetensors files byte range by byte range.

eprt reads with `os.pread` instead of mapping whole files, so a rank that needs rows [a, b)
of a stacked expert tensor reads exactly those bytes (plus the header), and the bytes read
are counted. Writes stream tensor by tensor into a file whose header is known up front, so
neither side ever holds more than the tensor in hand.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass

import torch

from eprt.errors import CheckpointError
from eprt.storage.atomic import new_file
from eprt.storage.bounded import parse_json

# safetensors' dtype codes in headers and manifests ("BF16") -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's scales
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} has no safetensors encoding")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape[1:])


class SafetensorsFile:
    """One safetensors file, header validated on open, tensors read by byte range."""

    def __init__(self, path: str):
        self.path = path
        self.bytes_read = 0
        self._counting = threading.Lock()  # threads may read one file side by side
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
        try:
            self.tensors, self.metadata = self._read_header()
        except BaseException:
            self.close()
            raise

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        self.count_read(len(data))
        return data

    def count_read(self, n: int) -> None:
        with self._counting:
            self.bytes_read += n

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict]:
        size = os.fstat(self._fd).st_size
        head = self._pread(8, 0)
        if len(head) < 8:
            raise CheckpointError(
                f"{self.path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{self.path}: corrupt or truncated: header length {n} does not fit the file ({size} bytes)"
            )
        header = parse_json(self._pread(n, 8), self.path, "a corrupt header: download the file again", CheckpointError)
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt header (not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + n, size - 8 - n
        tensors = {}
        for name, h in header.items():
            try:
                dtype = SAFETENSORS_DTYPES[h["dtype"]]
                shape = tuple(h["shape"])
                begin, end = h["data_offsets"]
                if not all(type(x) is int and x >= 0 for x in (*shape, begin, end)):
                    raise ValueError("sizes and offsets are non-negative integers")
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: corrupt header entry for tensor {name!r}: {h!r}") from None
            want = dtype.itemsize * math.prod(shape)
            if end - begin != want or begin < 0:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} spans {end - begin} bytes but "
                    f"{h['dtype']}{list(shape)} needs {want}: corrupt file"
                )
            if end > data_size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} ends at byte {data_start + end} past the "
                    f"end of the file ({size} bytes): truncated file"
                )
            tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, want)
        self._check_tiling(tensors, data_start, data_size)
        return tensors, metadata

    def _check_tiling(self, tensors: dict[str, TensorInfo], data_start: int, data_size: int) -> None:
        """The safetensors library's own rule (tensor.rs `validate`): the tensors, in offset order,
        tile the data section exactly: each starts where the previous ends, and the last ends at
        the end of the file. Two tensors sharing bytes, or bytes no tensor covers, are refused."""
        end, previous = 0, None
        for t in sorted(tensors.values(), key=lambda t: (t.start, t.start + t.nbytes)):
            begin = t.start - data_start
            if begin < end:
                raise CheckpointError(
                    f"{self.path}: tensor {t.name!r} overlaps tensor {previous!r} (bytes "
                    f"[{begin}, {end}) of the data belong to both): corrupt or crafted file, "
                    "do not use it"
                )
            if begin > end:
                raise CheckpointError(
                    f"{self.path}: bytes [{end}, {begin}) of the data, before tensor {t.name!r}, "
                    "belong to no tensor: corrupt or crafted file, do not use it"
                )
            end, previous = begin + t.nbytes, t.name
        if end != data_size:
            raise CheckpointError(
                f"{self.path}: the last {data_size - end} bytes of the file belong to no tensor "
                f"(the tensors end at data byte {end}): corrupt or crafted file, do not use it"
            )

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        return self.tensors[name]

    def read_bytes_into(self, buf: memoryview, offset: int) -> None:
        got = 0
        while got < len(buf):
            n = os.preadv(self._fd, [buf[got:]], offset + got)
            if n == 0:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {offset + got}")
            got += n
        self.count_read(got)

    def byte_range(self, name: str, rows: tuple[int, int] | None = None) -> tuple[int, int]:
        """(offset, length) in the file of the tensor, or of rows [a, b) of it along dim 0."""
        t = self.info(name)
        if rows is None:
            return t.start, t.nbytes
        a, b = rows
        if not (t.shape and 0 <= a <= b <= t.shape[0]):
            raise CheckpointError(f"{self.path}: rows [{a}, {b}) are outside tensor {name!r} of shape {list(t.shape)}")
        return t.start + a * t.row_bytes, (b - a) * t.row_bytes

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or rows [a, b) of it along dim 0, read from disk and nothing more."""
        t = self.info(name)
        start, _ = self.byte_range(name, rows)
        shape = t.shape if rows is None else (rows[1] - rows[0], *t.shape[1:])
        out = torch.empty(shape, dtype=t.dtype)
        if out.numel():
            self.read_bytes_into(memoryview(out.view(-1).view(torch.uint8).numpy()), start)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor in row-major order, without a copy when it is contiguous."""
    t = t.detach().contiguous().cpu().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


SYNC_BEHIND_BYTES = 64 * 1024**2  # written before the writer has the kernel write them to disk
# Tensors smaller than this are gathered and written together: one system call each cost more than
# their bytes (a trillion-parameter export has a quarter of a million norms and scales).
WRITE_BUFFER_BYTES = 1024**2


class SafetensorsWriter:
    """Streams tensors into a new safetensors file whose entries are declared up front.

    `entries` lists (name, dtype, shape) in file order; `write` must then be called for each
    entry in that order (a tensor may arrive in several row chunks). The output directory is
    synced as a whole once it is complete (eprt.storage.atomic); meanwhile, every
    SYNC_BEHIND_BYTES a thread of the writer's own flushes what was written so far, so the
    disk writes while the next tensors are computed and the final sync finds little left.

    With `span` (a, b), the writer writes entries a to b - 1 only, at their places in a file
    `create_for_parts` made: processes writing its spans side by side fill one file, the same bytes
    as one writer writes.
    """

    def __init__(
        self,
        path: str,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict | None = None,
        span: tuple[int, int] | None = None,
    ):
        self.path = path
        header, offset = {}, 0
        self._sizes = []
        self._offsets = []
        for name, dtype, shape in entries:
            n = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._sizes.append((name, n))
            self._offsets.append(offset)
            offset += n
        header["__metadata__"] = {"format": "pt", **(metadata or {})}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as the library writes it
        self.data_start = 8 + len(raw)
        self._next, self._end = span or (0, len(entries))
        # unbuffered: tensor writes are large, and copy_range appends through the same descriptor
        if span is None:
            self._f = new_file(path, "wb", buffering=0)  # a new file, never written through a link
            self._f.write(struct.pack("<Q", len(raw)) + raw)
        else:
            self._f = open(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)), "wb", buffering=0)
            self._f.seek(self.data_start + (self._offsets[self._next] if self._next < len(entries) else offset))
        self._buffer = bytearray()  # small tensors' bytes not yet written
        self._pending = 0
        self._copy_run: tuple[SafetensorsFile, int, int] | None = None  # (file, offset, length) not yet copied
        self.total = offset
        self._unsynced = 0
        self._syncing: threading.Thread | None = None
        self._sync_error: OSError | None = None

    @classmethod
    def create_for_parts(
        cls, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None
    ) -> None:
        """A new file of `entries`, its header written and its data (zeros) to be written by writers of
        its spans."""
        w = cls(path, entries, metadata, span=None)
        os.ftruncate(w._f.fileno(), w.data_start + w.total)
        w._close()

    def write(self, name: str, data: torch.Tensor | memoryview | bytes) -> None:
        buf = tensor_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data)
        self._claim(name, buf.nbytes)
        self._flush_copy()
        if buf.nbytes < WRITE_BUFFER_BYTES:
            self._buffer += buf
            if len(self._buffer) >= WRITE_BUFFER_BYTES:
                self._flush_buffer()
            return
        self._flush_buffer()
        self._f.write(buf)
        self._wrote(buf.nbytes)

    def _flush_buffer(self) -> None:
        if self._buffer:
            self._f.write(self._buffer)
            self._wrote(len(self._buffer))
            self._buffer = bytearray()

    def _wrote(self, nbytes: int) -> None:
        self._unsynced += nbytes
        if self._unsynced >= SYNC_BEHIND_BYTES and not (self._syncing and self._syncing.is_alive()):
            self._unsynced = 0
            self._syncing = threading.Thread(target=self._sync, name="eprt-sync", daemon=True)
            self._syncing.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self._f.fileno())
        except OSError as e:  # raised by close(), on the writing thread
            self._sync_error = e

    def _claim(self, name: str, nbytes: int) -> None:
        """Check that `nbytes` more of tensor `name` come next in the declared order."""
        if self._pending == 0:
            if self._next >= self._end or self._sizes[self._next][0] != name:
                raise RuntimeError(f"{self.path}: wrote {name!r} out of the declared order")
            self._pending = self._sizes[self._next][1]
            self._next += 1
        elif self._sizes[self._next - 1][0] != name:
            raise RuntimeError(f"{self.path}: {self._sizes[self._next - 1][0]!r} is incomplete")
        if nbytes > self._pending:
            raise RuntimeError(f"{self.path}: {name!r} got more bytes than its shape holds")
        self._pending -= nbytes

    def copy_range(self, name: str, src: SafetensorsFile, offset: int, nbytes: int) -> None:
        """Write `nbytes` of `src` from `offset` as (part of) tensor `name`, copied inside the kernel.

        No byte passes through this process, and ranges that continue each other in the same
        source file (an expert's gate and up, stored side by side) go in one call: a conversion
        that keeps dtypes runs at about the speed of a file copy.
        """
        self._claim(name, nbytes)
        run = self._copy_run
        if run is not None and run[0] is src and run[1] + run[2] == offset:
            self._copy_run = (src, run[1], run[2] + nbytes)
        else:
            self._flush_copy()
            self._copy_run = (src, offset, nbytes)

    def _flush_copy(self) -> None:
        if self._copy_run is None:
            return
        self._flush_buffer()  # the bytes before the copied ones
        src, offset, nbytes = self._copy_run
        self._copy_run = None
        out = self._f.fileno()
        done = 0
        while done < nbytes:
            n = os.sendfile(out, src._fd, offset + done, nbytes - done)
            if n == 0:
                raise CheckpointError(f"{src.path}: unexpected end of file at byte {offset + done}")
            done += n
        src.count_read(nbytes)
        self._wrote(nbytes)

    def close(self) -> None:
        if self._pending or self._next != self._end:
            self._close()
            raise RuntimeError(f"{self.path}: closed before every declared tensor was written")
        self._flush_copy()
        self._flush_buffer()
        self._close()
        if self._sync_error is not None:  # a refused write, named like one (eprt.cli)
            raise OSError(self._sync_error.errno, self._sync_error.strerror, self.path)

    def _close(self) -> None:
        if self._syncing is not None:
            self._syncing.join()
        self._f.close()


def save_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    w = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
