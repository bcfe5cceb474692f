"""Basic layers: parameters with logical axis names, RMSNorm, token embedding, dense SwiGLU MLP.

Every parameter carries `logical_axes` metadata (one name per dim). `moejax.parallel.mesh` maps those names
onto mesh axes; the model never names a mesh axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Stacked (scanned) layers get this logical name on their new leading dim.
LAYERS_AXIS_METADATA = {nnx.PARTITION_NAME: "layers", "logical_axes": "layers"}


def param(rngs: nnx.Rngs, shape, logical_axes, *, std: float, dtype=jnp.float32) -> nnx.Param:
    """A truncated-normal parameter tagged with its logical axis names."""
    assert len(shape) == len(logical_axes), (shape, logical_axes)
    init = jax.nn.initializers.truncated_normal(std)
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=tuple(logical_axes))


def ones_param(shape, logical_axes, dtype=jnp.float32) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=tuple(logical_axes))


def dtype_of(name: str):
    return jnp.dtype(name)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.scale_D = ones_param((dim,), ("norm",), param_dtype)
        self.eps = eps

    def __call__(self, x):
        # Normalise in f32 whatever the compute dtype: bf16 variance loses too much.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale_D[...].astype(jnp.float32)).astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, std: float, param_dtype=jnp.float32):
        self.table_VxD = param(rngs, (vocab, dim), ("vocab", "embed"), std=std, dtype=param_dtype)

    def __call__(self, tokens_BxL, dtype):
        return jnp.take(self.table_VxD[...].astype(dtype), tokens_BxL, axis=0)


class MLP(nnx.Module):
    """Dense SwiGLU FFN: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, std: float, param_dtype=jnp.float32):
        self.w_gate_DxF = param(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w_up_DxF = param(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w_down_FxD = param(rngs, (hidden, dim), ("mlp", "embed"), std=std, dtype=param_dtype)

    def __call__(self, x_BxLxD):
        dt = x_BxLxD.dtype
        gate = jnp.einsum("bld,df->blf", x_BxLxD, self.w_gate_DxF[...].astype(dt))
        up = jnp.einsum("bld,df->blf", x_BxLxD, self.w_up_DxF[...].astype(dt))
        return jnp.einsum("blf,fd->bld", jax.nn.silu(gate) * up, self.w_down_FxD[...].astype(dt))
