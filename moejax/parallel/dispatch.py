"""Expert dispatch and combine inside `jax.shard_map`, selected by `moe.dispatch`.

Tokens are split over every batch axis, experts over `expert` (ep devices, E/ep local experts each).

  capacity   each device ranks its assignments per expert (routing_plan.py; 'position' or 'probability'
             drop policy) into a [E*C, D] expert-major buffer, which is therefore sorted by destination
             device; all_to_all over `expert`; the local experts run as one grouped matmul over
             [E_local, ep*C, D]; all_to_all back; combine. C = ceil(capacity_factor * T*K / E).
  allgather  all-gather tokens and routing over `expert`; each device runs its local experts on every
             gathered token routed to them (capacity over the gathered tokens); reduce-scatter the
             partial outputs back. Better for small expert groups or large top-k.

Dispatch and combine are gathers through both directions of one permutation (routing_plan.py), also in
the backward pass. Without a mesh (single-device reference runs) the same code runs with ep=1 and no
collectives.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.parallel import gmm
from moejax.parallel.mesh import BATCH_AXES, EXPERT_AXIS, current_mesh
from moejax.parallel.routing_plan import combine_rows, dispatch_rows, make_plan


class DispatchStats(NamedTuple):
    tokens_per_expert_E: jax.Array  # assignments routed to each expert, summed over the whole mesh
    dropped: jax.Array  # assignments dropped for capacity, summed over the whole mesh
    assignments: jax.Array  # tokens * top_k, summed over the whole mesh


def capacity_per_expert(tokens_per_device: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert for `tokens_per_device` tokens. capacity_factor <= 0: worst case, nothing drops.

    Tokens choose an expert at most once each, so `tokens_per_device` slots never drop.
    """
    if capacity_factor <= 0:
        return tokens_per_device
    balanced = tokens_per_device * top_k / n_experts
    return max(1, min(tokens_per_device, math.ceil(capacity_factor * balanced)))


def _plan(expert_idx_TxK, expert_w_TxK, n_experts, capacity, drop_policy):
    priority = expert_w_TxK.reshape(-1) if drop_policy == "probability" else None
    return make_plan(expert_idx_TxK.reshape(-1), n_experts, capacity, priority)


def _stats(counts_E, dropped, assignments, collective: bool) -> DispatchStats:
    counts_E, dropped, assignments = counts_E.astype(jnp.float32), dropped.astype(jnp.float32), jnp.float32(assignments)
    if collective:
        counts_E, dropped, assignments = jax.lax.psum((counts_E, dropped, assignments), BATCH_AXES)
    return DispatchStats(counts_E, dropped, assignments)


def _capacity_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                  n_experts, ep, capacity, backend, drop_policy, collective):
    n_tokens, top_k = expert_idx_TxK.shape
    d_model = x_TxD.shape[-1]
    n_local = n_experts // ep
    plan = _plan(expert_idx_TxK, expert_w_TxK, n_experts, capacity, drop_policy)
    buf_SxD = dispatch_rows(x_TxD, plan.slot_A, plan.src_S, top_k)
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
    out_TxD = combine_rows(y_SxD, expert_w_TxK, plan.slot_A, plan.src_S)
    dropped = jnp.sum(~plan.keep_A)
    return out_TxD, _stats(plan.counts_E, dropped, n_tokens * top_k, collective)


def _allgather_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                   n_experts, ep, capacity, backend, drop_policy, collective):
    n_tokens, top_k = expert_idx_TxK.shape
    n_local = n_experts // ep
    if ep > 1:
        x_all = jax.lax.all_gather(x_TxD, EXPERT_AXIS, tiled=True)
        idx_all = jax.lax.all_gather(expert_idx_TxK, EXPERT_AXIS, tiled=True)
        w_all = jax.lax.all_gather(expert_w_TxK, EXPERT_AXIS, tiled=True)
        first_local = jax.lax.axis_index(EXPERT_AXIS) * n_local
    else:
        x_all, idx_all, w_all, first_local = x_TxD, expert_idx_TxK, expert_w_TxK, 0
    # Assignments to other devices' experts go to a virtual expert n_local whose slots do not exist.
    local_idx = idx_all - first_local
    is_local = (local_idx >= 0) & (local_idx < n_local)
    plan = _plan(jnp.where(is_local, local_idx, n_local), w_all, n_local + 1, capacity, drop_policy)
    n_slots = n_local * capacity
    slot_A = jnp.where(plan.slot_A < n_slots, plan.slot_A, n_slots)
    src_S = plan.src_S[:n_slots]
    buf_SxD = dispatch_rows(x_all, slot_A, src_S, top_k)
    y_ExCxD = gmm.expert_ffn(buf_SxD.reshape(n_local, capacity, -1), w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                             backend=backend)
    partial_out = combine_rows(y_ExCxD.reshape(n_slots, -1), w_all, slot_A, src_S)
    out_TxD = jax.lax.psum_scatter(partial_out, EXPERT_AXIS, scatter_dimension=0, tiled=True) if ep > 1 else partial_out
    # Every device counts drops among the gathered assignments to its own experts: summed over the
    # mesh that is each dropped assignment once. Loads come from the device's own tokens.
    dropped = jnp.sum(is_local.reshape(-1) & ~plan.keep_A)
    counts_E = jnp.bincount(expert_idx_TxK.reshape(-1), length=n_experts)
    return out_TxD, _stats(counts_E, dropped, n_tokens * top_k, collective)


_MODES = {"capacity": _capacity_moe, "allgather": _allgather_moe}


def routed_experts(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                   capacity_factor: float, mode: str = "capacity", drop_policy: str = "position",
                   backend: str = "auto"):
    """Routed-expert output [T, D] for tokens x [T, D] and their top-k experts/weights [T, K]."""
    n_experts = w_gate_ExDxF.shape[0]
    top_k = expert_idx_TxK.shape[-1]
    body_fn = _MODES[mode]
    mesh = current_mesh()
    if mesh is None:
        capacity = capacity_per_expert(x_TxD.shape[0], top_k, n_experts, capacity_factor)
        return body_fn(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                       n_experts=n_experts, ep=1, capacity=capacity, backend=backend, drop_policy=drop_policy,
                       collective=False)

    ep = mesh.shape[EXPERT_AXIS]
    batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if x_TxD.shape[0] % batch_shards:
        raise ValueError(f"{x_TxD.shape[0]} tokens do not split over {batch_shards} batch shards")
    tokens_per_device = x_TxD.shape[0] // batch_shards
    # allgather: each expert sees the tokens of its whole expert group.
    seen = tokens_per_device * ep if mode == "allgather" else tokens_per_device
    capacity = capacity_per_expert(seen, top_k, n_experts, capacity_factor)
    tokens = P(BATCH_AXES, None)
    experts = P(EXPERT_AXIS, None, None)  # fsdp/tensor shards of expert weights are gathered at entry
    stats_spec = DispatchStats(P(), P(), P())

    def body(*args):
        return body_fn(*args, n_experts=n_experts, ep=ep, capacity=capacity, backend=backend,
                       drop_policy=drop_policy, collective=True)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts, experts),
        out_specs=(tokens, stats_spec),
    )(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
