"""The documents `moejax-data tokenize` reads, in input order, from the formats people bring:

  text file            any file not named below: one UTF-8 document
  .jsonl               one document per line: the string field `text_key`
  .parquet             one document per row: the string column `text_key`, or an already tokenized `input_ids`
                       column (a list of ints per row), which is taken as is
  save_to_disk dir     a Hugging Face `datasets` directory (`state.json` + `*.arrow` files, or a DatasetDict's
                       `dataset_dict.json` + one such directory per split, read in its listed order): as parquet

A document is text (str) or token ids (np.ndarray). Parquet and arrow are read with pyarrow in record batches (never a
whole file at once); pyarrow is the optional `data` extra: only these formats need it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from moejax.data.shards import DataError

IDS_COLUMN = "input_ids"  # the column an already tokenized dataset holds its ids in (transformers' name)


def is_hf_dataset_dir(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def input_files(inputs: list[str]) -> list[Path]:
    """Files and dataset directories in input order, a directory's in path order; a `datasets` directory
    (save_to_disk) is one input, wherever it is."""
    found = []
    for item in map(Path, inputs):
        if item.is_dir():
            found += [item] if is_hf_dataset_dir(item) else _walk(item)
        elif item.is_file():
            found.append(item)
        else:
            raise DataError(f"input {item} does not exist")
    if not found:
        raise DataError(f"no input files under {', '.join(inputs)}")
    return found


def _walk(directory: Path) -> list[Path]:
    """Files under `directory` in path order (the order of sorted(rglob): parts compared one by one), a `datasets`
    directory below it as one entry."""
    out = []
    for child in sorted(directory.iterdir()):
        if child.is_dir():
            out += [child] if is_hf_dataset_dir(child) else _walk(child)
        elif child.is_file():
            out.append(child)
    return out


def documents(paths: list[Path], text_key: str) -> Iterator[str | np.ndarray]:
    """Every document of every input, in order."""
    for path in paths:
        if path.is_dir():
            yield from _dataset_dir(path, text_key)
        elif path.suffix == ".parquet":
            yield from _parquet(path, text_key)
        elif path.suffix == ".jsonl":
            yield from _jsonl(path, text_key)
        else:
            text = _utf8(path)
            if text:
                yield text


def _utf8(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _jsonl(path: Path, key: str) -> Iterator[str]:
    for line_no, line in enumerate(_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        value = record.get(key) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise DataError(f"{path}:{line_no}: no string field {key!r}")
        if value:
            yield value


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading parquet or arrow needs pyarrow: pip install 'moejax[data]'") from None
    return pyarrow


def _column(names: list[str], key: str, where) -> str:
    """The column to read: `input_ids` where there is one (already tokenized: taken as is), else the text column."""
    if IDS_COLUMN in names:
        return IDS_COLUMN
    if key in names:
        return key
    raise DataError(f"{where}: no column {key!r} (nor {IDS_COLUMN!r}); its columns: {', '.join(names)}; "
                    f"name the text column with --text_key")


def _rows(batches, column: str, where) -> Iterator[str | np.ndarray]:
    for batch in batches:
        values = batch.column(column)
        if column == IDS_COLUMN:
            for row in values.to_pylist():
                if row is None or not all(isinstance(t, int) and t >= 0 for t in row):
                    raise DataError(f"{where}: {IDS_COLUMN} rows must be lists of non-negative ints")
                if row:
                    yield np.asarray(row, dtype=np.int64)
        else:
            for text in values.to_pylist():
                if text is None or not isinstance(text, str):
                    raise DataError(f"{where}: column {column!r} holds a non-string value")
                if text:
                    yield text


def _parquet(path: Path, key: str) -> Iterator[str | np.ndarray]:
    pa = _pyarrow()
    try:
        file = pa.parquet.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a parquet file ({str(e).splitlines()[0]})") from None
    column = _column(file.schema_arrow.names, key, path)
    yield from _rows(file.iter_batches(batch_size=1024, columns=[column]), column, path)


def _dataset_dir(path: Path, key: str) -> Iterator[str | np.ndarray]:
    if (path / "dataset_dict.json").is_file():  # a DatasetDict: each split's directory in the listed order
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        for split in splits:
            yield from _dataset_dir(path / split, key)
        return
    pa = _pyarrow()
    state = json.loads((path / "state.json").read_text())
    for entry in state.get("_data_files", []):
        arrow = path / entry["filename"]
        if not arrow.is_file():
            raise DataError(f"{path}: state.json lists {entry['filename']}, which is missing")
        with pa.memory_map(str(arrow)) as source:
            try:
                reader = pa.ipc.open_stream(source)  # datasets writes the arrow streaming format
            except pa.ArrowInvalid as e:
                raise DataError(f"{arrow}: not an arrow stream ({str(e).splitlines()[0]})") from None
            column = _column(reader.schema.names, key, arrow)
            yield from _rows(reader, column, arrow)
