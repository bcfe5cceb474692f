"""grain pipelines over a token stream: fixed-length windows, shuffled by seed, sliced per process.

Windows are `seq_len + 1` tokens (inputs and next-token targets) starting every `seq_len` tokens. The
pipeline is a random-access MapDataset, so batch i is a pure function of (seed, i): resuming at step s
just starts reading at batch s, and no iterator state is needed.
"""

from __future__ import annotations

import math

import grain
import numpy as np


class TokenWindows:
    """Random-access source: window i is tokens[i*seq_len : i*seq_len + seq_len + 1]."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"token stream of {len(tokens)} is shorter than one window of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int32)


class ProcessSlice:
    """Process p's rows of global batch i: windows [i*G + p*L, i*G + (p+1)*L) of the shuffled order.

    Contiguous slices (not every p-th window) make the global batch the same whatever the process count,
    so a 2-process run trains on exactly what the 1-process run trains on; and they line up with
    `jax.make_array_from_process_local_data`, where process p's devices hold batch rows p*L..(p+1)*L.
    """

    def __init__(self, windows, global_batch: int, process_index: int, process_count: int):
        self.windows = windows
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.offset = process_index * self.local_batch

    def __len__(self) -> int:
        return len(self.windows) // self.global_batch

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.global_batch + self.offset
        return np.stack([self.windows[start + j] for j in range(self.local_batch)])


def train_batches(tokens, *, seq_len: int, global_batch: int, steps: int, seed: int,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Batch i ([global_batch // process_count, seq_len + 1] int32) is what this process trains on at step i."""
    windows = grain.MapDataset.source(TokenWindows(tokens, seq_len))
    epochs = max(1, math.ceil(steps * global_batch / len(windows)))
    shuffled = windows.shuffle(seed=seed).repeat(epochs)
    return grain.MapDataset.source(ProcessSlice(shuffled, global_batch, process_index, process_count))


def eval_batches(tokens, *, seq_len: int, global_batch: int, n_batches: int,
                 process_index: int = 0, process_count: int = 1) -> list[np.ndarray]:
    """The same first n held-out batches every time (no shuffle), so eval losses compare across steps."""
    batches = ProcessSlice(TokenWindows(tokens, seq_len), global_batch, process_index, process_count)
    return [batches[i] for i in range(min(n_batches, len(batches)))]


def prefetching_iterator(batches: grain.MapDataset, start: int):
    """Threaded read-ahead from batch `start` on."""
    return iter(batches[start:].to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)))
