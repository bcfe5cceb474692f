"""The routed experts' SwiGLU FFN as a grouped GEMM, by the kernel `kernels.expert_gemm` names (resolve.py):

  einsum      a batched einsum over [E_local, C, D] expert-major buffers with equal groups: one GEMM per expert,
              no wasted work (cuBLAS batched GEMM on GPU). Ragged (dropless) groups run as block-diagonal tiles
              (`tiled_expert_ffn`): each expert's rows padded to whole tiles, each tile multiplied by its
              expert's weights, so the work is the rows present plus under one tile per expert.
  ragged_dot  `lax.ragged_dot` over rows sorted by expert. XLA:CPU runs it as a masked dense matmul over all
              groups (E times the work) and XLA:GPU rewrites it into dense dots too, so it is refused on GPU;
              on CPU it is the reference for the ragged path.
  tile_loop   ragged (dropless) groups as the same block-diagonal tiles, multiplied in a while loop that runs
              only the tiles holding rows (`looped_expert_ffn`): the work follows the step's load, not the
              receive window (XLA:CPU, where a loop iteration costs microseconds; dropless on CPU). Equal groups
              (capacity, allgather) run as `einsum`.
  te          NVIDIA Transformer Engine's grouped GEMM (te_gemm.py): bf16, or FP8 by model.fp8 (tensorwise on
              Hopper, MXFP8 on Blackwell) in the forward and both backward GEMMs; rows grouped by expert with each
              group padded to 128 rows by the dispatch's layout.
  tokamax     tokamax's grouped GEMM (`tokamax.ragged_dot`, Mosaic GPU kernels for sm90 / sm100): work in
              proportion to the rows present, for dropless dispatch. The forward and the input gradient are
              tokamax kernels on both; the weight gradient (each expert's x^T dy, the ragged dim contracted) is
              tokamax's sm90 kernel on Hopper, and on Blackwell, where tokamax 0.0.17 has no kernel for that
              form, batched GEMMs over 256-row tiles in chunks (`tiled_weight_grad`).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from moejax.kernels import fp8
from moejax.kernels import te_gemm
from moejax.kernels.resolve import TE_ALIGN, TOKAMAX_GEMM_TILE
from moejax.kernels.varying import cotangent as _cotangent
from moejax.kernels.varying import int_cotangent as _int_cotangent
from moejax.kernels.varying import mark_varying as _mark_varying
from moejax.kernels.varying import varying as _varying
from moejax.kernels.varying import varying_union as _varying_union
from moejax.remat_names import EXPERT_GEMM


def row_multiple(kernel: str) -> int:
    """Rows a grouped GEMM's row buffers are a multiple of (te: each group's rows, capacity's C included)."""
    return {"tokamax": TOKAMAX_GEMM_TILE, "te": TE_ALIGN}.get(kernel, 8)


# tokamax's implementation: its Mosaic GPU kernel. Explicit, so tokamax skips its default-device check, which a
# deviceless GPU compile (a CPU process) would fail. Tests set "xla" (tokamax's reference, runs on CPU).
TOKAMAX_IMPLEMENTATION = "mosaic"


def _tokamax(x_RxD, w_ExDxF, group_sizes_E):
    import tokamax  # optional: the `gpu` extra

    return tokamax.ragged_dot(x_RxD, w_ExDxF, group_sizes_E, implementation=TOKAMAX_IMPLEMENTATION)


# How the tokamax path computes the weight gradient: "auto" (tokamax's kernel where it has one for the
# ragged-contracting form, sm90; tiles on Blackwell, compute capability 10.x, and anywhere tokamax has none),
# "kernel" or "tiles". Tests set "tiles" to run the Blackwell path on CPU.
TOKAMAX_WEIGHT_GRAD = "auto"
# Rows per tile of the tiled weight gradient: each expert's rows padded to whole tiles (padding < one tile per
# expert); x^T dy of one tile is a [D, tile] x [tile, F] GEMM, so the tile is also the GEMM's contraction length.
WEIGHT_GRAD_TILE = 256


def _default_compute_capability() -> float | None:
    """The compute capability of the device being traced for (a deviceless compile's compile-only GPU too: jax's
    default device, the one tokamax picks its sm90/sm100 kernels by)."""
    from jax.extend import backend

    device = backend.get_default_device()
    cc = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return None if cc is None else float(cc)


