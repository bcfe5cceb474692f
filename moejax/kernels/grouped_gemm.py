"""The routed experts' SwiGLU FFN as a grouped GEMM, by the kernel `kernels.expert_gemm` names (resolve.py):

  einsum      a batched einsum over [E_local, C, D] expert-major buffers with equal groups: one GEMM per expert,
              no wasted work (cuBLAS batched GEMM on GPU). Ragged (dropless) groups are padded to the bound.
  ragged_dot  `lax.ragged_dot` over rows sorted by expert. XLA:CPU runs it as a masked dense matmul over all
              groups (E times the work) and XLA:GPU rewrites it into dense dots too, so it is refused on GPU;
              on CPU it is the reference for the ragged path.
  tokamax     tokamax's grouped GEMM (`tokamax.ragged_dot`, Mosaic GPU kernels for sm90 / sm100): work in
              proportion to the rows present, for dropless dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _tokamax_ragged_dot(x_RxD, w_ExDxF, group_sizes_E):
    import tokamax  # optional: the `gpu` extra

    # Explicit implementation: tokamax then skips its default-device check, which a deviceless GPU compile
    # (a CPU process) would fail; "mosaic" is its Mosaic GPU kernel on NVIDIA devices.
    return tokamax.ragged_dot(x_RxD, w_ExDxF, group_sizes_E, implementation="mosaic")


def _ragged_dot_fn(kernel: str):
    if kernel == "tokamax":
        return _tokamax_ragged_dot
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot
    raise ValueError(f"kernel {kernel!r} is not a ragged grouped GEMM")


def ragged_expert_ffn(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, group_sizes_E, *, kernel: str, ffn_axis=None):
    """SwiGLU FFN over rows sorted by expert, expert e owning the next group_sizes_E[e] rows; rows past
    the groups come out zero. ffn_axis as in expert_ffn."""
    dot = _ragged_dot_fn(kernel)
    gate_RxF = dot(x_RxD, w_gate_ExDxF, group_sizes_E)
    up_RxF = dot(x_RxD, w_up_ExDxF, group_sizes_E)
    y = dot(jax.nn.silu(gate_RxF) * up_RxF, w_down_ExFxD, group_sizes_E)
    return jax.lax.psum(y, ffn_axis) if ffn_axis else y


def _einsum_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    gate_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w_gate_ExDxF)
    up_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w_up_ExDxF)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate_ExCxF) * up_ExCxF, w_down_ExFxD)


def expert_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, kernel: str, ffn_axis=None):
    """SwiGLU FFN of each local expert applied to its own C rows (equal groups). With ffn_axis, the weights hold
    this device's slice of the FFN dim, and the partial outputs are summed over that mesh axis."""
    if kernel == "einsum":
        y_ExCxD = _einsum_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
        return jax.lax.psum(y_ExCxD, ffn_axis) if ffn_axis else y_ExCxD
    n_experts, capacity, d_model = x_ExCxD.shape
    group_sizes_E = jnp.full((n_experts,), capacity, dtype=jnp.int32)
    y_RxD = ragged_expert_ffn(x_ExCxD.reshape(n_experts * capacity, d_model), w_gate_ExDxF, w_up_ExDxF,
                              w_down_ExFxD, group_sizes_E, kernel=kernel, ffn_axis=ffn_axis)
    return y_RxD.reshape(n_experts, capacity, d_model)
