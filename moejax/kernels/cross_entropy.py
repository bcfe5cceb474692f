"""The LM head and the next-token cross-entropy as one kernel, by the kernel `kernels.loss` names (resolve.py):

  dense    logits = h @ w over the whole [B, L, V], log-softmax in f32, -log p(target). Autodiff keeps the
           [B, L, V] f32 log-softmax for the backward and builds [B, L, V] cotangents there.
  chunked  the same values, never holding [B, L, V]: the sequence is cut into chunks of `chunk` positions and a
           `lax.scan` runs the head + log-sum-exp one chunk at a time, so a step holds [B, chunk, V] f32 logits
           instead of [B, L, V]. A custom VJP keeps only h, w, the targets and the per-position f32
           log-sum-exp ([B, L]) for the backward, which recomputes each chunk's logits, turns them into
           softmax - onehot(target) and feeds that to the two matmuls (d_h, d_w) before the next chunk. At
           L = 4096, V = 129280 that is 2 GiB of f32 logits per sequence (plus as much again for the
           log-softmax and the cotangents) down to chunk / L of it.

Both compute the logits from operands in h's dtype with f32 accumulation (`preferred_element_type`): the logits
are never rounded to bf16 (a bf16 logit of magnitude 10 is off by up to 0.03 nats). Both return the per-position
nll [B, L] in f32; the caller masks and averages.

The scan runs over the sequence and keeps the batch dim whole: the batch dim is the one split over devices (data,
fsdp, expert), and a scan over a sharded dim would serialise the devices. Kernels know arrays, not meshes: a
caller on a mesh passes `constrain_logits`, applied to every [B, chunk or L, V] logits block (model/loss.py
keeps them split over batch and vocab as the model's own logits are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.kernels.varying import int_cotangent


def _logits(h_BxLxD, w_DxV, constrain_logits):
    """f32 logits from operands in h's dtype (w may come in f32 or already cast): f32 accumulation."""
    logits = jnp.einsum("bld,dv->blv", h_BxLxD, w_DxV.astype(h_BxLxD.dtype), preferred_element_type=jnp.float32)
    return logits if constrain_logits is None else constrain_logits(logits)


def dense_cross_entropy(h_BxLxD, w_DxV, targets_BxL, *, constrain_logits=None):
    """-log softmax(h @ w)[target] per position, [B, L] f32, over the whole [B, L, V] logits."""
    logp_BxLxV = jax.nn.log_softmax(_logits(h_BxLxD, w_DxV, constrain_logits), axis=-1)
    return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]


def _target_mask(logits_BxCxV, targets_BxC):
    # A compare against an iota, not a gather: elementwise over V, so it stays split where V is (tensor axis).
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits_BxCxV.shape, 2)
    return vocab == targets_BxC[..., None]


