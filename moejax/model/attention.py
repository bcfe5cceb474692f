"""Causal self-attention: grouped-query attention (MHA, Mixtral, Qwen3 with q/k norm) and DeepSeek's
Multi-head Latent Attention. Both take an optional document mask for packed sequences (segment ids), or, with the
sequence split over the `context` mesh axis, each query's key range (parallel/context.ContextQueries): then they
all-gather what their keys and values are made from (MLA: the compressed latent and the shared RoPE key, GQA: the
K/V heads) and attend from the local queries over the whole sequence."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from moejax.kernels.attention import attention as kernel_attention, attention_in_ranges
from moejax.model import cached_attention as cached
from moejax.model.layers import RMSNorm, dtype_of, grads_in_f32, param, project
from moejax.model.rope import apply_rope, rope_spec, softmax_scale
from moejax.parallel.context import ContextQueries, map_over_context_queries
from moejax.parallel.mesh import map_over_batch_heads
from moejax.remat_names import ATTENTION_OUT


def attention_core(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, scale: float, kernel: str):
    """Causal attention within documents by `kernel` (moejax/kernels/attention.py). XLA's reference is partitioned
    by GSPMD like any XLA op; a fused kernel is a custom call GSPMD cannot split, so it runs inside shard_map on
    each device's batch rows and heads."""
    fn = functools.partial(kernel_attention, scale=scale, kernel=kernel)
    if kernel == "xla":
        out = fn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL)
    else:
        out = map_over_batch_heads(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL)
    return checkpoint_name(out, ATTENTION_OUT)  # what the selective remat policies keep


def context_attention_core(q_BxLxHxK, per_position, weights, keys_and_values, queries: ContextQueries, scale: float,
                           kernel: str):
    """Attention with the sequence split over `context` (parallel/context.py): q holds this device's positions (context
    order); `per_position` (pairs (array in context order, logical names after L)) are all-gathered over `context`
    into sequence order and `keys_and_values(*whole, *weights)` builds k and v of the whole sequence from them
    (inside the device's shard_map: the backward reduce-scatters the gathered arrays' gradient). Each query attends
    over its key range (ContextQueries) by `kernel`."""

    def attend(q, *rest):
        *sources, k_start, k_end = rest
        k, v = keys_and_values(*sources)
        return attention_in_ranges(q, k, v, k_start, k_end, scale=scale, kernel=kernel)

    out = map_over_context_queries(attend, q_BxLxHxK, per_position, weights, queries)
    return checkpoint_name(out, ATTENTION_OUT)


