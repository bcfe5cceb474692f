"""Sequence packing: fixed-length rows cut from a stream of documents, with the document boundaries kept.

Documents are laid end to end (`[BOS] doc EOS [BOS] doc EOS ...`) and cut into windows of `seq_len + 1`
tokens (inputs and next-token targets) starting every `seq_len` tokens, so nothing is padded and a long
document spans several rows. Each window carries `segment_ids`: 0 for the document fragment it starts in,
then +1 at every document start inside it. The model restarts positions at each segment and attends only
within it, and the loss ignores a target whose segment differs from its input's (the first token of the
next document is not predicted from the previous one).

Windows never cross a shard (documents never do), and window i is a pure function of i: random access,
which is what makes a resumed run read exactly the rows it would have read.
"""

from __future__ import annotations

import numpy as np

from moejax.data.shards import DataError, TokenShard


class PackedWindows:
    """Random-access source: window i -> {"tokens": int32[seq_len + 1], "segment_ids": int32[seq_len + 1]}."""

    def __init__(self, shards: list[TokenShard], seq_len: int, *, name: str = "data"):
        self.shards = [s for s in shards if len(s.tokens) > seq_len]
        self.seq_len = seq_len
        counts = np.array([(len(s.tokens) - 1) // seq_len for s in self.shards], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)])  # first window index of each shard
        if self._first[-1] == 0:
            longest = max((len(s.tokens) for s in shards), default=0)
            raise DataError(f"{name}: no shard holds one window of train.seq_len + 1 = {seq_len + 1} tokens "
                            f"(the largest has {longest})")

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        k = int(np.searchsorted(self._first, i, side="right")) - 1
        shard = self.shards[k]
        start = (i - int(self._first[k])) * self.seq_len
        tokens = np.asarray(shard.tokens[start : start + self.seq_len + 1], dtype=np.int32)
        positions = np.arange(start, start + self.seq_len + 1)
        doc_index = np.searchsorted(shard.doc_starts, positions, side="right")
        return {"tokens": tokens, "segment_ids": (doc_index - doc_index[0]).astype(np.int32)}


def bos_doc_starts(tokens: np.ndarray, bos_id: int) -> np.ndarray:
    """Document starts of a stream where every document begins with BOS (the embedded corpus)."""
    starts = np.flatnonzero(tokens == bos_id).astype(np.int64)
    if not len(starts) or starts[0] != 0:
        starts = np.concatenate([[0], starts]).astype(np.int64)
    return starts
