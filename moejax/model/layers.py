"""Basic layers: parameters with logical axis names, RMSNorm, token embedding, dense SwiGLU MLP.

Every parameter carries `logical_axes` metadata (one name per dim). `moejax.parallel.mesh` maps those names
onto mesh axes; the model never names a mesh axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels import fp8
from moejax.parallel.mesh import constrain

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


def grads_in_f32(model_cfg) -> bool:
    """model.grad_reduce_dtype == 'float32': project's f32 weight gradients (README, "Mixed precision")."""
    return model_cfg.grad_reduce_dtype == "float32"


def project(spec: str, x, w, *, f32_grad: bool = True):
    """einsum(spec, x, w) with the weight cast to x's (compute) dtype: the mixed-precision contract's GEMM.

    With f32_grad (model.grad_reduce_dtype='float32') and a weight wider than the compute dtype, the weight's
    gradient is computed with f32 output: its sums over the batch shards (GSPMD's reduce-scatter / all-reduce
    over data and fsdp, inserted right after this dot) then run in f32, where plain autodiff would reduce bf16
    partial gradients and round each partial sum. The activation gradient stays in the compute dtype.

    Inside `fp8.gemms_in(fmt)` (the model's body with model.fp8 set) the GEMM and both of its backward GEMMs
    read FP8 inputs (moejax/kernels/fp8.py); the weight gradient is then always accumulated and returned in f32.
    """
    if fp8.active() != "none":
        return fp8.fp8_einsum(spec, x, w, fp8.active())
    if not f32_grad or w.dtype == x.dtype:
        return jnp.einsum(spec, x, w.astype(x.dtype))
    return _project_f32_grad(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project_f32_grad(spec, x, w):
    return jnp.einsum(spec, x, w.astype(x.dtype))


def _project_fwd(spec, x, w):
    w_c = w.astype(x.dtype)
    return jnp.einsum(spec, x, w_c), (x, w_c, jnp.zeros((0,), w.dtype))


def _project_bwd(spec, residuals, dy):
    x, w_c, w_dtype = residuals
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    dx = jnp.einsum(f"{out},{ws}->{xs}", dy, w_c)
    dw = jnp.einsum(f"{xs},{out}->{ws}", x, dy, preferred_element_type=jnp.float32)
    return dx, dw.astype(w_dtype.dtype)


_project_f32_grad.defvjp(_project_fwd, _project_bwd)


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
        # Rows gathered from the f32 table, then cast: the gradient is an f32 scatter-add into the table (a bf16
        # one would round every token's contribution to a row as it adds up).
        # The table whole over fsdp first: GSPMD cannot give the rows both the tokens' batch split and the table's
        # fsdp split of d_model (fsdp is a batch axis too), and resolved it by gathering the whole batch's rows on
        # every expert rank ([global batch, L, D / fsdp] f32 per device: 28 GiB for DeepSeek-V3's 32K stage).
        table_VxD = constrain(self.table_VxD[...], ("vocab", None))
        return jnp.take(table_VxD, tokens_BxL, axis=0).astype(dtype)


class MLP(nnx.Module):
    """Dense SwiGLU FFN: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, std: float, param_dtype=jnp.float32,
                 f32_grad: bool = True):
        self.f32_grad = f32_grad
        self.w_gate_DxF = param(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w_up_DxF = param(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w_down_FxD = param(rngs, (hidden, dim), ("mlp", "embed"), std=std, dtype=param_dtype)

    def __call__(self, x_BxLxD):
        g = self.f32_grad
        gate = project("bld,df->blf", x_BxLxD, self.w_gate_DxF[...], f32_grad=g)
        up = project("bld,df->blf", x_BxLxD, self.w_up_DxF[...], f32_grad=g)
        return project("blf,fd->bld", jax.nn.silu(gate) * up, self.w_down_FxD[...], f32_grad=g)
