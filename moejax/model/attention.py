"""Causal multi-head attention with RoPE (MLA and GQA arrive with the model-families issue)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.layers import param
from moejax.model.rope import apply_rope


class Attention(nnx.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int, *, rope_theta: float, rngs: nnx.Rngs,
                 std: float, param_dtype=jnp.float32):
        self.w_q_DxHxK = param(rngs, (dim, n_heads, head_dim), ("embed", "heads", "head_dim"), std=std, dtype=param_dtype)
        self.w_k_DxHxK = param(rngs, (dim, n_heads, head_dim), ("embed", "heads", "head_dim"), std=std, dtype=param_dtype)
        self.w_v_DxHxK = param(rngs, (dim, n_heads, head_dim), ("embed", "heads", "head_dim"), std=std, dtype=param_dtype)
        self.w_o_HxKxD = param(rngs, (n_heads, head_dim, dim), ("heads", "head_dim", "embed"), std=std, dtype=param_dtype)
        self.rope_theta = rope_theta

    def __call__(self, x_BxLxD, positions_BxL):
        dt = x_BxLxD.dtype
        q = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_q_DxHxK[...].astype(dt))
        k = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_k_DxHxK[...].astype(dt))
        v = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_v_DxHxK[...].astype(dt))
        q = apply_rope(q, positions_BxL, self.rope_theta)
        k = apply_rope(k, positions_BxL, self.rope_theta)
        # XLA's reference attention; on GPU this lowers to cuDNN flash attention when dtype allows.
        out_BxLxHxK = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxK, self.w_o_HxKxD[...].astype(dt))
