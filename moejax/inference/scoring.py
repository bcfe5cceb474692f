"""Log-probabilities of given tokens (what evaluation harnesses ask): each sequence's next-token log-probabilities
under the uncached forward, every MoE layer dropless, in batches on the model's mesh.

Sequences are right-padded to a width rounded up to a multiple of 64 and batches to a fixed row count (a multiple
of the mesh's batch shards), so the harness's thousands of requests share a handful of compiles. Padding never
changes a real position's log-probabilities: attention is causal and the dropless dispatch routes every token
whatever the others do.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.model.moe import exact_dispatch
from moejax.parallel.mesh import batch_sharding, row_shards

_WIDTH_QUANTUM = 64


class Scored(NamedTuple):
    logprobs: np.ndarray  # [n - 1] f32: log p(seq[i + 1] | seq[: i + 1])
    greedy: np.ndarray  # [n - 1] bool: seq[i + 1] is the argmax there


def _forward(state, tokens_BxW, *, graphdef):
    model = nnx.merge(graphdef, state)
    with exact_dispatch():
        logits_BxWxV = model(tokens_BxW).logits_BxLxV.astype(jnp.float32)
    logprobs_BxWxV = jax.nn.log_softmax(logits_BxWxV, axis=-1)
    targets_BxW = jnp.concatenate([tokens_BxW[:, 1:], tokens_BxW[:, :1]], axis=1)  # the last column is padding
    picked_BxW = jnp.take_along_axis(logprobs_BxWxV, targets_BxW[..., None], axis=-1)[..., 0]
    return picked_BxW, jnp.argmax(logits_BxWxV, axis=-1) == targets_BxW


@functools.lru_cache(maxsize=8)
def _compiled(graphdef):
    return jax.jit(functools.partial(_forward, graphdef=graphdef))


def score(model, sequences: Sequence[Sequence[int]], *, mesh=None, batch_rows: int = 8) -> list[Scored]:
    """Next-token log-probabilities of each sequence (>= 2 tokens) under `model` (on `mesh`'s devices, or one)."""
    shards = 1 if mesh is None else row_shards(mesh)
    rows = -(-batch_rows // shards) * shards
    graphdef, state = nnx.split(model)
    forward = _compiled(graphdef)
    out: list[Scored | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))  # similar widths batched together
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        for start in range(0, len(order), rows):
            chunk = order[start:start + rows]
            width = -(-max(len(sequences[i]) for i in chunk) // _WIDTH_QUANTUM) * _WIDTH_QUANTUM
            tokens_BxW = np.zeros((rows, width), np.int32)
            for r, i in enumerate(chunk):
                tokens_BxW[r, : len(sequences[i])] = sequences[i]
            if mesh is not None:
                tokens_BxW = jax.device_put(tokens_BxW, batch_sharding(mesh))
            picked_BxW, greedy_BxW = jax.device_get(forward(state, tokens_BxW))
            for r, i in enumerate(chunk):
                n = len(sequences[i]) - 1
                out[i] = Scored(picked_BxW[r, :n], greedy_BxW[r, :n])
    return out
