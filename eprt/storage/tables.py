"""Rows of one column of a table on disk: a Parquet file, or a dataset saved with the `datasets`
library's `save_to_disk` (a directory of Arrow files). Both are optional extras (`pip install
"eprt[data]"`: pyarrow, datasets), imported only when such data is given.

Rows are read a batch at a time, as far as they are asked for: calibration takes the first
tokens of a table, never the whole of a large one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

from eprt.errors import ConfigError
from eprt.storage.paths import within

BATCH_ROWS = 256
MAX_BATCH_BYTES = 64 << 20  # the decoded bytes of one batch of rows, as the file's metadata declares them
MAX_CELL_BYTES = 16 << 20  # one decoded cell (a document, or a conversation's JSON)
# the files save_to_disk writes: one split (state.json) or several (dataset_dict.json)
DATASET_FILES = ("state.json", "dataset_dict.json")


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in DATASET_FILES)


def _need(module: str, what: str) -> Any:
    """The optional library `module`, or a refusal naming `what` needs it and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f'{what} needs the {module.split(".")[0]} library: pip install "eprt[data]"') from None


def _check_column(path: str, columns: list[str], column: str) -> None:
    if column not in columns:
        raise ConfigError(
            f"{path}: no column {column!r}; its columns are {', '.join(columns) or 'none'}: name one "
            "with --calib-column"
        )


def parquet_rows(path: str, choose_column) -> Iterator[Any]:
    """The values of the column `choose_column(columns)` names, row by row, of Parquet file `path`."""
    pq = _need("pyarrow.parquet", f"{path}: reading Parquet")
    import pyarrow as pa

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(
            f"{path}: not a Parquet file ({str(e)[:200]}); give a .parquet file, or name the data by "
            "what it is (.txt, .jsonl)"
        ) from None
    columns = list(table.schema_arrow.names)
    column = choose_column(columns)
    _check_column(path, columns, column)
    try:
        # a dictionary-encoded column stays encoded: one 16 MiB value that every row names would
        # otherwise be copied into each row of a batch before a cell could be measured
        kind = table.schema_arrow.field(column).type
        textual = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
        table = pq.ParquetFile(path, read_dictionary=[column] if textual else None)
        for batch in table.iter_batches(batch_size=batch_rows(table, columns.index(column)), columns=[column]):
            yield from bounded_cells(batch.column(0), path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: a damaged Parquet file ({str(e)[:200]}); write it again") from None


def batch_rows(table, column: int) -> int:
    """Rows per batch, so that a batch of the row group whose rows are largest (by the sizes its
    metadata declares, before anything is decoded) holds about MAX_BATCH_BYTES."""
    meta = table.metadata
    widest = (
        max(
            (meta.row_group(g).column(column).total_uncompressed_size / max(meta.row_group(g).num_rows, 1))
            for g in range(meta.num_row_groups)
        )
        if meta.num_row_groups
        else 1
    )
    return int(max(1, min(BATCH_ROWS, MAX_BATCH_BYTES // max(widest, 1))))


def bounded_cells(values, path: str) -> Iterator[Any]:
    """The values of one batch's column, each string or bytes cell refused by name where it is
    longer than MAX_CELL_BYTES, measured before it becomes a Python value."""
    import pyarrow as pa
    import pyarrow.compute as pc

    plain = values.dictionary if pa.types.is_dictionary(values.type) else values
    if pa.types.is_string(plain.type) or pa.types.is_large_string(plain.type) or pa.types.is_binary(plain.type):
        longest = pc.max(pc.binary_length(plain)).as_py()
        if longest is not None and longest > MAX_CELL_BYTES:
            raise ConfigError(
                f"{path}: a cell of {longest} bytes, more than {MAX_CELL_BYTES}; calibration reads a few "
                "thousand tokens of a row: cut the long rows, or give the text as a .txt file"
            )
    for i in range(len(values)):  # one cell at a time: a dictionary's value is copied per row it is read
        yield values[i].as_py()


def dataset_rows(path: str, choose_column) -> Iterator[Any]:
    """The same of a dataset saved with `save_to_disk`: its one split, or its `train` split."""
    datasets = _need("datasets", f"{path}: reading a saved dataset")
    check_dataset_files(path)
    try:
        data = datasets.load_from_disk(path)
    except Exception as e:  # the library raises many types for a directory it cannot read
        raise ConfigError(
            f"{path}: not a dataset the datasets library reads ({type(e).__name__}: {str(e)[:200]}); "
            "save it again with save_to_disk"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        splits = list(data)
        if len(splits) != 1 and "train" not in splits:
            raise ConfigError(
                f"{path}: holds the splits {', '.join(splits)}; save the one to calibrate on alone, or name it train"
            )
        data = data[splits[0] if len(splits) == 1 else "train"]
    columns = list(data.column_names)
    column = choose_column(columns)
    _check_column(path, columns, column)
    for batch in data.select_columns([column]).with_format("arrow").iter(batch_size=BATCH_ROWS):
        for chunk in batch.column(0).chunks:
            yield from bounded_cells(chunk, path)


def check_dataset_files(path: str) -> None:
    """Refuse a saved dataset holding anything but regular files and directories inside it, links
    followed: a FIFO would block the library's read forever, a link could read any file."""
    root = os.path.realpath(path)
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = os.path.join(d, name)
            real = os.path.realpath(entry)
            if not within(real, root):
                raise ConfigError(f"{entry}: links to {real}, outside the dataset {path}; copy the file itself there")
            if not (os.path.isfile(real) or os.path.isdir(real)):
                raise ConfigError(
                    f"{entry}: not a regular file (a pipe, device or socket); save the dataset again with save_to_disk"
                )
