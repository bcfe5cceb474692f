"""Decoder stack: embedding, first-k dense blocks, MoE blocks (each a scan over layers with remat), LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.attention import Attention
from moejax.model.layers import LAYERS_AXIS_METADATA, MLP, Embed, RMSNorm, dtype_of, param
from moejax.model.moe import MoE, MoEStats
from moejax.parallel.mesh import constrain

ACT_BxLxD = ("batch", "seq", "act_embed")

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is a dense MLP or an MoE."""

    def __init__(self, cfg, *, moe: bool, rngs: nnx.Rngs):
        m = cfg.model
        pdt = dtype_of(m.param_dtype)
        self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        self.attn = Attention(m.d_model, m.n_heads, m.head_dim, rope_theta=m.rope_theta, rngs=rngs,
                              std=m.init_std, param_dtype=pdt)
        self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        if moe:
            self.ffn = MoE(m.d_model, cfg.moe, rngs=rngs, std=m.init_std, param_dtype=pdt)
        else:
            self.ffn = MLP(m.d_model, m.d_ff, rngs=rngs, std=m.init_std, param_dtype=pdt)
        self.is_moe = moe

    def __call__(self, x_BxLxD, positions_BxL):
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL)
        x_BxLxD = constrain(x_BxLxD, ACT_BxLxD)
        if self.is_moe:
            y, stats = self.ffn(self.ffn_norm(x_BxLxD))
        else:
            y, stats = self.ffn(self.ffn_norm(x_BxLxD)), None
        return constrain(x_BxLxD + y, ACT_BxLxD), stats


def _stacked_blocks(cfg, n: int, *, moe: bool, rngs: nnx.Rngs):
    """n Blocks with parameters stacked on a leading 'layers' dim, for nnx.scan."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=LAYERS_AXIS_METADATA)
    def create(rngs):
        return Block(cfg, moe=moe, rngs=rngs)

    return create(rngs)


def _run_stack(blocks, x_BxLxD, positions_BxL, remat: str):
    def body(block, x, positions):
        return block(x, positions)

    if remat != "none":
        body = nnx.remat(body, policy=_REMAT_POLICIES[remat])

    @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=(nnx.Carry, 0), transform_metadata=LAYERS_AXIS_METADATA)
    def step(x, block, positions):
        x, stats = body(block, x, positions)
        return x, stats

    return step(x_BxLxD, blocks, positions_BxL)


class Transformer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m = cfg.model
        pdt = dtype_of(m.param_dtype)
        self.dtype = dtype_of(m.dtype)
        self.remat = m.remat
        self.n_dense = m.first_k_dense
        self.n_moe = m.n_layers - m.first_k_dense
        self.embed = Embed(m.vocab_size, m.d_model, rngs=rngs, std=m.init_std, param_dtype=pdt)
        self.dense_layers = _stacked_blocks(cfg, self.n_dense, moe=False, rngs=rngs) if self.n_dense else None
        self.moe_layers = _stacked_blocks(cfg, self.n_moe, moe=True, rngs=rngs) if self.n_moe else None
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        self.head_DxV = param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"), std=m.init_std, dtype=pdt)

    def update_router_bias(self, tokens_per_expert_LxE, rate: float):
        """Aux-loss-free balancing: bias += rate * sign(mean_load - load), per MoE layer."""
        if self.moe_layers is None or rate == 0:
            return
        bias = self.moe_layers.ffn.router.bias_E
        load = tokens_per_expert_LxE.astype(jnp.float32)
        bias[...] = bias[...] + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)

    def __call__(self, tokens_BxL) -> tuple[jax.Array, MoEStats | None]:
        """Logits [B, L, V] in the compute dtype, and MoE statistics stacked over MoE layers."""
        batch, seq = tokens_BxL.shape
        positions_BxL = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        x_BxLxD = constrain(self.embed(tokens_BxL, self.dtype), ACT_BxLxD)
        if self.dense_layers is not None:
            x_BxLxD, _ = _run_stack(self.dense_layers, x_BxLxD, positions_BxL, self.remat)
        stats = None
        if self.moe_layers is not None:
            x_BxLxD, stats = _run_stack(self.moe_layers, x_BxLxD, positions_BxL, self.remat)
        x_BxLxD = self.final_norm(x_BxLxD)
        logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, self.head_DxV[...].astype(self.dtype))
        return constrain(logits_BxLxV, ("batch", "seq", "vocab")), stats
