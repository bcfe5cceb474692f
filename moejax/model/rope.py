"""Rotary position embedding (rotate-half convention, as Llama/Mixtral/Qwen checkpoints use).

YaRN scaling for DeepSeek-V3's long context is added with MLA (model-families issue).
"""

from __future__ import annotations

import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float):
    """Inverse frequencies [head_dim // 2]."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x_BxLxHxK, positions_BxL, theta: float):
    """Rotate pairs (i, i + K/2) of the last dim by position * frequency; math in f32."""
    head_dim = x_BxLxHxK.shape[-1]
    inv_freq = rope_frequencies(head_dim, theta)
    angles_BxLxK2 = positions_BxL[..., None].astype(jnp.float32) * inv_freq
    cos = jnp.cos(angles_BxLxK2)[:, :, None, :]
    sin = jnp.sin(angles_BxLxK2)[:, :, None, :]
    x = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)
