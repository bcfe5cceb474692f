"""Router: expert scores, group-limited top-k, aux-loss-free bias, and the balance/z losses.

DeepSeek-V3 semantics: the bias only changes WHICH experts are chosen; the weights that scale the expert
outputs come from the unbiased scores. The bias is not trained by gradients: the training step moves it
by `rate * sign(mean_load - load)` after each optimizer update.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.layers import param
from moejax.parallel.mesh import map_over_batch


class RouterBias(nnx.Variable):
    """Per-expert selection bias for aux-loss-free load balancing (not a gradient-trained parameter)."""


class Routing(NamedTuple):
    expert_idx_BxLxK: jax.Array
    expert_w_BxLxK: jax.Array  # f32 combine weights
    seq_aux_loss: jax.Array  # unweighted sequence-wise balance loss
    prob_E: jax.Array  # mean routing probability of each expert over every token of the global batch
    z_loss: jax.Array  # unweighted router z-loss


class Router(nnx.Module):
    def __init__(self, dim: int, moe_cfg, *, rngs: nnx.Rngs, std: float, param_dtype=jnp.float32):
        n_experts = moe_cfg.n_routed_experts
        self.w_DxE = param(rngs, (dim, n_experts), ("embed", "router_expert"), std=std, dtype=param_dtype)
        self.bias_E = RouterBias(jnp.zeros((n_experts,), jnp.float32), logical_axes=("router_expert",))
        self.top_k = moe_cfg.top_k
        self.score_func = moe_cfg.score_func
        self.n_groups = moe_cfg.n_groups
        self.topk_groups = moe_cfg.topk_groups
        self.routed_scaling = moe_cfg.routed_scaling
        self.norm_topk_prob = moe_cfg.norm_topk_prob

    def _limit_groups(self, choice_BxLxE):
        """Keep only experts in the best `topk_groups` groups; a group scores the sum of its top-2."""
        *lead, n_experts = choice_BxLxE.shape
        grouped = choice_BxLxE.reshape(*lead, self.n_groups, n_experts // self.n_groups)
        top2 = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
        group_score_BxLxG = jnp.sum(top2, axis=-1)
        _, best_groups = jax.lax.top_k(group_score_BxLxG, self.topk_groups)
        keep_BxLxG = jnp.sum(jax.nn.one_hot(best_groups, self.n_groups, dtype=jnp.bool_), axis=-2)
        masked = jnp.where(keep_BxLxG[..., None], grouped, -jnp.inf)
        return masked.reshape(choice_BxLxE.shape)

    def _choose(self, choice_BxLxE):
        if self.n_groups > 1:
            choice_BxLxE = self._limit_groups(choice_BxLxE)
        return jax.lax.top_k(choice_BxLxE, self.top_k)[1]

    def __call__(self, x_BxLxD) -> Routing:
        # Routing decisions in f32: bf16 logits flip near-ties between experts.
        logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32), self.w_DxE[...].astype(jnp.float32))
        if self.score_func == "sigmoid":
            scores_BxLxE = jax.nn.sigmoid(logits_BxLxE)
        else:
            scores_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
        choice = jax.lax.stop_gradient(scores_BxLxE + self.bias_E[...])
        expert_idx_BxLxK = map_over_batch(self._choose, choice)
        weights = jnp.take_along_axis(scores_BxLxE, expert_idx_BxLxK, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * self.routed_scaling

        # Sequence-wise balance loss (DeepSeek-V3 eq. 17-20): sum_i f_i * P_i, averaged over sequences.
        n_experts = scores_BxLxE.shape[-1]
        seq_len = scores_BxLxE.shape[1]
        probs = scores_BxLxE / (jnp.sum(scores_BxLxE, axis=-1, keepdims=True) + 1e-20)
        p_BxE = jnp.mean(probs, axis=1)
        chosen_BxLxE = jnp.sum(jax.nn.one_hot(expert_idx_BxLxK, n_experts, dtype=jnp.float32), axis=-2)
        f_BxE = jnp.sum(chosen_BxLxE, axis=1) * n_experts / (self.top_k * seq_len)
        seq_aux = jnp.mean(jnp.sum(f_BxE * p_BxE, axis=-1))
        # For the batch-wise loss (loss.batch_balance_loss, transformers' load_balancing_loss_func): the mean
        # probability of each expert over every token of the global batch (under GSPMD a mesh-wide reduction).
        prob_E = jnp.mean(p_BxE, axis=0)
        z_loss = jnp.mean(jax.nn.logsumexp(logits_BxLxE, axis=-1) ** 2)
        return Routing(expert_idx_BxLxK, weights, seq_aux, prob_E, z_loss)
