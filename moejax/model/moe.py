"""The MoE block: shared experts beside routed experts; routed dispatch lives in parallel/dispatch.py."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.layers import MLP, param
from moejax.model.router import Router
from moejax.parallel import dispatch


class MoEStats(NamedTuple):
    """Per-layer statistics; the scan over layers stacks them to [n_moe_layers, ...]."""

    aux_loss: jax.Array  # weighted sum of the balance losses, added to the training loss
    seq_aux_loss: jax.Array
    batch_aux_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert_E: jax.Array
    dropped: jax.Array
    assignments: jax.Array


class MoE(nnx.Module):
    def __init__(self, dim: int, moe_cfg, *, rngs: nnx.Rngs, std: float, param_dtype=jnp.float32):
        n_experts, hidden = moe_cfg.n_routed_experts, moe_cfg.d_ff_expert
        self.router = Router(dim, moe_cfg, rngs=rngs, std=std, param_dtype=param_dtype)
        self.shared = (
            MLP(dim, hidden * moe_cfg.n_shared_experts, rngs=rngs, std=std, param_dtype=param_dtype)
            if moe_cfg.n_shared_experts else None
        )
        self.w_gate_ExDxF = param(rngs, (n_experts, dim, hidden), ("expert", "embed", "expert_mlp"), std=std, dtype=param_dtype)
        self.w_up_ExDxF = param(rngs, (n_experts, dim, hidden), ("expert", "embed", "expert_mlp"), std=std, dtype=param_dtype)
        self.w_down_ExFxD = param(rngs, (n_experts, hidden, dim), ("expert", "expert_mlp", "embed"), std=std, dtype=param_dtype)
        self.capacity_factor = float(moe_cfg.capacity_factor)
        self.backend = moe_cfg.backend
        self.mode = moe_cfg.dispatch
        self.drop_policy = moe_cfg.drop_policy
        self.recv_factor = float(moe_cfg.dropless_recv_factor)
        self.seq_aux_loss_coef = float(moe_cfg.seq_aux_loss_coef)
        self.batch_aux_loss_coef = float(moe_cfg.batch_aux_loss_coef)
        self.z_loss_coef = float(moe_cfg.z_loss_coef)

    def __call__(self, x_BxLxD):
        batch, seq, dim = x_BxLxD.shape
        dt = x_BxLxD.dtype
        routing = self.router(x_BxLxD)
        # Shared experts do not depend on the exchange, so XLA is free to overlap them with it.
        shared_BxLxD = self.shared(x_BxLxD) if self.shared is not None else 0.0
        routed_TxD, dstats = dispatch.routed_experts(
            x_BxLxD.reshape(batch * seq, dim),
            routing.expert_idx_BxLxK.reshape(batch * seq, -1),
            routing.expert_w_BxLxK.reshape(batch * seq, -1),
            self.w_gate_ExDxF[...].astype(dt), self.w_up_ExDxF[...].astype(dt), self.w_down_ExFxD[...].astype(dt),
            capacity_factor=self.capacity_factor, mode=self.mode, drop_policy=self.drop_policy,
            backend=self.backend, recv_factor=self.recv_factor,
        )
        out = shared_BxLxD + routed_TxD.reshape(batch, seq, dim)
        aux = (self.seq_aux_loss_coef * routing.seq_aux_loss + self.batch_aux_loss_coef * routing.batch_aux_loss
               + self.z_loss_coef * routing.z_loss)
        stats = MoEStats(aux, routing.seq_aux_loss, routing.batch_aux_loss, routing.z_loss,
                         dstats.tokens_per_expert_E, dstats.dropped, dstats.assignments)
        return out, stats
