"""Attention over a KV cache (generation): what each family keeps per position and how a query reads it.

The cache holds every position 0..T-1 of each row; a step writes its queries' keys at their positions (per row: batched
prompts differ in length) and each query attends over the keys at or before its own position. Positions past a row's
last write hold stale or zero values and are masked, so right-padded prompts need no other bookkeeping: a row's first
generated token is written over its padding before any query can see that position.

GQA keeps the K/V heads, [B, T, G, K] each. MLA keeps what DeepSeek-V3's inference keeps: the compressed latent
[B, T, C] and the shared RoPE key [B, T, R] (C + R = 576 values per position for DeepSeek-V3 against
128 x (192 + 128) for its expanded K and V), and never expands them per head: W_kb is absorbed into the query
(q_nope W_kb^T: scores against the latent itself) and W_vb applied after the attention-weighted latent sum.
Mathematically the expanded attention of model/attention.py; in f32 equal to it up to summation order.

Softmax in f32 whatever the compute dtype (as XLA's reference attention computes it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class GQACache(NamedTuple):
    k_BxTxGxK: jax.Array
    v_BxTxGxK: jax.Array


class MLACache(NamedTuple):
    latent_BxTxC: jax.Array
    k_rope_BxTxR: jax.Array


def cache_widths(m) -> tuple[tuple[int, ...], ...]:
    """The per-position trailing shapes of one layer's cache for model config m: GQA ((G, K), (G, K)), MLA ((C,), (R,))."""
    if m.attention == "mla":
        return (int(m.kv_lora_rank),), (int(m.qk_rope_head_dim),)
    g = int(m.n_kv_heads or m.n_heads)
    return (g, int(m.head_dim)), (g, int(m.head_dim))


def empty_cache(attention: str, widths, batch: int, length: int, dtype, lead: tuple[int, ...] = ()):
    """A zero cache of `attention` ("gqa", "mla") with per-position shapes `widths` (cache_widths) for `lead` (e.g.
    (layers,)) x [batch, length] positions in the compute dtype."""
    kind = MLACache if attention == "mla" else GQACache
    return kind(*(jnp.zeros((*lead, batch, length, *w), dtype) for w in widths))


def cache_bytes_per_token(m, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one position takes in one layer's cache, as kept here, and what the expanded K and V would take
    (MLA: n_heads x (qk head dim + v head dim); GQA: the same as kept)."""
    kept = sum(math.prod(w) for w in cache_widths(m)) * dtype_bytes
    if m.attention == "mla":
        expanded = int(m.n_heads) * (int(m.qk_nope_head_dim) + int(m.qk_rope_head_dim) + int(m.v_head_dim))
    else:
        expanded = 2 * int(m.n_kv_heads or m.n_heads) * int(m.head_dim)
    return {"kept": kept, "expanded": expanded * dtype_bytes}


def write(cache_BxTx, new_BxSx, positions_BxS):
    """cache[b, positions[b, s]] = new[b, s] (each row at its own positions)."""
    rows_Bx1 = jnp.arange(cache_BxTx.shape[0])[:, None]
    return cache_BxTx.at[rows_Bx1, positions_BxS].set(new_BxSx.astype(cache_BxTx.dtype))


def causal_weights(scores_f32, positions_BxS, n_keys: int):
    """softmax over the last (key) dim of scores [B, S, ..., T], keys after each query's position masked."""
    keys_T = jnp.arange(n_keys, dtype=jnp.int32)
    visible = keys_T <= positions_BxS[..., None]  # [B, S, T]
    visible = visible.reshape(*visible.shape[:2], *([1] * (scores_f32.ndim - 3)), n_keys)
    scores_f32 = jnp.where(visible, scores_f32, -jnp.inf)
    return jax.nn.softmax(scores_f32, axis=-1)


def gqa_attend(q_BxSxHxK, cache: GQACache, positions_BxS, scale: float):
    """q [B, S, H, K] over the cached heads; query head h reads K/V head h // (H / G) (transformers' repeat_kv,
    jax's dot_product_attention). Returns [B, S, H, K] in q's dtype."""
    b, s, h, k = q_BxSxHxK.shape
    g = cache.k_BxTxGxK.shape[2]
    q_BxSxGxRxK = q_BxSxHxK.reshape(b, s, g, h // g, k)
    scores = jnp.einsum("bsgrk,btgk->bsgrt", q_BxSxGxRxK, cache.k_BxTxGxK.astype(q_BxSxHxK.dtype),
                        preferred_element_type=jnp.float32) * scale
    p = causal_weights(scores, positions_BxS, cache.k_BxTxGxK.shape[1]).astype(q_BxSxHxK.dtype)
    out = jnp.einsum("bsgrt,btgk->bsgrk", p, cache.v_BxTxGxK.astype(q_BxSxHxK.dtype))
    return out.reshape(b, s, h, -1)


def mla_attend(q_nope_BxSxHxN, q_rope_BxSxHxR, cache: MLACache, w_kb_CxHxN, w_vb_CxHxV, positions_BxS,
               scale: float):
    """MLA over the cached latent with W_kb absorbed into the query and W_vb applied after: [B, S, H, V]."""
    dt = q_nope_BxSxHxN.dtype
    latent = cache.latent_BxTxC.astype(dt)
    q_latent_BxSxHxC = jnp.einsum("bshn,chn->bshc", q_nope_BxSxHxN, w_kb_CxHxN.astype(dt))
    scores = (jnp.einsum("bshc,btc->bsht", q_latent_BxSxHxC, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("bshr,btr->bsht", q_rope_BxSxHxR, cache.k_rope_BxTxR.astype(dt),
                           preferred_element_type=jnp.float32)) * scale
    p = causal_weights(scores, positions_BxS, latent.shape[1]).astype(dt)
    out_latent_BxSxHxC = jnp.einsum("bsht,btc->bshc", p, latent)
    return jnp.einsum("bshc,chv->bshv", out_latent_BxSxHxC, w_vb_CxHxV.astype(dt))
