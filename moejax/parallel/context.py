"""Context parallelism: every sequence's positions split over the `context` mesh axis for the whole step.

The model works on the positions in *context order*: the sequence cut into 2 C equal pieces, context shard i
holding pieces i and 2 C - 1 - i (a front and a back piece). Under causal attention the work of a query grows with
its position, so each shard gets the same work (Megatron-Core's and TorchTitan's load-balanced causal split).
Per-token work (embedding, norms, projections, the MoE dispatch, the loss) does not care about the order (a device's
tokens stay where they are: `tokens_of`, `fold_context_into_rows`); the order
is applied once to the token ids, positions and targets where the model starts (`to_context_order`), and attention
is the one place that sees other shards' positions: it all-gathers what its keys are made from (MLA's compressed
latent and shared RoPE key, GQA's K/V heads) over `context` and puts them back in sequence order
(`map_over_context_queries`); each shard's queries then attend over the whole sequence with their key range [start of the
query's document, query position] (`ContextQueries`), which is causality and the document mask in one.

RoPE/YaRN read the positions computed on the whole sequence before the reorder (global positions, restarting per
packed document as without context parallelism). With context 1 none of this runs: the order is the identity.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from moejax.parallel.mesh import CONTEXT_AXIS, batch_axes, constrain, current_mesh, logical_to_spec, row_shards


class ContextQueries(NamedTuple):
    """Each query position's key range in sequence order, [B, L] in context order: keys k with
    start_BxL <= k <= index_BxL (the first position of the query's document, the query's own position)."""

    start_BxL: jax.Array
    index_BxL: jax.Array


def context_size() -> int:
    """Size of the `context` mesh axis where this is traced (1 without a mesh)."""
    mesh = current_mesh()
    return 1 if mesh is None else int(mesh.shape.get(CONTEXT_AXIS, 1))


def check_sequence_split(seq: int, parts: int) -> None:
    if seq % (2 * parts):
        raise ValueError(f"a sequence of {seq} positions does not split into 2 x context = {2 * parts} equal pieces "
                         f"(mesh.context={parts}): use a train.seq_len that divides by {2 * parts}")


def balanced_order(seq: int, parts: int) -> np.ndarray:
    """[seq] sequence positions in context order: shard i (of `parts`) holds pieces i and 2 parts - 1 - i of
    2 parts equal pieces, in that order."""
    check_sequence_split(seq, parts)
    pieces = np.arange(seq).reshape(2 * parts, seq // (2 * parts))
    return np.concatenate([np.concatenate([pieces[i], pieces[2 * parts - 1 - i]]) for i in range(parts)])


def _sequence_order(seq: int, parts: int) -> np.ndarray:
    """[seq] indices that put context-ordered positions back in sequence order (balanced_order's inverse)."""
    return np.argsort(balanced_order(seq, parts))


def to_context_order(a_BxL, parts: int):
    """[B, L, ...] in sequence order -> context order, split over `context` (a static gather: the arrays it takes
    are replicated over `context`, so each shard picks its own positions)."""
    if parts == 1:
        return a_BxL
    order = balanced_order(a_BxL.shape[1], parts)
    return constrain(jnp.take(a_BxL, order, axis=1), ("batch", "seq", *[None] * (a_BxL.ndim - 2)))


def context_queries(positions_BxL, parts: int) -> tuple[ContextQueries, jax.Array]:
    """(each query's key range, the positions), in context order. positions_BxL: sequence order, each token's
    position in its document (restarting at every packed document), so a document starts at index - position."""
    index_BxL = jnp.broadcast_to(jnp.arange(positions_BxL.shape[1], dtype=jnp.int32), positions_BxL.shape)
    queries = ContextQueries(to_context_order(index_BxL - positions_BxL, parts), to_context_order(index_BxL, parts))
    return queries, to_context_order(positions_BxL, parts)


def gather_sequence(x_BxLxN, parts: int, trailing=()):
    """[B, L, ...] in context order, split over `context` -> whole on every shard, in sequence order (the model's
    logits for callers outside the loss). `trailing`: logical names of the dims after L (default: whole)."""
    if parts == 1:
        return x_BxLxN
    trailing = tuple(trailing) + (None,) * (x_BxLxN.ndim - 2 - len(trailing))
    whole = constrain(x_BxLxN, ("batch", None, *trailing))
    return constrain(jnp.take(whole, _sequence_order(x_BxLxN.shape[1], parts), axis=1), ("batch", None, *trailing))


def _device_major(a_BxL, parts: int):
    """[B, L, ...] (rows split over batch_axes(), positions over `context`) -> [R, C, B / R, L / C, ...]: a device's
    rows and positions as one block, devices in token_axes() order."""
    b, seq, rest, shards = a_BxL.shape[0], a_BxL.shape[1], a_BxL.shape[2:], row_shards()
    return a_BxL.reshape(shards, b // shards, parts, seq // parts, *rest).swapaxes(1, 2)


def tokens_of(x_BxLxN, parts: int):
    """[B, L, ...] -> [B L, ...] tokens (the MoE dispatch's rows), each device's tokens one contiguous block in
    token_axes() order, so the flattening moves no data. (A plain reshape would ask each device for whole rows:
    with positions split over `context`, XLA re-lays the hidden states out with all-to-alls.)"""
    b, seq = x_BxLxN.shape[:2]
    if parts == 1:
        return x_BxLxN.reshape(b * seq, *x_BxLxN.shape[2:])
    return _device_major(x_BxLxN, parts).reshape(b * seq, *x_BxLxN.shape[2:])


def positions_of(x_TxN, batch: int, seq: int, parts: int):
    """Inverse of tokens_of: [B L, ...] -> [B, L, ...]."""
    if parts == 1:
        return x_TxN.reshape(batch, seq, *x_TxN.shape[1:])
    shards = row_shards()
    blocks = x_TxN.reshape(shards, parts, batch // shards, seq // parts, *x_TxN.shape[1:]).swapaxes(1, 2)
    return blocks.reshape(batch, seq, *x_TxN.shape[1:])


def fold_context_into_rows(a_BxL, parts: int):
    """[B, L, ...] in context order -> [B C, L / C, ...]: each device's positions of each of its rows as a row of its
    own, in token_axes() order (no data moves). For work that scans the positions, such as the chunked loss, which
    would otherwise scan a dim split over devices."""
    if parts == 1:
        return a_BxL
    b, seq = a_BxL.shape[:2]
    rows = _device_major(a_BxL, parts).reshape(b * parts, seq // parts, *a_BxL.shape[2:])
    return constrain(rows, ("token_rows", *[None] * (a_BxL.ndim - 1)))


def _in_sequence_order(x_local_BxLxN, parts: int):
    """Inside shard_map: this device's context pieces -> the whole sequence, all-gathered over `context` (in context
    order, shard after shard) and put in sequence order. Its transpose is a reduce-scatter: each device's partial
    gradient of the whole sequence is summed over `context` into the pieces it holds."""
    whole = jax.lax.all_gather(x_local_BxLxN, CONTEXT_AXIS, axis=1, tiled=True)
    return jnp.take(whole, _sequence_order(whole.shape[1], parts), axis=1)


def map_over_context_queries(fn, q_BxLxHxK, per_position, weights, queries: ContextQueries):
    """fn(q, *whole, *weights, k_start, k_end) on each device's rows, heads (split over `tensor` when the head count
    divides by it) and queries (its context pieces, in context order), where `whole` are the arrays of
    `per_position` (pairs (array [B, L, ...] in context order, logical names of its dims after L)) all-gathered over
    `context` into sequence order. `weights`: pairs (array, logical names), passed as stored (replicated over
    `context`). A fused kernel is a custom call GSPMD cannot split; XLA's reference runs here too.

    The gather runs inside the shard_map, before what fn builds from it (MLA's K/V expansion), so the backward
    reduce-scatters the gradient of what was gathered (the latent: 576 values per position for DeepSeek-V3) rather
    than all-reducing the gradient of the keys and values built from it (H x 320)."""
    mesh = current_mesh()
    start_BxL, end_BxL = queries.start_BxL, queries.index_BxL + 1
    parts = context_size()
    arrays = [a for a, _ in per_position]
    if mesh is None or parts == 1:
        return fn(q_BxLxHxK, *arrays, *(w for w, _ in weights), start_BxL, end_BxL)
    tensor = mesh.shape["tensor"]
    head_counts = [q_BxLxHxK.shape[2]] + [a.shape[a.ndim - len(names) + i] for a, names in (*per_position, *weights)
                                          for i, name in enumerate(names) if name in ("heads", "kv_heads")]
    heads = "tensor" if all(h % tensor == 0 for h in head_counts) else None

    def spec(names):  # logical names -> mesh axes, with `heads`/`kv_heads` only where the heads split
        return tuple(heads if n in ("heads", "kv_heads") else (None if n is None else logical_to_spec((n,))[0])
                     for n in names)

    rows = batch_axes()
    q_spec, range_spec = P(rows, CONTEXT_AXIS, heads, None), P(rows, CONTEXT_AXIS)
    in_specs = (q_spec, *[P(rows, CONTEXT_AXIS, *spec(names)) for _, names in per_position],
                *[P(*spec(names)) for _, names in weights], range_spec, range_spec)
    n = len(arrays)

    def body(q, *rest):
        whole = [_in_sequence_order(a, parts) for a in rest[:n]]
        return fn(q, *whole, *rest[n:])

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
        q_BxLxHxK, *arrays, *(w for w, _ in weights), start_BxL, end_BxL)