def tokamax_weight_grad_form() -> str:
    """'kernel' or 'tiles': how the tokamax path's weight gradient runs where this is traced."""
    if TOKAMAX_WEIGHT_GRAD != "auto":
        return TOKAMAX_WEIGHT_GRAD
    cc = _default_compute_capability()
    return "tiles" if cc is not None and cc >= 10 else "kernel"


def count_at_most(sorted_N, v_M):
    """[M] int32: how many of sorted_N are <= each v, by compare and count ([M, N] compares: for small N; jax's
    searchsorted mis-types varying axes under the pipeline's vmap, dropless._count_at_most)."""
    return jnp.sum(v_M[:, None] >= sorted_N[None, :], axis=1, dtype=jnp.int32)


def tiled_weight_grad(x_RxD, dy_RxF, group_sizes_E, *, tile: int = WEIGHT_GRAD_TILE):
    """[E, D, F] f32: each group's x^T dy over rows sorted by group (group e owns the next group_sizes_E[e] rows;
    rows past the groups are ignored), as batched GEMMs: each group's rows padded to whole tiles, one [D, tile] x
    [tile, F] GEMM per tile, the tiles' products summed into their group's gradient by a one-hot GEMM (E/(2 tile)
    of the GEMMs' own work). A loop over chunks of E tiles runs only the chunks holding rows, so the work follows
    the load and the transient is one chunk's products: E x D x F in f32, the size of the gradient itself (all
    tiles at once would be a per-tile weight-sized copy for every tile of the window)."""
    n_rows, d_model = x_RxD.shape
    n_groups, d_out = group_sizes_E.shape[0], dy_RxF.shape[1]
    sizes_E = group_sizes_E.astype(jnp.int32)
    zero = jnp.zeros((1,), jnp.int32)
    starts_E = jnp.cumsum(jnp.concatenate([zero, sizes_E[:-1]]))
    padded_E = (sizes_E + tile - 1) // tile * tile
    padded_start_E = jnp.cumsum(jnp.concatenate([zero, padded_E[:-1]]))
    chunk = n_groups  # tiles per loop iteration
    n_chunks = -(-jnp.sum(padded_E) // (tile * chunk))

    def body(c, acc_ExDxF):
        slot_S = c * chunk * tile + jnp.arange(chunk * tile, dtype=jnp.int32)
        group_S = jnp.clip(count_at_most(padded_start_E, slot_S) - 1, 0, n_groups - 1)
        rank_S = slot_S - padded_start_E[group_S]
        src_S = jnp.where(rank_S < sizes_E[group_S], starts_E[group_S] + rank_S, n_rows)  # n_rows: a zero row
        x_CxMxD, dy_CxMxF = (jnp.take(a, src_S, axis=0, mode="fill", fill_value=0).reshape(chunk, tile, -1)
                             for a in (x_RxD, dy_RxF))
        g_CxDxF = jnp.einsum("cmd,cmf->cdf", x_CxMxD, dy_CxMxF, preferred_element_type=jnp.float32)
        one_hot_CxE = jax.nn.one_hot(group_S[::tile], n_groups, dtype=jnp.float32)
        return acc_ExDxF + jnp.einsum("ce,cdf->edf", one_hot_CxE, g_CxDxF)

    init = _mark_varying(jnp.zeros((n_groups, d_model, d_out), jnp.float32),
                         _varying_union(x_RxD, dy_RxF, group_sizes_E))
    return jax.lax.fori_loop(0, n_chunks, body, init)


def _tokamax_weight_grad(x_RxD, dy_RxF, group_sizes_E):
    """[E, D, F]: each group's x^T dy, contracting its own rows (tokamax's ragged dot over the ragged dim, or the
    tiled GEMMs where tokamax has no kernel for that form)."""
    if tokamax_weight_grad_form() == "tiles":
        return tiled_weight_grad(x_RxD, dy_RxF, group_sizes_E)
    import tokamax

    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return tokamax.ragged_dot_general(x_RxD, dy_RxF, group_sizes_E, dims, implementation=TOKAMAX_IMPLEMENTATION)


@jax.custom_vjp
def _tokamax_ragged_dot(x_RxD, w_ExDxF, group_sizes_E):
    return _mark_varying(_tokamax(x_RxD, w_ExDxF, group_sizes_E), _varying(x_RxD) | _varying(w_ExDxF))


def _tokamax_fwd(x_RxD, w_ExDxF, group_sizes_E):
    return _tokamax_ragged_dot(x_RxD, w_ExDxF, group_sizes_E), (x_RxD, w_ExDxF, group_sizes_E)


def _tokamax_bwd(residuals, dy_RxF):
    x_RxD, w_ExDxF, group_sizes_E = residuals
    dx_RxD = _tokamax(dy_RxF, jnp.swapaxes(w_ExDxF, 1, 2), group_sizes_E).astype(x_RxD.dtype)
    dw_ExDxF = _tokamax_weight_grad(x_RxD, dy_RxF, group_sizes_E).astype(w_ExDxF.dtype)
    d_sizes = _int_cotangent(group_sizes_E)
    return (_cotangent(dx_RxD, _varying(dy_RxF) | _varying(w_ExDxF), x_RxD),
            _cotangent(dw_ExDxF, _varying(x_RxD) | _varying(dy_RxF), w_ExDxF), d_sizes)


_tokamax_ragged_dot.defvjp(_tokamax_fwd, _tokamax_bwd)


def _ragged_dot_fn(kernel: str):
    if kernel == "tokamax":
        return _tokamax_ragged_dot
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot
    raise ValueError(f"kernel {kernel!r} is not a ragged grouped GEMM")


def ragged_expert_ffn(x_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, group_sizes_E, *, kernel: str, ffn_axis=None):
    """SwiGLU FFN over rows sorted by expert, expert e owning the next group_sizes_E[e] rows; rows past
    the groups come out zero. ffn_axis as in expert_ffn."""
    if fp8.active() != "none":  # resolve.py refuses this combination before anything compiles
        raise ValueError(f"expert GEMM kernel {kernel!r} has no FP8 path; FP8 expert GEMMs use kernel 'einsum'")
    dot = _ragged_dot_fn(kernel)
    gate_RxF = checkpoint_name(dot(x_RxD, w_gate_ExDxF, group_sizes_E), EXPERT_GEMM)
    up_RxF = checkpoint_name(dot(x_RxD, w_up_ExDxF, group_sizes_E), EXPERT_GEMM)
    y = checkpoint_name(dot(jax.nn.silu(gate_RxF) * up_RxF, w_down_ExFxD, group_sizes_E), EXPERT_GEMM)
    return jax.lax.psum(y, ffn_axis) if ffn_axis else y


def _einsum_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    gate_ExCxF = checkpoint_name(fp8.einsum("ecd,edf->ecf", x_ExCxD, w_gate_ExDxF), EXPERT_GEMM)
    up_ExCxF = checkpoint_name(fp8.einsum("ecd,edf->ecf", x_ExCxD, w_up_ExDxF), EXPERT_GEMM)
    return checkpoint_name(fp8.einsum("ecf,efd->ecd", jax.nn.silu(gate_ExCxF) * up_ExCxF, w_down_ExFxD), EXPERT_GEMM)


@jax.custom_vjp
def _tile_weights(w_ExAxB, tile_expert_N):
    """[N, A, B]: each tile's expert's weights. Its transpose sums the tiles' gradients per expert as a one-hot
    matmul (N x E x A x B multiply-adds: E_local / tile rows of the GEMMs' own work) instead of autodiff's
    scatter-add."""
    return jnp.take(w_ExAxB, tile_expert_N, axis=0, mode="clip")  # indices are in range: no masking select


def _tile_weights_fwd(w_ExAxB, tile_expert_N):
    return _tile_weights(w_ExAxB, tile_expert_N), (tile_expert_N, w_ExAxB[:, :0, 0])


def _tile_weights_bwd(residuals, d_w_NxAxB):
    tile_expert_N, like_Ex0 = residuals  # the weights' expert count, dtype and shard_map type
    one_hot_NxE = jax.nn.one_hot(tile_expert_N, like_Ex0.shape[0], dtype=d_w_NxAxB.dtype)
    d_w = _cotangent(jnp.einsum("ne,nab->eab", one_hot_NxE, d_w_NxAxB), frozenset(), like_Ex0).astype(like_Ex0.dtype)
    return d_w, _int_cotangent(tile_expert_N)


_tile_weights.defvjp(_tile_weights_fwd, _tile_weights_bwd)


def tiled_expert_ffn(x_NxMxD, tile_expert_N, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ffn_axis=None):
    """SwiGLU of N tiles of M rows, tile n through expert tile_expert_N[n]'s weights (megablox's block-diagonal
    grouped GEMM as a batched einsum). The per-tile weight gather reads D x F per M rows (M/2 FLOPs per byte
    at M = 128: the GEMM, not the gather, bounds it); its transpose sums the tiles' weight gradients per
    expert."""
    w_gate_NxDxF, w_up_NxDxF, w_down_NxFxD = (_tile_weights(w, tile_expert_N)
                                              for w in (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD))
    y_NxMxD = _einsum_ffn(x_NxMxD, w_gate_NxDxF, w_up_NxDxF, w_down_NxFxD)
    return jax.lax.psum(y_NxMxD, ffn_axis) if ffn_axis else y_NxMxD


def _rows_of_tile(src_S, n, tile):
    return jax.lax.dynamic_slice_in_dim(src_S, n * tile, tile)


@jax.custom_vjp
def _looped_ffn(x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    return _looped_fwd(x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)[0]


def _looped_fwd(x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Tiles 0 .. n_used-1 through their experts: each tile gathers its rows (src_S; n_rows marks padding),
    and its outputs land back on those rows; rows in no used tile come out zero. Keeps the gate and up
    projections (slot order) for the backward, as autodiff of the einsum path keeps them."""
    n_rows, d_model = x_RxD.shape
    n_slots = src_S.shape[0]
    tile = n_slots // tile_expert_N.shape[0]
    d_ff = w_gate_ExDxF.shape[2]

    def body(n, carry):
        y_RxD, gate_SxF, up_SxF = carry
        e, at, rows_M = tile_expert_N[n], n * tile, _rows_of_tile(src_S, n, tile)
        x_MxD = jnp.take(x_RxD, rows_M, axis=0, mode="fill", fill_value=0)
        gate_MxF, up_MxF = x_MxD @ w_gate_ExDxF[e], x_MxD @ w_up_ExDxF[e]
        y_MxD = (jax.nn.silu(gate_MxF) * up_MxF) @ w_down_ExFxD[e]
        return (y_RxD.at[rows_M].set(y_MxD, mode="drop", unique_indices=True),
                jax.lax.dynamic_update_slice_in_dim(gate_SxF, gate_MxF, at, 0),
                jax.lax.dynamic_update_slice_in_dim(up_SxF, up_MxF, at, 0))

    # Loop carries are typed like everything the body mixes into them (shard_map's varying axes).
    axes = _varying_union(x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    zeros = tuple(_mark_varying(jnp.zeros(shape, x_RxD.dtype), axes)
                  for shape in ((n_rows, d_model), (n_slots, d_ff), (n_slots, d_ff)))
    y_RxD, gate_SxF, up_SxF = jax.lax.fori_loop(0, n_used, body, zeros)
    return y_RxD, (x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, gate_SxF, up_SxF)


def _looped_bwd(residuals, dy_RxD):
    x_RxD, src_S, tile_expert_N, n_used, w_gate, w_up, w_down, gate_SxF, up_SxF = residuals
    tile = src_S.shape[0] // tile_expert_N.shape[0]
    f32 = jnp.float32

    def body(n, carry):
        dx_RxD, d_w_gate, d_w_up, d_w_down = carry
        e, at, rows_M = tile_expert_N[n], n * tile, _rows_of_tile(src_S, n, tile)
        x_MxD, dy_MxD = (jnp.take(a, rows_M, axis=0, mode="fill", fill_value=0) for a in (x_RxD, dy_RxD))
        gate_MxF, up_MxF = (jax.lax.dynamic_slice_in_dim(a, at, tile) for a in (gate_SxF, up_SxF))
        sig_MxF = jax.nn.sigmoid(gate_MxF)
        silu_MxF = gate_MxF * sig_MxF
        dh_MxF = dy_MxD @ w_down[e].T
        d_gate_MxF = dh_MxF * up_MxF * sig_MxF * (1 + gate_MxF * (1 - sig_MxF))  # silu'(g) = s (1 + g (1 - s))
        d_up_MxF = dh_MxF * silu_MxF
        dx_MxD = d_gate_MxF @ w_gate[e].T + d_up_MxF @ w_up[e].T
        # Weight gradients accumulate over an expert's tiles in f32 (bf16 weights too).
        d_w_down = d_w_down.at[e].add(jnp.matmul((silu_MxF * up_MxF).T, dy_MxD, preferred_element_type=f32))
        d_w_gate = d_w_gate.at[e].add(jnp.matmul(x_MxD.T, d_gate_MxF, preferred_element_type=f32))
        d_w_up = d_w_up.at[e].add(jnp.matmul(x_MxD.T, d_up_MxF, preferred_element_type=f32))
        return dx_RxD.at[rows_M].set(dx_MxD, mode="drop", unique_indices=True), d_w_gate, d_w_up, d_w_down

    axes = _varying_union(x_RxD, src_S, tile_expert_N, n_used, w_gate, w_up, w_down, dy_RxD)
    init = tuple(_mark_varying(jnp.zeros(a.shape, dtype), axes)
                 for a, dtype in ((x_RxD, x_RxD.dtype), (w_gate, f32), (w_up, f32), (w_down, f32)))
    dx_RxD, d_w_gate, d_w_up, d_w_down = jax.lax.fori_loop(0, n_used, body, init)
    return (_cotangent(dx_RxD, axes, x_RxD), *(_int_cotangent(a) for a in (src_S, tile_expert_N, n_used)),
            *(_cotangent(d.astype(w.dtype), axes, w) for d, w in ((d_w_gate, w_gate), (d_w_up, w_up),
                                                                  (d_w_down, w_down))))


_looped_ffn.defvjp(_looped_fwd, _looped_bwd)


def looped_expert_ffn(x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ffn_axis=None):
    """SwiGLU of rows in any order through the block-diagonal tiles of `tiled_expert_ffn`: slot s of the tiles
    holds row src_S[s] (n_rows: padding), tile n goes through expert tile_expert_N[n]'s weights, and a while
    loop runs only the first n_used tiles (the ones holding rows), gathering each tile's rows and putting its
    outputs back on them: no tile past the load, no per-tile weight copies, no slot-order copy of the rows.
    Rows in no tile come out zero. The backward is one more loop over the same tiles (its weight gradients
    summed per expert in place)."""
    if fp8.active() != "none":  # resolve.py refuses this combination before anything compiles
        raise ValueError("expert GEMM kernel 'tile_loop' has no FP8 path; FP8 expert GEMMs use kernel 'einsum'")
    y_RxD = _looped_ffn(x_RxD, src_S, tile_expert_N, n_used, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    return jax.lax.psum(y_RxD, ffn_axis) if ffn_axis else y_RxD


def expert_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, kernel: str, ffn_axis=None):
    """SwiGLU FFN of each local expert applied to its own C rows (equal groups). With ffn_axis, the weights hold
    this device's slice of the FFN dim, and the partial outputs are summed over that mesh axis."""
    if kernel in ("einsum", "tile_loop"):  # equal groups: one batched GEMM, nothing for a loop to skip
        y_ExCxD = _einsum_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
        return jax.lax.psum(y_ExCxD, ffn_axis) if ffn_axis else y_ExCxD
    if kernel == "te":
        return te_gemm.equal_groups_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, ffn_axis=ffn_axis)
    n_experts, capacity, d_model = x_ExCxD.shape
    group_sizes_E = jnp.full((n_experts,), capacity, dtype=jnp.int32)
    y_RxD = ragged_expert_ffn(x_ExCxD.reshape(n_experts * capacity, d_model), w_gate_ExDxF, w_up_ExDxF,
                              w_down_ExFxD, group_sizes_E, kernel=kernel, ffn_axis=ffn_axis)
    return y_RxD.reshape(n_experts, capacity, d_model)
