"""grain pipelines: packed windows of each source, shuffled by seed, mixed by weight, sliced per process.

Batch i of a run is a pure function of (seed, i): every source's windows are shuffled by a seed derived
from (seed, source), repeated for as many epochs as the run needs (each epoch reshuffled), and interleaved
in proportion to the weights by grain's deterministic `MapDataset.mix`. The iterator's state is just the
next batch index; it is saved in every checkpoint and a resumed run continues from it, so no row is read
twice or skipped across a resume.
"""

from __future__ import annotations

import math

import grain
import numpy as np

from moejax.data.packing import PackedWindows
from moejax.data.shards import DataError


def _source_seed(seed: int, k: int) -> int:
    return int(np.random.SeedSequence([int(seed), k]).generate_state(1)[0])


def _mixed(datasets: list[grain.MapDataset], weights: list[float]) -> grain.MapDataset:
    return datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, weights)


class ProcessSlice:
    """Process p's rows of global batch i: rows [i*G + p*L, i*G + (p+1)*L) of the mixed order.

    Contiguous slices (not every p-th row) make the global batch the same whatever the process count, so a
    2-process run trains on exactly what the 1-process run trains on; and they line up with
    `jax.make_array_from_process_local_data`, where process p's devices hold batch rows p*L..(p+1)*L.
    Every batch's ids are checked against the vocabulary (an id beyond the table gives a NaN embedding row: jnp.take fills out-of-range rows).
    """

    def __init__(self, rows, global_batch: int, process_index: int, process_count: int, vocab_size: int):
        self.rows = rows
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.offset = process_index * self.local_batch
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.rows) // self.global_batch

    def __getitem__(self, i: int) -> dict:
        start = int(i) * self.global_batch + self.offset
        rows = [self.rows[start + j] for j in range(self.local_batch)]
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        top = int(batch["tokens"].max())
        if top >= self.vocab_size or int(batch["tokens"].min()) < 0:
            raise DataError(f"batch {i} holds token id {top}, outside model.vocab_size={self.vocab_size}")
        return batch


def train_batches(sources, *, seq_len: int, global_batch: int, steps: int, seed: int, vocab_size: int,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Batch i ({"tokens", "segment_ids"}: [global_batch // process_count, seq_len + 1] int32) is what this
    process trains on at step i."""
    total = sum(s.weight for s in sources)
    parts = []
    for k, s in enumerate(sources):
        windows = grain.MapDataset.source(PackedWindows(s.train, seq_len, name=s.name))
        # Enough epochs that the mix outlasts the run whatever the interleaving's rounding.
        needed = steps * global_batch * s.weight / total + global_batch * len(sources)
        parts.append(windows.shuffle(seed=_source_seed(seed, k)).repeat(max(1, math.ceil(needed / len(windows))) + 1))
    mixed = _mixed(parts, [s.weight for s in sources])
    return grain.MapDataset.source(ProcessSlice(mixed, global_batch, process_index, process_count, vocab_size))


def eval_batches(sources, *, seq_len: int, global_batch: int, n_batches: int, vocab_size: int,
                 process_index: int = 0, process_count: int = 1) -> list[dict]:
    """The same first n held-out batches every time (no shuffle), so eval losses compare across steps."""
    # Sources whose eval split is too short for one row simply do not take part.
    with_eval = [s for s in sources if any(len(x.tokens) > seq_len for x in s.eval)]
    if not with_eval:
        return []
    parts = [grain.MapDataset.source(PackedWindows(s.eval, seq_len, name=f"{s.name} (eval split)")) for s in with_eval]
    mixed = _mixed(parts, [s.weight for s in with_eval])
    batches = ProcessSlice(mixed, global_batch, process_index, process_count, vocab_size)
    return [batches[i] for i in range(min(n_batches, len(batches)))]


class BatchIterator:
    """Threaded read-ahead over a batch dataset, with a checkpointable state: the next batch's index."""

    def __init__(self, batches: grain.MapDataset, next_batch: int = 0):
        self._batches = batches
        self._iter = iter(batches.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)))
        self.set_state({"next_batch": next_batch})

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._next >= len(self._batches):
            raise DataError(f"the data ran out at batch {self._next} ({len(self._batches)} batches)")
        batch = next(self._iter)
        self._next += 1
        return batch

    def get_state(self) -> dict:
        return {"next_batch": self._next}

    def set_state(self, state: dict):
        self._next = int(state["next_batch"])
        self._iter.set_state({"next_index": self._next})
