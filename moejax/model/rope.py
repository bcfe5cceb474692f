"""Rotary position embedding: plain RoPE and YaRN scaling, in both pair layouts checkpoints use.

Layouts: `rotate_half` pairs dims (i, i + K/2) (Llama/Mixtral/Qwen); `interleave` pairs (2i, 2i + 1)
(DeepSeek's released weights). The interleaved output is written de-interleaved ([evens, odds]), exactly as
transformers does: q and k get the same permutation, so q.k is unchanged.

YaRN (Peng et al. 2023) as DeepSeek-V3 and transformers compute it: frequencies whose wavelength fits in the
original context many times are kept (extrapolated), long ones are divided by `factor` (interpolated), with
a linear ramp between the dims given by beta_fast/beta_slow rotations; cos/sin are multiplied by
`attention_factor` (mscale ratio). The extra softmax-scale factor MLA applies lives in `softmax_scale`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RopeSpec(NamedTuple):
    inv_freq: tuple[float, ...]  # [dim // 2], kept as a tuple so the module stays hashable/static
    attention_factor: float
    interleave: bool


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, y) -> tuple[np.ndarray, float]:
    base_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation, interpolation = 1.0 / base_freqs, 1.0 / (y.factor * base_freqs)

    def correction_dim(rotations):
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    if y.mscale and y.mscale_all_dim:
        attention_factor = _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(y.factor)
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_spec(m, dim: int) -> RopeSpec:
    """The rotary spec for a rotary dimension `dim` under model config m."""
    if m.rope_scaling == "yarn":
        inv_freq, factor = _yarn_inv_freq(dim, m.rope_theta, m.yarn)
    else:
        inv_freq = 1.0 / (m.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor = 1.0
    return RopeSpec(tuple(float(f) for f in inv_freq), factor, bool(m.rope_interleave))


def softmax_scale(m, qk_head_dim: int) -> float:
    """1/sqrt(d), times DeepSeek's YaRN mscale(factor, mscale_all_dim)^2 (long-context entropy correction)."""
    scale = qk_head_dim ** -0.5
    if m.rope_scaling == "yarn" and m.yarn.mscale_all_dim:
        scale *= _yarn_mscale(m.yarn.factor, m.yarn.mscale_all_dim) ** 2
    return scale


def apply_rope(x_BxLxHxK, positions_BxL, spec: RopeSpec):
    """Rotate pairs of the last dim by position * frequency; math in f32, result in x's dtype."""
    inv_freq = jnp.asarray(spec.inv_freq, jnp.float32)
    angles_BxLxK2 = positions_BxL[..., None].astype(jnp.float32) * inv_freq
    cos = (jnp.cos(angles_BxLxK2) * spec.attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles_BxLxK2) * spec.attention_factor)[:, :, None, :]
    x = x_BxLxHxK.astype(jnp.float32)
    if spec.interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def segment_positions(segment_ids_BxL: jax.Array) -> jax.Array:
    """Position of each token inside its document (restarts at 0 where the segment id changes)."""
    seq = segment_ids_BxL.shape[1]
    idx_BxL = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids_BxL.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BxL[:, :1], bool),
                              segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)
    start_idx_BxL = jax.lax.cummax(jnp.where(starts, idx_BxL, 0), axis=1)
    return idx_BxL - start_idx_BxL
