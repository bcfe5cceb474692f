"""Causal attention within documents, by the kernel `kernels.attention` names (kernels/resolve.py):

  xla             jax.nn.dot_product_attention(implementation="xla"): XLA's reference attention, a dense
                  [B, H, L, L] score matrix. What CPUs run; the reference every other kernel is tested against.
  cudnn           jax's cuDNN fused attention (`__cudnn$fmha*` custom calls); head dims <= 128, bf16. The
                  document mask is passed as a dense boolean [B, 1, L, L] (cuDNN turns it into a bias).
  tokamax_mosaic  tokamax's flash attention in Mosaic GPU (sm80 / sm90 / sm100 kernels): q/k and v head dims
  tokamax_triton  may differ (MLA's 192 / 128, no padded PV matmul); tokamax's Triton flash attention, same API.
                  Documents are given as each query's first key (`k_start`), not a mask: no L x L input.

flash_residuals (not a config choice) is what the planner traces for a fused GPU kernel in this process: XLA's
attention keeping only a flash kernel's residuals (q, k, v, the output) for its backward, which recomputes.

q [B, L, H, K], k [B, L, G, K], v [B, L, G, V] (G divides H), segment ids [B, L] or None (one document per
row). Packed documents are contiguous runs of equal segment ids (moejax.data.packing), so "same document and
causal" is "key position in [start of the query's document, query position]".

`attention_in_ranges` is the same attention for queries that are not the keys' own positions (context parallelism,
moejax/parallel/context.py): q [B, Q, H, K] against k, v [B, L, ...] in sequence order, each query with its key range
[k_start, k_end) [B, Q]. The fused kernels take the ranges as they are (tokamax's `Mask(k_start, k_end)`), XLA's
reference and cuDNN a boolean [B, 1, Q, L] built from them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def document_start(segment_ids_BxL):
    """Position of the first token of each token's document (segments are contiguous runs)."""
    seq = segment_ids_BxL.shape[1]
    pos_L = jnp.arange(seq, dtype=jnp.int32)
    starts = segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]
    starts_BxL = jnp.concatenate([jnp.ones_like(starts[:, :1]), starts], axis=1)
    return jax.lax.cummax(jnp.where(starts_BxL, pos_L[None, :], 0), axis=1)


def _dot_product(q, k, v, scale, implementation, mask=None):
    """jax.nn.dot_product_attention, causal without a mask. It wants v's head dim equal to k's; MLA's is smaller
    (128 vs 192), so v is zero-padded and the padding sliced off."""
    v_dim, qk_dim = v.shape[-1], q.shape[-1]
    if v_dim != qk_dim:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, qk_dim - v_dim)])
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, scale=scale,
                                       implementation=implementation)
    return out[..., :v_dim]


def _jax_nn(q, k, v, segment_ids_BxL, scale, implementation):
    # Under causality "same document" is "key at or after the query's document start": causality and documents
    # as one boolean [B, 1, L, L] from iota compares (jax would otherwise combine a document mask with its own
    # causal mask into a [B, H, L, L] one).
    if segment_ids_BxL is None:
        return _dot_product(q, k, v, scale, implementation)
    pos_L = jnp.arange(segment_ids_BxL.shape[1], dtype=jnp.int32)
    start_Bx1xLx1 = document_start(segment_ids_BxL)[:, None, :, None]
    mask = (pos_L[None, None, None, :] >= start_Bx1xLx1) & (pos_L[None, None, None, :] <= pos_L[None, None, :, None])
    return _dot_product(q, k, v, scale, implementation, mask)


def _jax_nn_ranges(q, k, v, k_start_BxQ, k_end_BxQ, scale, implementation):
    pos_1x1x1xL = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, None, :]
    mask = (pos_1x1x1xL >= k_start_BxQ[:, None, :, None]) & (pos_1x1x1xL < k_end_BxQ[:, None, :, None])
    return _dot_product(q, k, v, scale, implementation, mask)