class GQAttention(nnx.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads (MHA when equal)."""

    def __init__(self, m, kernel: str, *, rngs: nnx.Rngs):
        self.kernel = kernel
        self.f32_grad = grads_in_f32(m)
        pdt, d, h, k = dtype_of(m.param_dtype), m.d_model, m.n_heads, m.head_dim
        g = m.n_kv_heads or m.n_heads
        std = m.init_std
        self.w_q_DxHxK = param(rngs, (d, h, k), ("embed", "heads", "head_dim"), std=std, dtype=pdt)
        self.w_k_DxGxK = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std=std, dtype=pdt)
        self.w_v_DxGxK = param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), std=std, dtype=pdt)
        self.w_o_HxKxD = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), std=std, dtype=pdt)
        # Qwen3: RMSNorm over each head's dims on q and k, before RoPE.
        self.q_norm = RMSNorm(k, eps=m.norm_eps, param_dtype=pdt) if m.qk_norm else None
        self.k_norm = RMSNorm(k, eps=m.norm_eps, param_dtype=pdt) if m.qk_norm else None
        self.rope = rope_spec(m, k)
        self.scale = softmax_scale(m, k)

    def _qkv(self, x_BxLxD, positions_BxL):
        q = project("bld,dhk->blhk", x_BxLxD, self.w_q_DxHxK[...], f32_grad=self.f32_grad)
        k = project("bld,dgk->blgk", x_BxLxD, self.w_k_DxGxK[...], f32_grad=self.f32_grad)
        v = project("bld,dgk->blgk", x_BxLxD, self.w_v_DxGxK[...], f32_grad=self.f32_grad)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions_BxL, self.rope), apply_rope(k, positions_BxL, self.rope), v

    def decode(self, x_BxSxD, positions_BxS, cache: cached.GQACache):
        """Generation: this step's K/V heads written into the cache at their positions, the queries attending over
        the cache (model/cached_attention.py). Returns (output [B, S, D], the updated cache)."""
        q, k, v = self._qkv(x_BxSxD, positions_BxS)
        cache = cached.GQACache(cached.write(cache.k_BxTxGxK, k, positions_BxS),
                                cached.write(cache.v_BxTxGxK, v, positions_BxS))
        out_BxSxHxK = cached.gqa_attend(q, cache, positions_BxS, self.scale)
        return project("blhk,hkd->bld", out_BxSxHxK, self.w_o_HxKxD[...], f32_grad=self.f32_grad), cache

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL=None):
        q, k, v = self._qkv(x_BxLxD, positions_BxL)
        if isinstance(segment_ids_BxL, ContextQueries):  # the K/V heads of the whole sequence on every context shard
            kv_names = ("kv_heads", "head_dim")
            out_BxLxHxK = context_attention_core(q, [(k, kv_names), (v, kv_names)], [], lambda k, v: (k, v),
                                                 segment_ids_BxL, self.scale, self.kernel)
        else:
            out_BxLxHxK = attention_core(q, k, v, segment_ids_BxL, self.scale, self.kernel)
        return project("blhk,hkd->bld", out_BxLxHxK, self.w_o_HxKxD[...], f32_grad=self.f32_grad)


class MLAttention(nnx.Module):
    """Multi-head Latent Attention (DeepSeek-V2/V3).

    q = W_qb norm(W_qa x) (or W_q x without a q bottleneck), split into a no-RoPE part [N] and a RoPE part [R];
    the keys and values come from one compressed latent c = norm(W_kva x) of width C: k_nope = W_kb c,
    v = W_vb c per head; the RoPE key k_r = rope(W_kr x) is ONE head shared by all heads. Scores use
    [q_nope, q_rope] . [k_nope, k_r] with DeepSeek's YaRN-corrected softmax scale.
    """

    def __init__(self, m, kernel: str, *, rngs: nnx.Rngs):
        self.kernel = kernel
        self.f32_grad = grads_in_f32(m)
        pdt, d, h, std = dtype_of(m.param_dtype), m.d_model, m.n_heads, m.init_std
        n, r, v, c = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        self.q_lora = bool(m.q_lora_rank)
        if self.q_lora:
            q = m.q_lora_rank
            self.w_qa_DxQ = param(rngs, (d, q), ("embed", "q_lora"), std=std, dtype=pdt)
            self.q_norm = RMSNorm(q, eps=m.norm_eps, param_dtype=pdt)
            self.w_qb_QxHxK = param(rngs, (q, h, n + r), ("q_lora", "heads", "head_dim"), std=std, dtype=pdt)
        else:
            self.w_q_DxHxK = param(rngs, (d, h, n + r), ("embed", "heads", "head_dim"), std=std, dtype=pdt)
        self.w_kva_DxC = param(rngs, (d, c), ("embed", "kv_lora"), std=std, dtype=pdt)
        self.w_kr_DxR = param(rngs, (d, r), ("embed", "head_dim"), std=std, dtype=pdt)
        self.kv_norm = RMSNorm(c, eps=m.norm_eps, param_dtype=pdt)
        self.w_kb_CxHxN = param(rngs, (c, h, n), ("kv_lora", "heads", "head_dim"), std=std, dtype=pdt)
        self.w_vb_CxHxV = param(rngs, (c, h, v), ("kv_lora", "heads", "head_dim"), std=std, dtype=pdt)
        self.w_o_HxVxD = param(rngs, (h, v, d), ("heads", "head_dim", "embed"), std=std, dtype=pdt)
        self.nope_dim = n
        self.rope = rope_spec(m, r)
        self.scale = softmax_scale(m, n + r)

    def _queries(self, x_BxLxD, positions_BxL):
        """(q_nope [B, L, H, N], q_rope [B, L, H, R] rotated)."""
        if self.q_lora:
            q_BxLxQ = self.q_norm(project("bld,dq->blq", x_BxLxD, self.w_qa_DxQ[...], f32_grad=self.f32_grad))
            q = project("blq,qhk->blhk", q_BxLxQ, self.w_qb_QxHxK[...], f32_grad=self.f32_grad)
        else:
            q = project("bld,dhk->blhk", x_BxLxD, self.w_q_DxHxK[...], f32_grad=self.f32_grad)
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim :]
        return q_nope, apply_rope(q_rope, positions_BxL, self.rope)

    def _latent(self, x_BxLxD, positions_BxL):
        """(the compressed latent [B, L, C], the rotated shared RoPE key [B, L, 1, R]): what MLA keeps per position."""
        c_BxLxC = self.kv_norm(project("bld,dc->blc", x_BxLxD, self.w_kva_DxC[...], f32_grad=self.f32_grad))
        k_rope_BxLx1xR = project("bld,dr->blr", x_BxLxD, self.w_kr_DxR[...], f32_grad=self.f32_grad)[:, :, None, :]
        return c_BxLxC, apply_rope(k_rope_BxLx1xR, positions_BxL, self.rope)

    def decode(self, x_BxSxD, positions_BxS, cache: cached.MLACache):
        """Generation: this step's latent and RoPE key written into the cache, the queries attending over it with
        W_kb absorbed (model/cached_attention.py). Returns (output [B, S, D], the updated cache)."""
        q_nope, q_rope = self._queries(x_BxSxD, positions_BxS)
        c_BxSxC, k_rope_BxSx1xR = self._latent(x_BxSxD, positions_BxS)
        cache = cached.MLACache(cached.write(cache.latent_BxTxC, c_BxSxC, positions_BxS),
                                cached.write(cache.k_rope_BxTxR, k_rope_BxSx1xR[:, :, 0], positions_BxS))
        out_BxSxHxV = cached.mla_attend(q_nope, q_rope, cache, self.w_kb_CxHxN[...], self.w_vb_CxHxV[...],
                                        positions_BxS, self.scale)
        return project("blhv,hvd->bld", out_BxSxHxV, self.w_o_HxVxD[...], f32_grad=self.f32_grad), cache

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL=None):
        q_nope, q_rope = self._queries(x_BxLxD, positions_BxL)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        c_BxLxC, k_rope_BxLx1xR = self._latent(x_BxLxD, positions_BxL)
        if isinstance(segment_ids_BxL, ContextQueries):
            # The whole sequence's latent and RoPE key on every context shard, one all-gather of C + R values per
            # position (576 for DeepSeek-V3, against 128 x (192 + 128) for its expanded K and V), expanded locally.
            c_rope_BxLxCR = jnp.concatenate([c_BxLxC, k_rope_BxLx1xR[:, :, 0]], axis=-1)
            weights = [(self.w_kb_CxHxN[...], ("kv_lora", "heads", "head_dim")),
                       (self.w_vb_CxHxV[...], ("kv_lora", "heads", "head_dim"))]
            latent = c_BxLxC.shape[-1]

            def keys_and_values(c_rope_BxLxCR, w_kb_CxHxN, w_vb_CxHxV):
                return self._keys_and_values(c_rope_BxLxCR[..., :latent], c_rope_BxLxCR[..., None, latent:],
                                             w_kb_CxHxN, w_vb_CxHxV)

            out_BxLxHxV = context_attention_core(q, [(c_rope_BxLxCR, (None,))], weights, keys_and_values,
                                                 segment_ids_BxL, self.scale, self.kernel)
        else:
            k, v = self._keys_and_values(c_BxLxC, k_rope_BxLx1xR, self.w_kb_CxHxN[...], self.w_vb_CxHxV[...])
            out_BxLxHxV = attention_core(q, k, v, segment_ids_BxL, self.scale, self.kernel)
        return project("blhv,hvd->bld", out_BxLxHxV, self.w_o_HxVxD[...], f32_grad=self.f32_grad)

    def _keys_and_values(self, c_BxLxC, k_rope_BxLx1xR, w_kb_CxHxN, w_vb_CxHxV):
        """k = [W_kb c, k_r] (k_r: one RoPE head shared by every head), v = W_vb c."""
        k_nope = project("blc,chn->blhn", c_BxLxC, w_kb_CxHxN, f32_grad=self.f32_grad)
        v = project("blc,chv->blhv", c_BxLxC, w_vb_CxHxV, f32_grad=self.f32_grad)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope_BxLx1xR, (*k_nope.shape[:3], k_rope_BxLx1xR.shape[-1]))],
                            axis=-1)
        return k, v


def make_attention(m, kernel: str, *, rngs: nnx.Rngs) -> nnx.Module:
    """The attention kind the config names (config data, not model names, picks the family), computed by the
    attention kernel `kernel` (resolved: kernels/resolve.py)."""
    cls = MLAttention if m.attention == "mla" else GQAttention
    return cls(m, kernel, rngs=rngs)
