"""Grouped matmul backends for the routed experts' SwiGLU FFN on expert-major, capacity-padded buffers.

Buffers arrive as [E_local, C, D]: each local expert owns C padded rows. Two backends compute the same thing:
  einsum      a batched einsum over the expert dim: one GEMM per expert, no wasted work (fast on CPU).
  ragged_dot  `lax.ragged_dot` over the flattened rows with equal group sizes; XLA:CPU runs it as a dense
              masked matmul over all groups (E times the work), and XLA:GPU rewrites it into dense dots too
              (seen in a deviceless H200 compile): a fused grouped GEMM needs a kernel library (tokamax).
`auto` picks einsum for padded buffers: every group has the same size, so the batched einsum is the
grouped GEMM. Dropless dispatch has ragged groups: there `auto` means a ragged grouped matmul on GPU/TPU
(tokamax's kernel when that package is installed, else `lax.ragged_dot`) and the padded einsum on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def resolve_backend(backend: str, *, ragged_groups: bool = False) -> str:
    if backend != "auto":
        return backend
    if ragged_groups and jax.devices()[0].platform in ("gpu", "tpu"):
        return "ragged_dot"
    return "einsum"


def _ragged_dot_impl():
    """tokamax's fused grouped matmul where installed (GPU), else XLA's ragged_dot."""
    if jax.devices()[0].platform == "gpu":
        try:
            import tokamax  # optional: pip install tokamax

            return tokamax.ragged_dot
        except ImportError:
            pass
    return jax.lax.ragged_dot


def ragged_expert_ffn(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, group_sizes_E, *, ffn_axis=None):
    """SwiGLU FFN over rows sorted by expert, expert e owning the next group_sizes_E[e] rows; rows past
    the groups come out zero. ffn_axis as in expert_ffn."""
    dot = _ragged_dot_impl()
    gate_RxF = dot(x_RxD, w_gate_ExDxF, group_sizes_E)
    up_RxF = dot(x_RxD, w_up_ExDxF, group_sizes_E)
    y = dot(jax.nn.silu(gate_RxF) * up_RxF, w_down_ExFxD, group_sizes_E)
    return jax.lax.psum(y, ffn_axis) if ffn_axis else y


def _einsum_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    gate_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w_gate_ExDxF)
    up_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w_up_ExDxF)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate_ExCxF) * up_ExCxF, w_down_ExFxD)


def _ragged_dot_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    n_experts, capacity, d_model = x_ExCxD.shape
    group_sizes_E = jnp.full((n_experts,), capacity, dtype=jnp.int32)
    y_RxD = ragged_expert_ffn(x_ExCxD.reshape(n_experts * capacity, d_model), w_gate_ExDxF, w_up_ExDxF,
                              w_down_ExFxD, group_sizes_E)
    return y_RxD.reshape(n_experts, capacity, d_model)


_BACKENDS = {"einsum": _einsum_ffn, "ragged_dot": _ragged_dot_ffn}


def expert_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, backend: str = "auto", ffn_axis=None):
    """SwiGLU FFN of each local expert applied to its own rows. With ffn_axis, the weights hold this
    device's slice of the FFN dim, and the partial outputs are summed over that mesh axis."""
    y = _BACKENDS[resolve_backend(backend)](x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    return jax.lax.psum(y, ffn_axis) if ffn_axis else y