def _chunks(x_BxLx, chunk):
    """[B, L, ...] -> [L / chunk, B, chunk, ...]: the scan's leading dim, the batch dim left whole."""
    b, seq = x_BxLx.shape[:2]
    return jnp.moveaxis(x_BxLx.reshape(b, seq // chunk, chunk, *x_BxLx.shape[2:]), 1, 0)


def _unchunk(x_NxBxCx):
    n, b, c = x_NxBxCx.shape[:3]
    return jnp.moveaxis(x_NxBxCx, 0, 1).reshape(b, n * c, *x_NxBxCx.shape[3:])


def _forward(h_BxLxD, w_DxV, targets_BxL, chunk, constrain_logits):
    """(nll [B, L] f32, lse [B, L] f32); L a multiple of chunk. Each step holds one chunk's [B, chunk, V]."""

    def step(_, xs):
        h_BxCxD, t_BxC = xs
        logits_BxCxV = _logits(h_BxCxD, w_DxV, constrain_logits)
        lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        target_BxC = jnp.sum(jnp.where(_target_mask(logits_BxCxV, t_BxC), logits_BxCxV, 0.0), axis=-1)
        return None, (lse_BxC - target_BxC, lse_BxC)

    _, (nll_NxBxC, lse_NxBxC) = jax.lax.scan(step, None, (_chunks(h_BxLxD, chunk), _chunks(targets_BxL, chunk)))
    return _unchunk(nll_NxBxC), _unchunk(lse_NxBxC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(h_BxLxD, w_DxV, targets_BxL, chunk, constrain_logits, row_parts):
    return _forward(h_BxLxD, w_DxV, targets_BxL, chunk, constrain_logits)[0]


def _chunked_fwd(h_BxLxD, w_DxV, targets_BxL, chunk, constrain_logits, row_parts):
    nll_BxL, lse_BxL = _forward(h_BxLxD, w_DxV, targets_BxL, chunk, constrain_logits)
    # The residuals: the inputs (already live: the caller keeps h and w anyway) and [B, L] f32 of log-sum-exp;
    # no logits, no log-softmax.
    return nll_BxL, (h_BxLxD, w_DxV, targets_BxL, lse_BxL)


def _chunked_bwd(chunk, constrain_logits, row_parts, residuals, d_nll_BxL):
    h_BxLxD, w_DxV, targets_BxL, lse_BxL = residuals
    cdt = h_BxLxD.dtype
    w_c = w_DxV.astype(cdt)
    n_parts, constrain_parts = row_parts if row_parts is not None else (1, None)

    def step(d_w_PxDxV, xs):
        h_BxCxD, t_BxC, lse_BxC, d_BxC = xs
        # Recompute this chunk's logits rather than keep them: one more head matmul per chunk buys the
        # [B, L, V] the forward would otherwise have to save.
        logits_BxCxV = _logits(h_BxCxD, w_c, constrain_logits)
        p_BxCxV = jnp.exp(logits_BxCxV - lse_BxC[..., None])
        # d nll / d logits = softmax - onehot(target), times the incoming cotangent; into the matmuls in the
        # compute dtype (as autodiff of a bf16 head would), both accumulating in f32.
        g_BxCxV = (jnp.where(_target_mask(logits_BxCxV, t_BxC), p_BxCxV - 1.0, p_BxCxV) * d_BxC[..., None]).astype(cdt)
        d_h_BxCxD = jnp.einsum("bcv,dv->bcd", g_BxCxV, w_c, preferred_element_type=jnp.float32).astype(cdt)
        # d_w per part of the rows (the parts the rows are split over devices in): each device adds its own rows'
        # share and nothing is summed across devices inside the loop (a [D, V] carry would be, once per chunk).
        by_part = lambda a: a.reshape(n_parts, a.shape[0] // n_parts, *a.shape[1:])  # noqa: E731
        d_w_PxDxV = d_w_PxDxV + _constrained(constrain_parts, jnp.einsum(
            "pbcd,pbcv->pdv", by_part(h_BxCxD), by_part(g_BxCxV), preferred_element_type=jnp.float32))
        return d_w_PxDxV, d_h_BxCxD

    xs = (_chunks(h_BxLxD, chunk), _chunks(targets_BxL, chunk), _chunks(lse_BxL, chunk),
          _chunks(d_nll_BxL.astype(jnp.float32), chunk))
    d_w_PxDxV = _constrained(constrain_parts, jnp.zeros((n_parts, *w_DxV.shape), jnp.float32))
    d_w_PxDxV, d_h_NxBxCxD = jax.lax.scan(step, d_w_PxDxV, xs)
    d_targets = int_cotangent(targets_BxL)
    return _unchunk(d_h_NxBxCxD).astype(h_BxLxD.dtype), jnp.sum(d_w_PxDxV, axis=0).astype(w_DxV.dtype), d_targets


def _constrained(constrain, a):
    return a if constrain is None else constrain(a)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_cross_entropy(h_BxLxD, w_DxV, targets_BxL, *, chunk: int, constrain_logits=None, row_parts=None):
    """dense_cross_entropy's values and gradients, `chunk` sequence positions of every row at a time (see the
    module docstring). L need not be a multiple of chunk: the sequence is padded up to one and the padded
    positions' results are dropped (their cotangent is zero, so they add nothing to d_w).

    row_parts: (P, constrain) where the rows are split over P devices: the backward keeps w's gradient as P
    partial sums, [P, D, V] f32 with constrain putting part p on the devices of rows p B / P .. (p + 1) B / P, and
    sums them once at the end instead of reducing a [D, V] carry across the devices after every chunk (GSPMD's
    all-reduce per chunk; with it, the loss's gradient traffic over the row axes is one sum per call, at the cost
    of one unsplit [D, V] f32 per device). None, P = 1 or P not dividing B: one [D, V] carry."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    seq = h_BxLxD.shape[1]
    chunk = min(int(chunk), seq)
    pad = -seq % chunk
    if pad:
        h_BxLxD = jnp.pad(h_BxLxD, ((0, 0), (0, pad), (0, 0)))
        targets_BxL = jnp.pad(targets_BxL, ((0, 0), (0, pad)))
    if row_parts is not None and (row_parts[0] <= 1 or h_BxLxD.shape[0] % row_parts[0] or seq + pad == chunk):
        row_parts = None  # one chunk: the carry is summed once anyway
    return _chunked(h_BxLxD, w_DxV, targets_BxL, chunk, constrain_logits, row_parts)[:, :seq]
