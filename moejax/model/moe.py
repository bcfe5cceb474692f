"""The MoE block: shared experts beside routed experts; routed dispatch lives in parallel/dispatch.py."""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.layers import MLP, param
from moejax.model.router import Router
from moejax.parallel import dispatch
from moejax.parallel.context import context_size, positions_of, tokens_of


class MoEStats(NamedTuple):
    """Per-layer statistics; the scan over layers stacks them to [n_moe_layers, ...].

    The batch-wise balance loss is transformers' `load_balancing_loss_func`, a product of means over the
    tokens of ALL layers together, so one layer cannot compute its share: the layer reports its loads and
    mean probabilities, and `loss.lm_loss` computes the loss once for the whole model and fills in
    `batch_aux_loss` and the batch-wise part of `aux_loss` (see `loss.batch_balance_loss`).
    """

    aux_loss: jax.Array  # weighted balance losses; from lm_loss, sum over rows = the whole weighted aux term
    seq_aux_loss: jax.Array
    # Unweighted batch-wise balance loss. From the layer alone: this layer's own value (a one-layer model's
    # loss); from lm_loss: this row's term, whose mean over rows is the model's loss.
    batch_aux_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert_E: jax.Array
    dropped: jax.Array
    assignments: jax.Array
    router_load_E: jax.Array  # fraction of the global batch's tokens routed to each expert (sums to top_k)
    router_prob_E: jax.Array  # mean routing probability of each expert over the global batch (sums to 1)
    dropless_rounds: jax.Array  # receive-window rounds the dropless exchange ran (1: the load fit one window)


# How per-pass statistics combine over the passes of one step (micro-batches): counts add up, the rounds of the
# dropless exchange take the worst pass, everything else (losses, load fractions, probabilities) is a mean.
_SUMMED_STATS = ("tokens_per_expert_E", "dropped", "assignments")


def combine_micro_stats(stats_MxR: MoEStats) -> MoEStats:
    """[M, rows, ...] statistics of M passes -> [rows, ...] of the step."""
    return MoEStats(**{k: (jnp.sum(v, axis=0) if k in _SUMMED_STATS else jnp.max(v, axis=0) if k == "dropless_rounds"
                           else jnp.mean(v, axis=0)) for k, v in stats_MxR._asdict().items()})


_EXACT = contextvars.ContextVar("moejax_exact_dispatch", default=False)


@contextlib.contextmanager
def exact_dispatch():
    """MoE layers traced inside dispatch dropless whatever their config: evaluation must not drop tokens (a capacity
    run's held-out loss would otherwise depend on the batch's routing). Read at trace time."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)


class MoE(nnx.Module):
    def __init__(self, dim: int, moe_cfg, expert_gemm: str, *, rngs: nnx.Rngs, std: float, param_dtype=jnp.float32,
                 f32_grad: bool = True, exchange_chunks: int = 1):
        n_experts, hidden = moe_cfg.n_routed_experts, moe_cfg.d_ff_expert
        self.router = Router(dim, moe_cfg, rngs=rngs, std=std, param_dtype=param_dtype)
        self.shared = (
            MLP(dim, hidden * moe_cfg.n_shared_experts, rngs=rngs, std=std, param_dtype=param_dtype, f32_grad=f32_grad)
            if moe_cfg.n_shared_experts else None
        )
        self.w_gate_ExDxF = param(rngs, (n_experts, dim, hidden), ("expert", "embed", "expert_mlp"), std=std, dtype=param_dtype)
        self.w_up_ExDxF = param(rngs, (n_experts, dim, hidden), ("expert", "embed", "expert_mlp"), std=std, dtype=param_dtype)
        self.w_down_ExFxD = param(rngs, (n_experts, hidden, dim), ("expert", "expert_mlp", "embed"), std=std, dtype=param_dtype)
        self.capacity_factor = float(moe_cfg.capacity_factor)
        self.f32_grad = f32_grad
        self.expert_gemm = expert_gemm  # resolved kernels.expert_gemm (moejax/kernels/grouped_gemm.py)
        self.mode = moe_cfg.dispatch
        self.drop_policy = moe_cfg.drop_policy
        self.dropless_window = float(moe_cfg.dropless_window)
        self.exchange_chunks = exchange_chunks  # moe.exchange_chunks resolved (kernels.resolve.exchange_chunks)
        self.exact_mode = ("dropless", self.capacity_factor)  # exact dispatch (evaluation, model(tokens))
        self.seq_aux_loss_coef = float(moe_cfg.seq_aux_loss_coef)
        self.batch_aux_loss_coef = float(moe_cfg.batch_aux_loss_coef)  # applied model-wide by loss.lm_loss
        self.z_loss_coef = float(moe_cfg.z_loss_coef)

    def __call__(self, x_BxLxD):
        batch, seq, dim = x_BxLxD.shape
        dt = x_BxLxD.dtype
        routing = self.router(x_BxLxD)
        # Shared experts do not depend on the exchange, so XLA is free to overlap them with it.
        shared_BxLxD = self.shared(x_BxLxD) if self.shared is not None else 0.0
        parts = context_size()  # tokens_of: each device's tokens stay where they are (parallel/context.py)
        routed_TxD, dstats = dispatch.routed_experts(
            tokens_of(x_BxLxD, parts), tokens_of(routing.expert_idx_BxLxK, parts), tokens_of(routing.expert_w_BxLxK, parts),
            self.w_gate_ExDxF[...], self.w_up_ExDxF[...], self.w_down_ExFxD[...], compute_dtype=dt,
            f32_grad=self.f32_grad, capacity_factor=self.exact_mode[1] if _EXACT.get() else self.capacity_factor,
            mode=self.exact_mode[0] if _EXACT.get() else self.mode, drop_policy=self.drop_policy,
            gemm=self.expert_gemm, dropless_window=self.dropless_window,
            exchange_chunks=self.exchange_chunks,
        )
        out = shared_BxLxD + positions_of(routed_TxD, batch, seq, parts)
        # The mesh-wide selection counts (before any drop) as fractions of the global batch's tokens.
        load_E = jax.lax.stop_gradient(dstats.tokens_per_expert_E) / (batch * seq)
        own_batch_aux = load_E.shape[-1] * jnp.sum(load_E * routing.prob_E)
        # The batch-wise term is model-wide: lm_loss adds it (batch_aux_loss_coef) once for all layers.
        aux = self.seq_aux_loss_coef * routing.seq_aux_loss + self.z_loss_coef * routing.z_loss
        stats = MoEStats(aux, routing.seq_aux_loss, own_batch_aux, routing.z_loss,
                         dstats.tokens_per_expert_E, dstats.dropped, dstats.assignments, load_E, routing.prob_E,
                         dstats.rounds)
        return out, stats
