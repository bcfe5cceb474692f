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

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from moejax.kernels import fp8
from moejax.kernels.resolve import TE_ALIGN, TE_FP8_FORMATS
from moejax.remat_names import EXPERT_GEMM

# "te": Transformer Engine's grouped_dense. "reference": lax.ragged_dot with the same contract (rows grouped,
# sizes summing to the rows), so tests run the dispatch's TE layout on CPU, where TE does not run.
IMPLEMENTATION = "te"


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
    if IMPLEMENTATION == "reference":
        return jax.lax.ragged_dot(x_RxK, w_GxKxN, group_sizes_G, preferred_element_type=jnp.float32).astype(x_RxK.dtype)
    from transformer_engine.jax.dense import grouped_dense as te_grouped_dense

    return te_grouped_dense(x_RxK, w_GxKxN, group_sizes_G.astype(jnp.int32),
                            preferred_element_type=x_RxK.dtype,
                            quantizer_set=_quantizer_set(fmt, w_GxKxN.shape[0]))


def expert_ffn(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, group_sizes_E, *, ffn_axis=None):
    """SwiGLU over rows grouped by expert (group e: the next group_sizes_E[e] rows, each size a multiple of
    TE_ALIGN, the sizes summing to R; padding rows zero, so they come out zero). ffn_axis: the weights hold this
    device's slice of the FFN dim, partial outputs summed over that mesh axis."""
    if x_RxD.shape[0] % TE_ALIGN:
        raise ValueError(f"Transformer Engine's grouped GEMM takes rows in multiples of {TE_ALIGN}, got {x_RxD.shape[0]}")
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
