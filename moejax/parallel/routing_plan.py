"""Where each (token, k) assignment goes in an expert-major slot buffer, and gather-only moves in and out.

A plan has both directions of one permutation:
  slot_A[a]  the slot of assignment a = t*K + k  (== n_slots when it was dropped)
  src_S[s]   the assignment filling slot s       (== n_assign when the slot is empty)
Dispatch gathers rows into slots with src_S; combine gathers slots back with slot_A. Their custom VJPs
gather with the other direction instead of letting autodiff emit scatter-adds (slow on every backend).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class RoutingPlan(NamedTuple):
    slot_A: jax.Array  # int32 [T*K]
    src_S: jax.Array  # int32 [E*C]
    keep_A: jax.Array  # bool [T*K]
    counts_E: jax.Array  # int32 [E] assignments routed to each expert (before any drop)


def argsort_stable(keys_N):
    """jnp.argsort(keys_N, stable=True) for a 1-D array, as one lax.sort whose index operand is derived from the
    keys. jnp.argsort sorts the keys with an iota that does not depend on them; under the pipeline's vmap over
    stages (spmd_axis_name) around the dispatch shard_map, jax 0.12's batching of sort types the batched keys as
    varying over `stage` and the unbatched iota not, and refuses the sort ("requires varying manual axes to
    match"). An iota computed from the keys is batched with them (zero for every key, NaN too); XLA folds it away."""
    iota_N = jax.lax.iota(jnp.int32, keys_N.shape[0]) + (keys_N == keys_N).astype(jnp.int32) * 0
    return jax.lax.sort((keys_N, iota_N), num_keys=1, is_stable=True)[1]


def make_plan(expert_A, n_experts: int, capacity: int, priority_A=None) -> RoutingPlan:
    """Rank each assignment among those of its expert; ranks >= capacity are dropped.

    Rank order is the assignment order (earlier tokens first: the 'position' policy) or, with priority_A,
    descending priority (the 'probability' policy: an expert keeps its highest-weight tokens).
    """
    n_assign = expert_A.shape[0]
    expert_A = expert_A.astype(jnp.int32)
    if priority_A is None:
        order_A = argsort_stable(expert_A)
    else:  # by expert, then descending priority: two stable sorts, as jnp.lexsort does (also its iota: argsort_stable)
        by_priority_A = argsort_stable(-priority_A)
        order_A = by_priority_A[argsort_stable(expert_A[by_priority_A])]
    counts_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted = jnp.arange(n_assign, dtype=jnp.int32) - starts_E[expert_A[order_A]]
    rank_A = rank_sorted[argsort_stable(order_A)]  # inverse permutation by sort, not scatter
    keep_A = rank_A < capacity
    n_slots = n_experts * capacity
    slot_A = jnp.where(keep_A, expert_A * capacity + rank_A, n_slots).astype(jnp.int32)
    # Slot (e, c) holds the c-th ranked assignment of expert e, if it has that many.
    c_S = jnp.tile(jnp.arange(capacity, dtype=jnp.int32), n_experts)
    e_S = jnp.repeat(jnp.arange(n_experts, dtype=jnp.int32), capacity)
    filled_S = c_S < counts_E[e_S]
    src_S = jnp.where(filled_S, order_A[jnp.minimum(starts_E[e_S] + c_S, n_assign - 1)], n_assign)
    return RoutingPlan(slot_A, src_S.astype(jnp.int32), keep_A, counts_E)


def _take_rows(x_NxD, idx_M):
    """x[idx] with out-of-range indices giving zero rows."""
    return jnp.take(x_NxD, idx_M, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x_TxD, slot_A, src_S, top_k: int):
    """[T, D] tokens -> [S, D] slots (empty slots are zero)."""
    return _take_rows(x_TxD, src_S // top_k)


def _dispatch_fwd(x_TxD, slot_A, src_S, top_k):
    return dispatch_rows(x_TxD, slot_A, src_S, top_k), (slot_A, src_S)


def _dispatch_bwd(top_k, res, d_buf_SxD):
    slot_A, src_S = res
    n_tokens = slot_A.shape[0] // top_k
    # dx[t] = sum over k of the slot cotangent of assignment (t, k): a gather, then a sum over k.
    d_x = _take_rows(d_buf_SxD, slot_A).reshape(n_tokens, top_k, -1).sum(axis=1)
    return d_x, None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(y_SxD, w_TxK, slot_A, src_S):
    """[S, D] expert outputs -> [T, D]: sum over k of w[t, k] * y[slot of (t, k)]; dropped ones add 0."""
    n_tokens, top_k = w_TxK.shape
    y_TxKxD = _take_rows(y_SxD, slot_A).reshape(n_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", y_TxKxD, w_TxK.astype(y_SxD.dtype))


def _combine_fwd(y_SxD, w_TxK, slot_A, src_S):
    return combine_rows(y_SxD, w_TxK, slot_A, src_S), (y_SxD, w_TxK, slot_A, src_S)


def _combine_bwd(res, d_out_TxD):
    y_SxD, w_TxK, slot_A, src_S = res
    n_tokens, top_k = w_TxK.shape
    w_A = w_TxK.reshape(-1).astype(d_out_TxD.dtype)
    # dy[s] = w(src) * dout[token(src)]: gathered through the inverse map, no scatter.
    w_S = jnp.take(w_A, src_S, mode="fill", fill_value=0)
    d_y = _take_rows(d_out_TxD, src_S // top_k) * w_S[:, None]
    y_TxKxD = _take_rows(y_SxD, slot_A).reshape(n_tokens, top_k, -1)
    d_w = jnp.einsum("tkd,td->tk", y_TxKxD, d_out_TxD).astype(w_TxK.dtype)
    return d_y, d_w, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)
