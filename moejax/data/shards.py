"""Sharded token files: what `moejax-data tokenize` writes and the training run reads.

A token directory holds `index.json` and, per split (`train`, `eval`) and shard, two files:
`<split>-<n>.bin`, the token ids as little-endian uint16 (or uint32 when the vocabulary needs it), and
`<split>-<n>.docs`, the start offset of each document in that shard (little-endian uint64). Documents never
cross shards. The index records, per shard, the token and document counts, the largest id and a CRC32 of
each file, so truncated or corrupted files are found before anything compiles.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moejax.errors import InputError

FORMAT = "moejax-tokens/1"
SPLITS = ("train", "eval")


class DataError(InputError, ValueError):
    """Input data the run cannot use; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class TokenShard:
    """One shard: a token stream (memory-mapped from disk, or in memory) and its documents' start offsets."""

    tokens: np.ndarray  # [n_tokens] unsigned ints
    doc_starts: np.ndarray  # [n_docs] int64, ascending, doc_starts[0] == 0


def crc32_file(path: Path, chunk: int = 1 << 24) -> int:
    """The file's zlib CRC32, read in 16 MiB blocks (token files; checkpoints' integrity manifests)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class ShardWriter:
    """Appends documents to `<split>-<n>.bin/.docs` in a directory, starting a new shard past shard_tokens."""

    def __init__(self, directory: Path, split: str, dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = Path(directory), split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._open_new()

    def _open_new(self):
        n = len(self.shards)
        self._name = f"{self.split}-{n:05d}"
        self._bin = open(self.directory / f"{self._name}.bin", "wb")
        self._docs: list[int] = []
        self._n_tokens = 0
        self._max_id = -1

    def add(self, ids: np.ndarray):
        if self._n_tokens >= self.shard_tokens:
            self._close_current()
            self._open_new()
        self._docs.append(self._n_tokens)
        self._bin.write(ids.astype(self.dtype.newbyteorder("<")).tobytes())
        self._n_tokens += len(ids)
        self._max_id = max(self._max_id, int(ids.max()))

    def _close_current(self):
        self._bin.close()
        docs_path = self.directory / f"{self._name}.docs"
        np.asarray(self._docs, dtype="<u8").tofile(docs_path)
        bin_path = self.directory / f"{self._name}.bin"
        self.shards.append({"tokens": bin_path.name, "docs": docs_path.name, "n_tokens": self._n_tokens,
                            "n_docs": len(self._docs), "max_id": self._max_id,
                            "crc32_tokens": crc32_file(bin_path), "crc32_docs": crc32_file(docs_path)})

    def close(self) -> list[dict]:
        if self._n_tokens:
            self._close_current()
        else:  # nothing was added since the last shard closed
            self._bin.close()
            (self.directory / f"{self._name}.bin").unlink()
        return self.shards


def write_token_dir(output: Path, documents_by_split: dict, tokenizer, *, shard_tokens: int,
                    sources: list[str]) -> dict:
    """Writes every split's documents (iterables of id arrays) into `output`, atomically (write_token_dir_stream)."""
    pairs = ((split, ids) for split, documents in documents_by_split.items() for ids in documents)
    return write_token_dir_stream(output, pairs, tuple(documents_by_split), tokenizer, shard_tokens=shard_tokens,
                                  sources=sources)


def write_token_dir_stream(output: Path, split_and_ids, splits: tuple[str, ...], tokenizer, *, shard_tokens: int,
                           sources: list[str], required: tuple[str, str] | None = None) -> dict:
    """Writes (split, id array) pairs, in one pass, into `output`'s splits, atomically: into a temporary sibling
    first, renamed only when complete, so an interrupted run (an error, Ctrl-C, a kill) leaves no half-written
    directory. `required`: (a split that must receive a document, the DataError's message when none did; nothing is
    left then either)."""
    output = Path(output)
    if output.exists():
        raise DataError(f"output {output} already exists; choose a new directory (nothing was changed)")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        writers = {split: ShardWriter(tmp, split, dtype, shard_tokens) for split in splits}
        for split, ids in split_and_ids:
            writers[split].add(ids)
        written = {split: writer.close() for split, writer in writers.items()}
        if required is not None and not written[required[0]]:
            raise DataError(required[1])
        index = {"format": FORMAT, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                 "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "dtype": np.dtype(dtype).name,
                 "sources": sources, "splits": written}
        (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


@dataclass(frozen=True)
class TokenDir:
    """An opened token directory: its index and the shards of each split, checked against the index."""

    path: Path
    index: dict
    splits: dict  # split -> list[TokenShard]

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    def max_id(self, split: str) -> int:
        return max((s["max_id"] for s in self.index["splits"].get(split, [])), default=-1)


def read_index(path: Path) -> dict:
    path = Path(path)
    index_path = path / "index.json"
    if not path.is_dir():
        raise DataError(f"data source {path} does not exist (write one with `moejax-data tokenize`)")
    if not index_path.is_file():
        raise DataError(f"data source {path} has no index.json (write one with `moejax-data tokenize`)")
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{index_path} is not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{index_path} is not a {FORMAT} index")
    return index


def open_token_dir(path: Path, *, verify_checksums: bool = True) -> TokenDir:
    """Opens and checks every shard: files present, sizes match the index (truncation), CRC32 matches
    (corruption, when verify_checksums), document offsets ascending and inside the shard."""
    path = Path(path)
    index = read_index(path)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    splits = {}
    for split, shards in index["splits"].items():
        opened = []
        for s in shards:
            bin_path, docs_path = path / s["tokens"], path / s["docs"]
            for f in (bin_path, docs_path):
                if not f.is_file():
                    raise DataError(f"token file {f} is missing (listed in {path / 'index.json'})")
            expected = s["n_tokens"] * dtype.itemsize
            if bin_path.stat().st_size != expected:
                raise DataError(f"token file {bin_path} is truncated or padded: {bin_path.stat().st_size} bytes, "
                                f"the index says {expected}")
            if docs_path.stat().st_size != 8 * s["n_docs"]:
                raise DataError(f"document index {docs_path} is truncated or padded: {docs_path.stat().st_size} "
                                f"bytes, the index says {8 * s['n_docs']}")
            if verify_checksums:
                for f, key in ((bin_path, "crc32_tokens"), (docs_path, "crc32_docs")):
                    if crc32_file(f) != s[key]:
                        raise DataError(f"token file {f} is corrupt: its CRC32 does not match {path / 'index.json'}")
            tokens = np.memmap(bin_path, dtype=dtype, mode="r") if s["n_tokens"] else np.zeros(0, dtype)
            doc_starts = np.fromfile(docs_path, dtype="<u8").astype(np.int64)
            if len(doc_starts) and (doc_starts[0] != 0 or np.any(np.diff(doc_starts) <= 0)
                                    or doc_starts[-1] >= s["n_tokens"]):
                raise DataError(f"document index {docs_path} is corrupt: offsets are not ascending within the shard")
            opened.append(TokenShard(tokens, doc_starts))
        splits[split] = opened
    return TokenDir(path, index, splits)
