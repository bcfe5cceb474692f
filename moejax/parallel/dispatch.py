"""Expert dispatch and combine inside `jax.shard_map`: capacity-padded all-to-all over the expert axis.

Per device (tokens are split over every batch axis, experts over `expert`):
  1. pack:      each (token, k) assignment gets a slot `expert * C + position`, position = its rank among
                this device's assignments to that expert (stable, so earlier tokens win); assignments at
                position >= C are dropped and counted. The [E*C, D] buffer is expert-major, so it is
                already sorted by destination device (experts are laid out contiguously over `expert`).
  2. all_to_all over `expert`: device j receives, from every source, the rows of its E/ep local experts.
  3. the local experts run as one grouped matmul over [E_local, ep*C, D] (gmm.py).
  4. all_to_all back, then combine: gather each assignment's row, weight it by its router weight, sum
     over k. Dropped assignments contribute zero.
Without a mesh (single-device reference runs) the same code runs with ep=1 and no collectives.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.parallel import gmm
from moejax.parallel.mesh import BATCH_AXES, EXPERT_AXIS, current_mesh


class DispatchStats(NamedTuple):
    tokens_per_expert_E: jax.Array  # assignments routed to each expert, summed over the whole mesh
    dropped: jax.Array  # assignments dropped for capacity, summed over the whole mesh
    assignments: jax.Array  # tokens * top_k, summed over the whole mesh


def capacity_per_expert(tokens_per_device: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert in one device's send buffer. capacity_factor <= 0: worst case, nothing drops.

    One device's tokens choose an expert at most once each, so `tokens_per_device` slots never drop.
    """
    if capacity_factor <= 0:
        return tokens_per_device
    balanced = tokens_per_device * top_k / n_experts
    return max(1, min(tokens_per_device, math.ceil(capacity_factor * balanced)))


def _pack(x_TxD, expert_idx_TxK, n_experts: int, capacity: int):
    """Send buffer [E*C, D] plus each assignment's slot (E*C when dropped) and the local expert counts."""
    n_tokens, top_k = expert_idx_TxK.shape
    n_assign = n_tokens * top_k
    expert_A = expert_idx_TxK.reshape(n_assign)
    order_A = jnp.argsort(expert_A, stable=True)
    counts_E = jnp.bincount(expert_A, length=n_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    pos_sorted_A = jnp.arange(n_assign) - starts_E[expert_A[order_A]]
    pos_A = jnp.zeros((n_assign,), jnp.int32).at[order_A].set(pos_sorted_A.astype(jnp.int32))
    keep_A = pos_A < capacity
    n_slots = n_experts * capacity
    slot_A = jnp.where(keep_A, expert_A * capacity + pos_A, n_slots)
    token_A = jnp.arange(n_assign) // top_k
    buf_SxD = jnp.zeros((n_slots, x_TxD.shape[-1]), x_TxD.dtype)
    buf_SxD = buf_SxD.at[slot_A].set(x_TxD[token_A], mode="drop", unique_indices=True)
    return buf_SxD, slot_A, keep_A, counts_E


def _combine(y_SxD, slot_A, expert_w_TxK):
    n_tokens, top_k = expert_w_TxK.shape
    y_AxD = y_SxD.at[slot_A].get(mode="fill", fill_value=0)
    y_TxKxD = y_AxD.reshape(n_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", y_TxKxD, expert_w_TxK.astype(y_TxKxD.dtype))


def _local_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
               n_experts, ep, capacity, backend, collective):
    d_model = x_TxD.shape[-1]
    n_local = n_experts // ep
    buf_SxD, slot_A, keep_A, counts_E = _pack(x_TxD, expert_idx_TxK, n_experts, capacity)
    if ep > 1:
        # [dest device, E_local*C, D] -> [source device, E_local*C, D]
        buf_PxRxD = jax.lax.all_to_all(buf_SxD.reshape(ep, n_local * capacity, d_model), EXPERT_AXIS, 0, 0)
        x_ExCxD = buf_PxRxD.reshape(ep, n_local, capacity, d_model).transpose(1, 0, 2, 3)
        x_ExCxD = x_ExCxD.reshape(n_local, ep * capacity, d_model)
    else:
        x_ExCxD = buf_SxD.reshape(n_experts, capacity, d_model)
    y_ExCxD = gmm.expert_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, backend=backend)
    if ep > 1:
        y_PxRxD = y_ExCxD.reshape(n_local, ep, capacity, d_model).transpose(1, 0, 2, 3)
        y_PxRxD = jax.lax.all_to_all(y_PxRxD.reshape(ep, n_local * capacity, d_model), EXPERT_AXIS, 0, 0)
        y_SxD = y_PxRxD.reshape(n_experts * capacity, d_model)
    else:
        y_SxD = y_ExCxD.reshape(n_experts * capacity, d_model)
    out_TxD = _combine(y_SxD, slot_A, expert_w_TxK)
    dropped = jnp.sum(~keep_A).astype(jnp.float32)
    counts_E = counts_E.astype(jnp.float32)
    assignments = jnp.float32(keep_A.shape[0])
    if collective:
        counts_E, dropped, assignments = jax.lax.psum((counts_E, dropped, assignments), BATCH_AXES)
    return out_TxD, DispatchStats(counts_E, dropped, assignments)


def routed_experts(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                   capacity_factor: float, backend: str = "auto"):
    """Routed-expert output [T, D] for tokens x [T, D] and their top-k experts/weights [T, K]."""
    n_experts = w_gate_ExDxF.shape[0]
    top_k = expert_idx_TxK.shape[-1]
    mesh = current_mesh()
    if mesh is None:
        capacity = capacity_per_expert(x_TxD.shape[0], top_k, n_experts, capacity_factor)
        return _local_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                          n_experts=n_experts, ep=1, capacity=capacity, backend=backend, collective=False)

    ep = mesh.shape[EXPERT_AXIS]
    batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if x_TxD.shape[0] % batch_shards:
        raise ValueError(f"{x_TxD.shape[0]} tokens do not split over {batch_shards} batch shards")
    capacity = capacity_per_expert(x_TxD.shape[0] // batch_shards, top_k, n_experts, capacity_factor)
    tokens = P(BATCH_AXES, None)
    experts = P(EXPERT_AXIS, None, None)  # fsdp/tensor shards of expert weights are gathered at entry
    stats_spec = DispatchStats(P(), P(), P())

    def body(*args):
        return _local_moe(*args, n_experts=n_experts, ep=ep, capacity=capacity, backend=backend,
                          collective=True)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts, experts),
        out_specs=(tokens, stats_spec),
    )(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