# tokamax's implementation objects take its Mask type, which carries k_start; its public
# `dot_product_attention` takes only a boolean mask. Keys of tokamax's implementation table:
_TOKAMAX_IMPLEMENTATION = {"tokamax_mosaic": "mosaic_gpu", "tokamax_triton": "triton", "tokamax_xla": "xla"}


def _tokamax_run(q, k, v, scale, kernel, **mask_fields):
    from tokamax._src.ops.attention import api, base  # optional: the `gpu` extra

    name = _TOKAMAX_IMPLEMENTATION[kernel]
    if name not in api.IMPLEMENTATIONS:
        raise RuntimeError(f"tokamax has no {name!r} attention here (registered: {sorted(api.IMPLEMENTATIONS)}); "
                           "for a deviceless GPU compile tokamax must be imported under its cross-compile switch")
    return api.IMPLEMENTATIONS[name](q, k, v, bias=None, mask=base.Mask(**mask_fields), logits_scale=scale,
                                     precision=None, logits_soft_cap=None, q_sharding=None)


def _tokamax(q, k, v, segment_ids_BxL, scale, kernel):
    k_start = None if segment_ids_BxL is None else document_start(segment_ids_BxL)[:, None, :]  # [B, 1, Lq]
    return _tokamax_run(q, k, v, scale, kernel, k_start=k_start, is_causal=True)


def _tokamax_ranges(q, k, v, k_start_BxQ, k_end_BxQ, scale, kernel):
    # [B, 1, Q]: the same range for every head; no causal flag (the queries are not the keys' positions)
    return _tokamax_run(q, k, v, scale, kernel, k_start=k_start_BxQ[:, None, :], k_end=k_end_BxQ[:, None, :])


# flash_residuals' reference per mask kind: documents (segment ids or None) or key ranges (k_start, k_end).
_REFERENCE = {"documents": _jax_nn, "ranges": _jax_nn_ranges}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_residuals(kind, scale, q, k, v, masks):
    return _REFERENCE[kind](q, k, v, *masks, scale, "xla")


def _flash_residuals_fwd(kind, scale, q, k, v, masks):
    out = _REFERENCE[kind](q, k, v, *masks, scale, "xla")
    return out, (q, k, v, masks, out)


def _flash_residuals_bwd(kind, scale, residuals, d_out):
    q, k, v, masks, _ = residuals
    _, vjp = jax.vjp(lambda q, k, v: _REFERENCE[kind](q, k, v, *masks, scale, "xla"), q, k, v)
    return (*vjp(d_out), tuple(None for _ in masks))


_flash_residuals.defvjp(_flash_residuals_fwd, _flash_residuals_bwd)


def attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, scale: float, *, kernel: str):
    """softmax(q k^T * scale) v over keys that are causal and in the query's document; [B, L, H, V]."""
    if kernel == "flash_residuals":
        return _flash_residuals("documents", scale, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, (segment_ids_BxL,))
    if kernel in ("xla", "cudnn"):
        return _jax_nn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, scale, kernel)
    if kernel in _TOKAMAX_IMPLEMENTATION:
        return _tokamax(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, scale, kernel)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def attention_in_ranges(q_BxQxHxK, k_BxLxGxK, v_BxLxGxV, k_start_BxQ, k_end_BxQ, scale: float, *, kernel: str):
    """softmax(q k^T * scale) v over each query's keys k_start <= k < k_end (sequence order); [B, Q, H, V]."""
    if kernel == "flash_residuals":
        return _flash_residuals("ranges", scale, q_BxQxHxK, k_BxLxGxK, v_BxLxGxV, (k_start_BxQ, k_end_BxQ))
    if kernel in ("xla", "cudnn"):
        return _jax_nn_ranges(q_BxQxHxK, k_BxLxGxK, v_BxLxGxV, k_start_BxQ, k_end_BxQ, scale, kernel)
    if kernel in _TOKAMAX_IMPLEMENTATION:
        return _tokamax_ranges(q_BxQxHxK, k_BxLxGxK, v_BxLxGxV, k_start_BxQ, k_end_BxQ, scale, kernel)
    raise ValueError(f"unknown attention kernel {kernel!r}")
