"""The routed experts' SwiGLU through NVIDIA Transformer Engine's grouped GEMM (`kernels.expert_gemm='te'`).

`transformer_engine.jax.dense.grouped_dense(x [M, K], w [G, K, N], group_sizes [G])` multiplies group g's rows by
w[g] and has a custom VJP whose backward is two more grouped GEMMs: the input gradient and the weight gradient
over the ragged rows ([G, K, N]). Its quantisation follows `model.fp8`:

  none        bf16 operands (TE's NO_SCALING): cuBLAS's grouped GEMM.
  tensorwise  TE's current scaling (CURRENT_TENSOR_SCALING): one scale per group of each operand from its amax,
              e4m3 forward, e5m2 gradients (TE's "hybrid" format, as moejax's qwix recipe of the same name).
  mxfp8       TE's MXFP8_1D_SCALING: e4m3 values with one E8M0 scale per 32 elements along each GEMM's
              contraction, gradients in e4m3 too (NVIDIA's Blackwell recipe, as moejax's qwix mxfp8).

What TE needs of its operands is met by the dispatch's layout (parallel/dropless.py, dispatch.py), not by copies
here: the rows arrive grouped by expert, each group padded to a multiple of TE_ALIGN rows (MXFP8's scales are
laid out in 128-row blocks per group), and the groups' sizes add up to the rows (padding rows are zeros; TE
takes padding as part of a group). TE's JAX side cannot shard the kernel itself (`kernel_fsdp_info` "not
supported yet"): it runs inside the dispatch `shard_map` on each device's local experts, untyped
(`check_vma=False`), as tokamax does.

Importing TE needs CUDA's libraries and a driver (`libcuda.so.1`), and TE asks the physical GPU for its compute
capability while tracing; a deviceless compile provides both through planner/te_deviceless.py, used by the dry
run only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import qwix

from moejax.kernels import fp8
from moejax.kernels.resolve import TE_ALIGN, TE_FP8_FORMATS
from moejax.remat_names import EXPERT_GEMM

# The cuBLAS workspace each TE grouped GEMM call returns beside its output (u8[134217984] in the compiled program):
# 32 MiB (Hopper and later) for each of the V1 path's 4 compute streams, plus 256 bytes to align it; the V2 path
# (TE built against cuBLAS >= 13.2) uses one stream. XLA reuses the buffer from call to call.
WORKSPACE_BYTES = {"v1": 4 * 32 * 2**20 + 256, "v2": 32 * 2**20 + 256}

_STAND_IN = contextvars.ContextVar("moejax_te_stand_in", default=False)


@contextlib.contextmanager
def stand_in():
    """Inside: grouped_dense runs `emulated_grouped_dense` instead of TE (which needs a GPU to run and CUDA to
    import): the CPU tests of the dispatch's TE layout, and the planner's trace of what the step keeps."""
    token = _STAND_IN.set(True)
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def _quantize(a_GxRxK, fmt: str, *, gradient: bool = False):
    """a quantised along its last axis as TE's recipe does it (fp8.quantize_rows: mxfp8 32-element E8M0 blocks;
    tensorwise one scale per g, e5m2 for a gradient); returns (qwix QArray, dequantised f32)."""
    q = fp8.quantize_rows(a_GxRxK, fmt, gradient=gradient)
    return q, qwix.dequantize(q)[..., : a_GxRxK.shape[-1]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def emulated_grouped_dense(x_RxK, w_GxKxN, group_sizes_G, fmt: str):
    """TE's grouped_dense emulated with XLA ops on any platform: the same groups (rows of group g times w[g]), the
    same quantisation of each GEMM's operands along its contraction (forward x and w along K; dgrad dy and w along
    N; wgrad x and dy along the rows), f32 accumulation, and the same residuals: for FP8 the quantised copies of x
    (along the rows) and w (along N) TE keeps for the backward, for bf16 x and w themselves."""
    return _emulated_fwd(x_RxK, w_GxKxN, group_sizes_G, fmt)[0]


def _emulated_fwd(x_RxK, w_GxKxN, group_sizes_G, fmt):
    f32 = jnp.float32
    if fmt == "none":
        y = jax.lax.ragged_dot(x_RxK, w_GxKxN, group_sizes_G, preferred_element_type=f32)
        return y.astype(x_RxK.dtype), (x_RxK, w_GxKxN, group_sizes_G)
    _, x_deq = _quantize(x_RxK[None], fmt)
    _, w_deq = _quantize(jnp.swapaxes(w_GxKxN, 1, 2), fmt)  # [G, N, K]: w along K
    y = jax.lax.ragged_dot(x_deq[0], jnp.swapaxes(w_deq, 1, 2), group_sizes_G, preferred_element_type=f32)
    x_cols_q, _ = _quantize(x_RxK.T[None], fmt)  # [1, K, R]: x along the rows, for the wgrad
    w_q, _ = _quantize(w_GxKxN, fmt)  # [G, K, N]: w along N, for the dgrad
    return y.astype(x_RxK.dtype), (_kept(x_cols_q, fmt), _kept(w_q, fmt), group_sizes_G)


def _kept(q, fmt):
    """A quantised residual as TE keeps it: MXFP8's scales as E8M0 (powers of two: exact), one byte per 32 values."""
    return q.qvalue, q.scale.astype(jnp.float8_e8m0fnu) if fmt == "mxfp8" else q.scale


