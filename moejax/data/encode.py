"""Documents to token ids for `moejax-data tokenize`, in one process or in N worker processes, with the same ids in
the same order either way (so the token directory is byte for byte the same).

Text is encoded as a training document: [BOS] ids EOS (Tokenizer.encode_document); documents that arrive as ids (an
`input_ids` column) are taken as they are. With workers, the main process reads the input and writes the output while
the workers encode chunks of documents; at most 2 x workers chunks are in flight, so memory stays bounded however
large the corpus, and results are taken in submission order.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from typing import Iterable, Iterator

import numpy as np

from moejax.data.shards import DataError
from moejax.data.tokenizer import Tokenizer, load_tokenizer

_CHUNK_BYTES = 1 << 20  # text per task: large enough that a task's pickling is small beside its encoding
_CHUNK_DOCS = 4096

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str, bos: str | None, eos: str | None) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tokenizer = load_tokenizer(spec, bos, eos)


def _encode_chunk(chunk: list) -> list[np.ndarray]:
    return [_encode(_worker_tokenizer, doc) for doc in chunk]


def _encode(tokenizer: Tokenizer, doc) -> np.ndarray:
    return tokenizer.encode_document(doc) if isinstance(doc, str) else np.asarray(doc, dtype=np.int64)


def _size(doc) -> int:
    return len(doc.encode("utf-8")) if isinstance(doc, str) else 4 * len(doc)


def _chunks(docs: Iterable) -> Iterator[tuple[list, int]]:
    """(documents, their input bytes) in order, about _CHUNK_BYTES of input each."""
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += _size(doc)
        if size >= _CHUNK_BYTES or len(chunk) >= _CHUNK_DOCS:
            yield chunk, size
            chunk, size = [], 0
    if chunk:
        yield chunk, size


def encode_documents(docs: Iterable, tokenizer: Tokenizer, spec: tuple[str, str | None, str | None], *,
                     workers: int = 1, progress=None) -> Iterator[np.ndarray]:
    """Each document's ids, in input order. spec: (tokenizer spec, bos, eos) that load_tokenizer builds `tokenizer`
    from, for the workers; progress: an object with add(documents, tokens, input_bytes), or None. Ids at or beyond
    the tokenizer's vocabulary raise DataError."""

    def checked(ids_list, n_bytes):
        for ids in ids_list:
            if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
                raise DataError(f"a document holds token id {int(ids.max())}, beyond the tokenizer's vocabulary of "
                                f"{tokenizer.vocab_size}; name the tokenizer the ids were made with (--tokenizer)")
        if progress is not None:
            progress.add(len(ids_list), sum(len(ids) for ids in ids_list), n_bytes)
        return ids_list

    if workers <= 1:
        for chunk, n_bytes in _chunks(docs):
            yield from checked([_encode(tokenizer, doc) for doc in chunk], n_bytes)
        return
    # spawn: the same start on every platform, and no copy of a parent's tokenizer threads (fork after the Rust
    # tokenizer has run can deadlock).
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=spec) as pool:
        pending = collections.deque()
        for chunk, n_bytes in _chunks(docs):
            pending.append((pool.apply_async(_encode_chunk, (chunk,)), n_bytes))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield from checked(result.get(), size)
        while pending:
            result, size = pending.popleft()
            yield from checked(result.get(), size)
