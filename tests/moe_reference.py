"""Single-device dense reference for the MoE block, written independently of moejax's dispatch:
every expert runs on every token and a mask picks the routed ones (no sorting, no capacity, no
collectives)."""

import jax
import jax.numpy as jnp


def swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def reference_routing(p, x_BxLxD, moe_cfg):
    """(chosen mask [B, L, E], combine weights [B, L, E], weighted balance losses); one group only."""
    logits = x_BxLxD @ p["router"]["w_DxE"]
    scores = jax.nn.sigmoid(logits) if moe_cfg.score_func == "sigmoid" else jax.nn.softmax(logits, -1)
    n_experts = scores.shape[-1]
    _, idx = jax.lax.top_k(scores + p["router"]["bias_E"], moe_cfg.top_k)
    chosen = jnp.sum(jax.nn.one_hot(idx, n_experts), axis=-2)  # [B, L, E] 0/1
    w = scores * chosen
    if moe_cfg.norm_topk_prob:
        w = w / jnp.sum(w, -1, keepdims=True)
    w = w * moe_cfg.routed_scaling
    probs = scores / jnp.sum(scores, -1, keepdims=True)
    f = jnp.sum(chosen, axis=1) * n_experts / (moe_cfg.top_k * x_BxLxD.shape[1])
    seq_aux = jnp.mean(jnp.sum(f * jnp.mean(probs, axis=1), -1))
    # Batch-wise, one layer of transformers' load_balancing_loss_func: E * sum_e (fraction of all tokens whose
    # top-k includes e) * (mean probability of e over all tokens).
    batch_aux = n_experts * jnp.sum(jnp.mean(chosen, axis=(0, 1)) * jnp.mean(probs, axis=(0, 1)))
    return chosen, w, moe_cfg.seq_aux_loss_coef * seq_aux + moe_cfg.batch_aux_loss_coef * batch_aux


def reference_moe(p, x_BxLxD, moe_cfg, keep_BxLxE=None):
    """MoE output and the aux loss term; keep_BxLxE optionally masks (drops) routed assignments."""
    chosen, w, aux = reference_routing(p, x_BxLxD, moe_cfg)
    if keep_BxLxE is not None:
        w = w * keep_BxLxE
    out = swiglu(x_BxLxD, p["shared"]["w_gate_DxF"], p["shared"]["w_up_DxF"], p["shared"]["w_down_FxD"])
    for e in range(w.shape[-1]):  # loop over experts: the plainest possible routed sum
        y_e = swiglu(x_BxLxD, p["w_gate_ExDxF"][e], p["w_up_ExDxF"][e], p["w_down_ExFxD"][e])
        out = out + w[..., e : e + 1] * y_e
    return out, aux, jnp.sum(chosen, axis=(0, 1))
