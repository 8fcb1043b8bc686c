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

BATCH_ROWS = 256
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
        for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
            yield from batch.column(0).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: a damaged Parquet file ({str(e)[:200]}); write it again") from None


def dataset_rows(path: str, choose_column) -> Iterator[Any]:
    """The same of a dataset saved with `save_to_disk`: its one split, or its `train` split."""
    datasets = _need("datasets", f"{path}: reading a saved dataset")
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
    for batch in data.select_columns([column]).iter(batch_size=BATCH_ROWS):
        yield from batch[column]
