"""Megatron-LM indexed datasets (`PREFIX.bin` + `PREFIX.idx`, what its tools/preprocess_data.py writes), read in place.

The format, as megatron/core/datasets/indexed_dataset.py writes it (_IndexWriter) and reads it (_IndexReader):

  PREFIX.idx  b"MMIDIDX\\x00\\x00"       the magic, 9 bytes
              version                 uint64, 1
              dtype code              uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
              sequence count S        uint64
              document_indices count  uint64: the number of documents + 1
              sequence_lengths        int32[S]: tokens per sequence
              sequence_pointers       int64[S]: byte offset of each sequence in PREFIX.bin
              document_indices        int64[D + 1]: the index of each document's first sequence; 0 first, S last
              (sequence_modes         int8[S]: multimodal datasets only)
  PREFIX.bin  every sequence's tokens end to end, in the dtype of the index (little-endian: numpy's native order on
              the machines that write them)

A document is one or more consecutive sequences: preprocess_data.py --split-sentences writes each sentence as a
sequence, and Megatron's own GPTDataset then treats every sentence as a document. moejax takes the boundaries of
the document index, so a packed row's per-document attention never cuts a document at a sentence. An empty
document (no sequences, or sequences of no tokens) holds no tokens and is dropped, as `moejax-data tokenize`
drops empty texts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moejax.data.shards import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document_indices count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}  # Megatron's DType enum
SCAN_TOKENS = 1 << 24  # tokens per block of the id scan: bounded memory whatever the .bin's size


def is_megatron_prefix(path: str) -> bool:
    """Whether `path` names a Megatron dataset (either of its files exists; the other is checked when opened)."""
    return Path(f"{path}.idx").is_file() or Path(f"{path}.bin").is_file()


@dataclass(frozen=True)
class MegatronIndex:
    """What PREFIX.idx says, checked against itself and PREFIX.bin's size."""

    prefix: str
    dtype: np.dtype  # of the tokens, little-endian
    n_tokens: int
    doc_starts: np.ndarray  # int64 token offset of each non-empty document, ascending, [0] == 0
    sha256: str  # of the whole .idx: lengths and document boundaries, no mtime

    @property
    def bin_path(self) -> Path:
        return Path(f"{self.prefix}.bin")


def read_megatron_index(prefix: str) -> MegatronIndex:
    """Reads and checks PREFIX.idx (magic, version, dtype, its size against its counts, sequences laid end to end,
    documents covering every sequence) and PREFIX.bin's size; reads nothing of the .bin. Raises DataError."""
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise DataError(f"Megatron dataset {prefix}: {path} is missing (a prefix names PREFIX.bin and PREFIX.idx)")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_path.stat().st_size else np.zeros(0, np.uint8)
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{idx_path} is truncated: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    if bytes(raw[: len(MAGIC)]) != MAGIC:
        raise DataError(f"{idx_path} is not a Megatron index: it starts with {bytes(raw[: len(MAGIC)])!r}, "
                        f"not {MAGIC!r}")
    version, code, n_seq, n_doc_indices = _header(raw)
    if version != VERSION:
        raise DataError(f"{idx_path}: index version {version}; moejax reads Megatron's version {VERSION}")
    if code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
        what = f"{np.dtype(DTYPES[code]).name} tokens" if code in DTYPES else f"an unknown dtype code {code}"
        raise DataError(f"{idx_path} declares {what}; token ids are integers")
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc_indices
    if n_doc_indices < 1 or len(raw) != expected:
        modes = " (a multimodal dataset's sequence modes follow: moejax reads text datasets)" \
            if n_doc_indices >= 1 and len(raw) == expected + n_seq else ""
        raise DataError(f"{idx_path} is truncated or padded: {len(raw)} bytes, its header's counts say "
                        f"{expected}{modes}")
    at = HEADER_BYTES
    lengths = raw[at : at + 4 * n_seq].view("<i4")
    pointers = raw[at + 4 * n_seq : at + 12 * n_seq].view("<i8")
    doc_indices = raw[at + 12 * n_seq : expected].view("<i8")
    # Every sequence starts where the one before it ends (the builder's pointers are the running sum), so the .bin
    # is one token stream and a document is the stretch between its first sequence's start and the next's.
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    if np.any(lengths < 0) or not np.array_equal(pointers, offsets[:-1] * dtype.itemsize):
        raise DataError(f"{idx_path} is corrupt: its sequence pointers do not follow its sequence lengths")
    if doc_indices[0] != 0 or doc_indices[-1] != n_seq or np.any(np.diff(doc_indices) < 0):
        raise DataError(f"{idx_path} is corrupt: its document indices do not run from 0 to its {n_seq} sequences")
    n_tokens = int(offsets[-1])
    if bin_path.stat().st_size != n_tokens * dtype.itemsize:
        raise DataError(f"{bin_path} is truncated or padded: {bin_path.stat().st_size} bytes, {idx_path} says "
                        f"{n_tokens * dtype.itemsize} ({n_tokens} {dtype.name} tokens)")
    bounds = offsets[doc_indices]
    doc_starts = bounds[:-1][np.diff(bounds) > 0]
    return MegatronIndex(str(prefix), dtype, n_tokens, doc_starts.astype(np.int64), _sha256(idx_path))


def _header(raw: np.ndarray) -> tuple[int, int, int, int]:
    """(version, dtype code, sequence count, document_indices count): the little-endian fields after the magic."""
    at = len(MAGIC)
    version = int(raw[at : at + 8].view("<u8")[0])
    code = int(raw[at + 8])
    n_seq, n_doc_indices = (int(x) for x in raw[at + 9 : at + 25].view("<u8"))
    return version, code, n_seq, n_doc_indices


def _sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def open_megatron_tokens(index: MegatronIndex) -> np.ndarray:
    """PREFIX.bin memory-mapped: pages are read as windows touch them, never the whole file at once."""
    if not index.n_tokens:
        return np.zeros(0, index.dtype)
    return np.memmap(index.bin_path, dtype=index.dtype, mode="r")


def largest_token_id(tokens: np.ndarray, where: str) -> int:
    """The largest id in `tokens`, scanned in blocks (one pass over the file, like a token directory's CRC32 pass:
    Megatron's index records no largest id). Raises DataError for a negative id (signed dtypes)."""
    top = -1
    for start in range(0, len(tokens), SCAN_TOKENS):
        block = np.asarray(tokens[start : start + SCAN_TOKENS])
        if block.dtype.kind == "i" and int(block.min()) < 0:
            raise DataError(f"{where} holds a negative token id ({int(block.min())})")
        top = max(top, int(block.max()))
    return top
