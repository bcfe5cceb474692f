"""A held-out split of one token stream by document: every nth document to eval, the rest to train, no copy.

A dataset that arrives as one stream with a document index (a Megatron `.bin`) has no eval split of its own.
Holding out every nth document (the rule `moejax-data tokenize --eval_every_nth_doc` applies: document i when
i % n == n - 1) spreads the eval documents over the whole corpus, where a tail would hold only its last source.
Each split is read as one stream (`DocumentRuns`): its documents end to end, gathered from the memory-mapped
stream at read time, so the split costs the document offsets and nothing of the tokens, and packing sees exactly
what a token directory holding the same documents in the same order would give it.
"""

from __future__ import annotations

import numpy as np

from moejax.data.shards import TokenShard


class DocumentRuns:
    """Chosen documents of `tokens`, read as one stream: `runs[a:b]` is an array of that stream's tokens a..b.

    Consecutive chosen documents are merged into runs (one contiguous stretch of `tokens` each), so a slice
    touches one run unless it crosses a gap: a view of the memory map then, a copy of the pieces otherwise."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self._tokens = tokens
        self.dtype = tokens.dtype
        lengths = ends - starts
        stream_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._len = int(stream_starts[-1])
        self.doc_starts = stream_starts[:-1]  # each document's offset in this stream
        new_run = np.ones(len(starts), bool)
        new_run[1:] = starts[1:] != ends[:-1]
        self._run_at = self.doc_starts[new_run]  # offset of each run in this stream...
        self._run_from = starts[new_run].astype(np.int64)  # ...and in `tokens`
        self._run_end = np.concatenate([self._run_at[1:], [self._len]]).astype(np.int64)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("DocumentRuns reads contiguous slices only")
        a, b, _ = key.indices(self._len)
        pieces = []
        k = int(np.searchsorted(self._run_at, a, side="right")) - 1
        while a < b:
            stop = min(b, int(self._run_end[k]))
            shift = int(self._run_from[k] - self._run_at[k])
            pieces.append(self._tokens[a + shift : stop + shift])
            a, k = stop, k + 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)


def split_every_nth_document(tokens: np.ndarray, doc_starts: np.ndarray,
                             n: int) -> tuple[TokenShard, TokenShard | None]:
    """(train, eval) shards of a stream whose documents start at doc_starts (ascending, [0] == 0, none empty):
    document i is held out when i % n == n - 1; n == 0 holds out nothing (eval None)."""
    if n == 0:
        return TokenShard(tokens, doc_starts), None
    ends = np.concatenate([doc_starts[1:], [len(tokens)]]).astype(np.int64)
    held_out = np.arange(len(doc_starts)) % n == n - 1
    shards = []
    for chosen in (~held_out, held_out):
        runs = DocumentRuns(tokens, doc_starts[chosen], ends[chosen])
        shards.append(TokenShard(runs, runs.doc_starts))
    return shards[0], shards[1]