def _dequantize(kept, fmt):
    qvalue, scale = kept
    qtype = "mxfp8" if fmt == "mxfp8" else qvalue.dtype
    return qwix.dequantize(qwix.QArray(qvalue, scale.astype(jnp.float32), None, qtype))


def _emulated_bwd(fmt, residuals, dy_RxN):
    f32 = jnp.float32
    wgrad_dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                   lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    if fmt == "none":
        x_RxK, w_GxKxN, sizes_G = residuals
        dx = jax.lax.ragged_dot(dy_RxN, jnp.swapaxes(w_GxKxN, 1, 2), sizes_G, preferred_element_type=f32)
        dw = jax.lax.ragged_dot_general(x_RxK, dy_RxN, sizes_G, wgrad_dims, preferred_element_type=f32)
        return dx.astype(x_RxK.dtype), dw.astype(w_GxKxN.dtype), None
    # x, w, y and dy share one dtype (grouped_dense casts w to x's)
    x_cols_q, w_q, sizes_G = residuals
    n_rows, x_dtype = dy_RxN.shape[0], dy_RxN.dtype
    x_deq = _dequantize(x_cols_q, fmt)[0, :, :n_rows].T  # [R, K]
    w_deq = _dequantize(w_q, fmt)[..., : dy_RxN.shape[1]]  # [G, K, N]
    _, dy_deq = _quantize(dy_RxN[None], fmt, gradient=True)  # along N, for the dgrad
    dx = jax.lax.ragged_dot(dy_deq[0], jnp.swapaxes(w_deq, 1, 2), sizes_G, preferred_element_type=f32)
    _, dy_cols = _quantize(dy_RxN.T[None], fmt, gradient=True)  # along the rows, for the wgrad
    dw = jax.lax.ragged_dot_general(x_deq, dy_cols[0].T, sizes_G, wgrad_dims, preferred_element_type=f32)
    return dx.astype(x_dtype), dw.astype(x_dtype), None


emulated_grouped_dense.defvjp(_emulated_fwd, _emulated_bwd)


def _quantizer_set(fmt: str, n_groups: int):
    from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode, noop_quantizer_set

    if fmt == "none":
        return noop_quantizer_set
    mode, grad_dtype = {"tensorwise": (ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e5m2),
                        "mxfp8": (ScalingMode.MXFP8_1D_SCALING, jnp.float8_e4m3fn)}[fmt]
    return QuantizerFactory.create_set(scaling_mode=mode, fwd_dtype=jnp.float8_e4m3fn, bwd_dtype=grad_dtype,
                                       is_2x2x=True, n_groups=n_groups)


def grouped_dense(x_RxK, w_GxKxN, group_sizes_G):
    """[R, N] in x's dtype: rows of group g (the next group_sizes_G[g] rows) times w[g], in the format
    `fp8.gemms_in` set (the model's body with model.fp8)."""
    fmt = fp8.active()
    if fmt not in TE_FP8_FORMATS:  # resolve.py refuses this before anything compiles
        raise ValueError(f"Transformer Engine's grouped GEMM has no {fmt!r} recipe")
    w_GxKxN = w_GxKxN.astype(x_RxK.dtype)
    if _STAND_IN.get():
        return emulated_grouped_dense(x_RxK, w_GxKxN, group_sizes_G.astype(jnp.int32), fmt)
    from transformer_engine.jax.dense import grouped_dense as te_grouped_dense

    return te_grouped_dense(x_RxK, w_GxKxN, group_sizes_G.astype(jnp.int32),
                            preferred_element_type=x_RxK.dtype,
                            quantizer_set=_quantizer_set(fmt, w_GxKxN.shape[0]))


def expert_ffn(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, group_sizes_E, *, ffn_axis=None):
    """SwiGLU over rows grouped by expert (group e: the next group_sizes_E[e] rows, each size a multiple of
    TE_ALIGN, the sizes summing to R; padding rows zero, so they come out zero). ffn_axis: the weights hold this
    device's slice of the FFN dim, partial outputs summed over that mesh axis."""
    if x_RxD.shape[0] % TE_ALIGN:
        raise ValueError(f"Transformer Engine's grouped GEMM takes rows in multiples of {TE_ALIGN}, "
                         f"got {x_RxD.shape[0]}")
    gate_RxF = checkpoint_name(grouped_dense(x_RxD, w_gate_ExDxF, group_sizes_E), EXPERT_GEMM)
    up_RxF = checkpoint_name(grouped_dense(x_RxD, w_up_ExDxF, group_sizes_E), EXPERT_GEMM)
    y_RxD = checkpoint_name(grouped_dense(jax.nn.silu(gate_RxF) * up_RxF, w_down_ExFxD, group_sizes_E), EXPERT_GEMM)
    return jax.lax.psum(y_RxD, ffn_axis) if ffn_axis else y_RxD


def equal_groups_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ffn_axis=None):
    """expert_ffn over equal groups (capacity and allgather buffers [E_local, C, D], C a multiple of TE_ALIGN)."""
    n_experts, capacity, d_model = x_ExCxD.shape
    sizes_E = jnp.full((n_experts,), capacity, jnp.int32)
    y_RxD = expert_ffn(x_ExCxD.reshape(n_experts * capacity, d_model), w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                       sizes_E, ffn_axis=ffn_axis)
    return y_RxD.reshape(n_experts, capacity, d_model)
