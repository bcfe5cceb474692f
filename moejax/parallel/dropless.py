"""Dropless expert dispatch: every routed row reaches its expert, in rounds of a static receive window.

Each device sorts its (token, k) assignments by expert, hence by destination device, and the devices exchange
their per-expert counts (int32) over `expert`. A receiver orders what it gets by source device, each source's
rows sorted by expert: its "receive order". A round moves the rows whose receive-order position falls in a
window of R rows (`moe.dropless_window` x the balanced load T*K, static, so XLA plans its buffers for R and not
for the worst case ep*T*min(K, E_local)): each sender's slice goes out with `lax.ragged_all_to_all` (on CPU a
result-identical dense emulation: XLA:CPU cannot compile the ragged op), the local experts run as one grouped
GEMM over the window, and the outputs go back the same way.

Round 0 always runs. When the mesh-wide largest receive load exceeds R (a hot expert, an untrained router,
adversarial routing), the rest runs as overflow rounds of R/4 rows in a while loop under a custom VJP that
keeps only the rounds' inputs and recomputes each round in the backward: memory of one round whatever the
load. Compute and bytes follow the load (one window for a step within it, a quarter window more per R/4 rows
of overload), memory is bounded by the window, and no row is ever dropped.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from moejax.kernels import fp8, grouped_gemm, te_gemm
from moejax.kernels.varying import int_cotangent as _int_cotangent
from moejax.parallel.mesh import EXPERT_AXIS, inside_pipeline_stage, mesh_platform, token_axes
from moejax.parallel.routing_plan import argsort_stable, combine_rows, dispatch_rows
from moejax.remat_names import EXPERT_EXCHANGE


def worst_case_rows(tokens_per_device: int, top_k: int, ep: int, n_local: int) -> int:
    """Rows one device can receive: every source sends all its rows for these experts (a token picks each expert
    at most once, so min(K, E_local) per token)."""
    return ep * tokens_per_device * min(top_k, n_local)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def window_rows(tokens_per_device: int, top_k: int, ep: int, n_local: int, window: float, multiple: int = 8) -> int:
    """Rows of round 0: `window` x the balanced load (T*K), at most the worst case (then one round always
    suffices and no overflow code is compiled), rounded up to `multiple` (the grouped GEMM's row tile)."""
    worst = worst_case_rows(tokens_per_device, top_k, ep, n_local)
    return _round_up(max(1, min(worst, math.ceil(window * tokens_per_device * top_k))), multiple)


def window_chunks(window: int, chunks: int, multiple: int = 8) -> list[tuple[int, int]]:
    """(first receive-order position, rows) of each of round 0's exchanges (moe.exchange_chunks): the window (a
    multiple of `multiple`, the grouped GEMM's row tile) split as evenly as whole tiles allow, none empty. They
    add up to the window, so overflow rounds start where they did unchunked and run as often."""
    units = window // multiple
    n = max(1, min(chunks, units))
    bounds = [multiple * (units * i // n) for i in range(n + 1)]
    bounds[-1] = window
    return [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])]


def overflow_window_rows(window: int, multiple: int = 8) -> int:
    """Rows of each overflow round: a quarter of the window, rounded up to `multiple`, so a load a little above
    the window costs a little more, not a whole second window."""
    return _round_up(-(-window // 4), multiple)


def tile_rows(window: int, n_local: int) -> int:
    """Rows per tile of the einsum and tile_loop grouped GEMMs (each expert's rows padded to whole tiles): 256
    (measured on CPU, benchmarks/moe_layer.py: 128-row tiles spend more on the per-tile weight gather, 512 on
    padding; the tile_loop at 16 experts top-4: 1.39x / 1.32x / 1.34x ideal at 128 / 256 / 512), smaller for
    small windows so the padding (< n_local tiles) stays a fraction of the window."""
    return int(min(256, max(8, -(-(window // (4 * n_local)) // 8) * 8)))


class Exchange(NamedTuple):
    """One device's view of the step's exchange (int32; P = devices on `expert`, L = local experts)."""
    input_offsets_P: jax.Array  # where my rows for device p start in my expert-sorted buffer
    send_sizes_P: jax.Array  # how many rows I send to device p
    out_offsets_P: jax.Array  # where my rows start in device p's receive order
    recv_offsets_P: jax.Array  # where source p's rows start in my receive order
    recv_sizes_P: jax.Array  # how many rows source p sends me
    recv_ends_PxL: jax.Array  # cumulative rows of source p's chunk per local expert (its rows are sorted by expert)
    return_offsets_P: jax.Array  # where source p keeps my rows in its sorted buffer (its input offset for me)


class How(NamedTuple):
    """Static facts of where the dispatch is traced, fixed when the forward is traced (custom VJP backward rules are
    traced after the model's contexts have exited): `platform` of the mesh's devices ('gpu', 'cpu', ... or None
    when the mesh carries no device: then resolved when compiled), `axes` the batch axes the rows are split over,
    `in_stage` inside pipeline stages, where the dispatch runs under the pipeline's vmap over `stage`: there jax
    cannot batch a cond (`lax.switch`, `lax.cond`, `lax.platform_dependent`) inside the dispatch shard_map, so the
    exchange is chosen from `platform` when traced, the CPU emulation pads to its largest chunk and the overflow
    rounds run without a cond around them (zero iterations when none is needed). Outside the stages none of this
    changes the program.

    Everywhere the exchange is chosen from `platform` when it is known, not by `lax.platform_dependent`: that
    lowers to an XLA conditional on a constant, which XLA:GPU does not inline when the branch holds a collective,
    so the ragged all-to-all ran alone inside it, synchronous, with nothing scheduled under it (measured on the
    scheduled DeepSeek-V3-small step for 8 H200s: the layer scan's forward exchanges)."""
    platform: str | None
    axes: tuple[str, ...]
    in_stage: bool


def trace_how() -> How:
    mesh = jax.sharding.get_abstract_mesh()
    platform = mesh_platform(mesh)
    in_stage = not mesh.empty and inside_pipeline_stage(mesh)
    if in_stage and platform is None:
        raise ValueError("dropless dispatch inside pipeline stages needs the mesh's device platform (a mesh of "
                         "devices under jax.set_mesh); the abstract mesh here names none")
    return How(platform, token_axes(), in_stage)


def _excl_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _swap(x, ep):
    """Row p of x goes to device p; row p of the result came from device p (ep = 1: unchanged)."""
    return jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0) if ep > 1 else x


def plan_exchange(counts_E, ep: int) -> Exchange:
    counts_PxL = counts_E.reshape(ep, -1)
    send_P = counts_PxL.sum(axis=1)
    input_offsets_P = _excl_cumsum(send_P)
    recv_counts_PxL = _swap(counts_PxL, ep)
    recv_P = recv_counts_PxL.sum(axis=1)
    recv_offsets_P = _excl_cumsum(recv_P)
    out_offsets_P, return_offsets_P = _swap(jnp.stack([recv_offsets_P, input_offsets_P]).T, ep).T
    recv_ends_PxL = jnp.cumsum(recv_counts_PxL, axis=1)
    return Exchange(input_offsets_P, send_P, out_offsets_P, recv_offsets_P, recv_P, recv_ends_PxL, return_offsets_P)


def _emulated_ragged_all_to_all(rows_NxD, input_offsets, send_sizes, recv_at, recv_sizes, out_rows: int,
                                chunk: int):
    """What `lax.ragged_all_to_all` computes into a zero buffer, from a dense all_to_all of chunks padded to
    `chunk` rows (>= every send size). Row j of the chunk for device d is rows[input_offsets[d] + j]; on device d
    it lands at recv_at[me] + j: recv_at is the receiver's own view of where each source's rows go (the
    sender's output_offsets as the receiver knows them already, so no collective carries them); output rows
    nothing lands on are zero."""
    n_rows, d_model = rows_NxD.shape
    ep = send_sizes.shape[0]
    j = jnp.arange(chunk, dtype=jnp.int32)
    src = jnp.where(j[None, :] < send_sizes[:, None], input_offsets[:, None] + j[None, :], n_rows)
    chunks_PxCxD = jnp.take(rows_NxD, src, axis=0, mode="fill", fill_value=0)
    got_PxCxD = jax.lax.all_to_all(chunks_PxCxD, EXPERT_AXIS, 0, 0)  # [source, chunk, D]
    r = jnp.arange(out_rows, dtype=jnp.int32)
    inside_PxR = (r[None, :] >= recv_at[:, None]) & (r[None, :] < recv_at[:, None] + recv_sizes[:, None])
    source_R = jnp.argmax(inside_PxR, axis=0)
    flat_R = jnp.where(jnp.any(inside_PxR, axis=0), source_R * chunk + r - recv_at[source_R], ep * chunk)
    return jnp.take(got_PxCxD.reshape(ep * chunk, d_model), flat_R, axis=0, mode="fill", fill_value=0)


def emulation_chunks(n_rows: int, out_rows: int, ep: int) -> tuple[int, ...]:
    """Static chunk sizes of the CPU emulation, smallest first: 1.25 x an even split of what one exchange can move
    (the sender's rows, or the receiver's window when smaller: an overflow round's quarter window), doubling up
    to the most one pair can move (min(n_rows, out_rows)). Each exchange pads to the smallest that holds the
    mesh-wide largest send, so a balanced step moves about 1.25 x its rows, not ep x, and an overflow round
    about 1.25 x its window, not a whole round's chunks."""
    most = min(n_rows, out_rows)
    sizes, size = [], -(-(5 * most) // (4 * ep * 8)) * 8
    while size < most:
        sizes.append(size)
        size *= 2
    return (*sizes, most)


def _emulated(rows_NxD, input_offsets, send_sizes, recv_at, recv_sizes, largest, out_rows: int, how: How):
    """largest: the mesh-wide largest send of this exchange (both trips of a round share it: the same pairs)."""
    chunks = emulation_chunks(rows_NxD.shape[0], out_rows, send_sizes.shape[0])
    args = (rows_NxD, input_offsets, send_sizes, recv_at, recv_sizes)
    if len(chunks) == 1 or how.in_stage:  # no switch under the pipeline's vmap (How)
        return _emulated_ragged_all_to_all(*args, out_rows, chunks[-1])
    # Every device of the mesh takes the same branch (collectives inside): the largest send decides.
    pick = jnp.sum(largest > jnp.asarray(chunks[:-1], jnp.int32))
    branches = [functools.partial(_emulated_ragged_all_to_all, out_rows=out_rows, chunk=c) for c in chunks]
    return jax.lax.switch(pick, branches, *args)


def largest_send(send_sizes_P, how: How):
    """The mesh-wide largest pair size of a round (int32 scalar, the same for its return trip): what the CPU
    emulation pads its chunks to. One pmax per round, shared by both trips forward and backward; only on CPU
    (zero in a program lowered for another platform, which never reads it) and never inside pipeline stages (no
    switch there)."""
    if how.in_stage:
        return jnp.int32(0)

    def mesh_max(send):
        return jax.lax.pmax(jnp.max(send), how.axes)

    if how.platform is not None:  # no conditional in the program (How)
        return mesh_max(send_sizes_P) if how.platform == "cpu" else jnp.int32(0)
    return jax.lax.platform_dependent(send_sizes_P, cpu=mesh_max, default=lambda send: jnp.int32(0))


def ragged_exchange(rows_NxD, input_offsets, send_sizes, output_offsets, recv_sizes, out_rows: int, how: How,
                    recv_at, largest):
    """`lax.ragged_all_to_all` over `expert` into a zero [out_rows, D] buffer (emulated on CPU: XLA:CPU cannot
    compile the ragged op; recv_at and largest are what the emulation takes instead of the output offsets and a
    collective to pick its chunk size: `_emulated`). The mesh's device platform decides when traced (How); a mesh
    that names no device resolves it when lowered (`lax.platform_dependent`)."""

    def native(rows, in_off, send, out_off, recv, at, big):
        # The output buffer varies over the batch axes like the rows (shard_map's check_vma typing).
        out = jax.lax.pcast(jnp.zeros((out_rows, rows.shape[-1]), rows.dtype), how.axes, to="varying")
        return jax.lax.ragged_all_to_all(rows, out, in_off, send, out_off, recv, axis_name=EXPERT_AXIS)

    def emulated(rows, in_off, send, out_off, recv, at, big):
        return _emulated(rows, in_off, send, at, recv, big, out_rows, how)

    args = (rows_NxD, input_offsets, send_sizes, output_offsets, recv_sizes, recv_at, largest)
    if how.platform is None:
        return jax.lax.platform_dependent(*args, cpu=emulated, default=native)
    return emulated(*args) if how.platform == "cpu" else native(*args)


def _local_copy(rows_NxD, input_offset, size, output_offset, out_rows: int):
    """The one-device exchange: rows[input_offset + i] -> out[output_offset + i] for i < size, zeros elsewhere."""
    r = jnp.arange(out_rows, dtype=jnp.int32)
    i = r - output_offset
    src = jnp.where((i >= 0) & (i < size), input_offset + i, rows_NxD.shape[0])
    return jnp.take(rows_NxD, src, axis=0, mode="fill", fill_value=0)


class Moves(NamedTuple):
    """One direction of an exchange, int32 [P]: what `lax.ragged_all_to_all` takes."""
    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _exchange(rows_NxD, there: Moves, back: Moves, largest, out_rows: int, ep: int, how: How):
    """Rows moved as `there` says into a zero [out_rows, D] buffer. `back` is the same rows' return trip (the
    receivers' offsets: where each source's rows land, as the receiver knows it), and the transpose: the
    cotangent goes back as rows would, a gather (the emulation's autodiff would scatter-add). largest: the round's
    largest_send."""
    if ep > 1:
        return ragged_exchange(rows_NxD, *there, out_rows, how, recv_at=back.input_offsets, largest=largest)
    return _local_copy(rows_NxD, there.input_offsets[0], there.send_sizes[0], there.output_offsets[0], out_rows)


def _exchange_fwd(rows_NxD, there, back, largest, out_rows, ep, how):
    return (_exchange(rows_NxD, there, back, largest, out_rows, ep, how),
            (there, back, largest, jnp.zeros((rows_NxD.shape[0], 0), jnp.int8)))


def _exchange_bwd(out_rows, ep, how, residuals, d_out):
    there, back, largest, like_Nx0 = residuals  # like_Nx0: the input's row count
    return (_exchange(d_out, back, there, largest, like_Nx0.shape[0], ep, how), jax.tree.map(_int_cotangent, there),
            jax.tree.map(_int_cotangent, back), _int_cotangent(largest))


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _count_at_most(sorted_N, v_M, in_stage: bool):
    """[M] int32: how many of sorted_N are <= each v (jnp.searchsorted(side='right')). Inside pipeline stages by
    compare and count: jax's searchsorted (every method, jax 0.10-0.12) mis-types its result's varying mesh axes
    under the pipeline's vmap over stages inside the dispatch shard_map. Elsewhere searchsorted itself: XLA:CPU
    kept the compare's [M, N] intermediates (+17% peak memory on a dropless test program)."""
    if in_stage:
        return grouped_gemm.count_at_most(sorted_N, v_M)
    return jnp.searchsorted(sorted_N, v_M, side="right").astype(jnp.int32)


def _tile_plan(expert_R, n_local: int, tile: int, n_slots: int, in_stage: bool):
    """Rows grouped by expert, each expert's group padded to whole tiles: (slot_R, src_S, tile_expert_N, n_used):
    the tiles holding rows are the first n_used. expert_R == n_local marks an empty window row (no slot)."""
    n_rows = expert_R.shape[0]
    counts_L = jnp.bincount(expert_R, length=n_local + 1)[:n_local].astype(jnp.int32)
    starts = _excl_cumsum(jnp.concatenate([counts_L, jnp.zeros((1,), jnp.int32)]))  # [L + 1]
    padded_start = _excl_cumsum(jnp.concatenate([(counts_L + tile - 1) // tile * tile, jnp.zeros((1,), jnp.int32)]))
    order_R = argsort_stable(expert_R)
    e_sorted = expert_R[order_R]
    rank_sorted = jnp.arange(n_rows, dtype=jnp.int32) - starts[e_sorted]
    slot_sorted = jnp.where(e_sorted < n_local, padded_start[e_sorted] + rank_sorted, n_slots)
    slot_R = slot_sorted[argsort_stable(order_R)].astype(jnp.int32)  # inverse permutation by sort, not scatter
    s = jnp.arange(n_slots, dtype=jnp.int32)
    group_S = jnp.clip(_count_at_most(padded_start[:n_local], s, in_stage) - 1, 0, n_local - 1)
    rank_S = s - padded_start[group_S]
    filled = rank_S < counts_L[group_S]
    src_S = jnp.where(filled, order_R[jnp.minimum(starts[group_S] + rank_S, n_rows - 1)], n_rows).astype(jnp.int32)
    return slot_R, src_S, group_S[::tile], padded_start[n_local] // tile


def window_expert_ffn(x_RxD, expert_R, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, gemm: str, ffn_axis,
                      in_stage: bool = False):
    """The local experts' SwiGLU over a window of rows in any order; expert_R == n_local rows come out zero.
    in_stage: traced inside pipeline stages (How)."""
    n_rows, n_local = x_RxD.shape[0], w_gate_ExDxF.shape[0]
    # Outputs go back to window order by dispatch_rows through the inverse permutation: a gather both ways that,
    # unlike a weighted combine, keeps no copy of the outputs for the backward.
    if gemm in ("ragged_dot", "tokamax"):
        # Rows sorted by expert, one ragged grouped GEMM over the window: the kernel skips no row, pads none.
        order_R = argsort_stable(expert_R)
        rank_R = argsort_stable(order_R)
        sorted_RxD = dispatch_rows(x_RxD, rank_R, order_R, 1)
        sizes_L = jnp.bincount(expert_R, length=n_local + 1)[:n_local].astype(jnp.int32)
        y_RxD = grouped_gemm.ragged_expert_ffn(sorted_RxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, sizes_L,
                                               kernel=gemm, ffn_axis=ffn_axis)
        return dispatch_rows(y_RxD, order_R, rank_R, 1)
    # einsum: block-diagonal tiles (megablox-style), each expert's rows padded to whole tiles, so the work is the
    # window plus under one tile per expert, not every expert padded to the window. te: the same layout with
    # 128-row tiles, as Transformer Engine's grouped GEMM takes it (each group a multiple of 128 rows, the sizes
    # summing to the slots: the tiles past the load belong to the last expert, zero rows that come out zero).
    tile = grouped_gemm.row_multiple(gemm) if gemm == "te" else tile_rows(n_rows, n_local)
    n_slots = -(-(n_rows + n_local * (tile - 1)) // tile) * tile
    slot_R, src_S, tile_expert_N, n_used = _tile_plan(expert_R, n_local, tile, n_slots, in_stage)
    weights = (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    if gemm == "te":
        sizes_L = jnp.bincount(tile_expert_N, length=n_local).astype(jnp.int32) * tile
        y_SxD = te_gemm.expert_ffn(dispatch_rows(x_RxD, slot_R, src_S, 1), *weights, sizes_L, ffn_axis=ffn_axis)
        return dispatch_rows(y_SxD, src_S, slot_R, 1)
    if gemm == "tile_loop":  # only the n_used tiles that hold rows, gathered by the loop: the work follows the load
        return grouped_gemm.looped_expert_ffn(x_RxD, src_S, tile_expert_N, n_used, *weights, ffn_axis=ffn_axis)
    x_NxMxD = dispatch_rows(x_RxD, slot_R, src_S, 1).reshape(n_slots // tile, tile, -1)
    y_NxMxD = grouped_gemm.tiled_expert_ffn(x_NxMxD, tile_expert_N, *weights, ffn_axis=ffn_axis)
    return dispatch_rows(y_NxMxD.reshape(n_slots, -1), src_S, slot_R, 1)


def _round(lo, rows_AxD, w_gate, w_up, w_down, ex: Exchange, *, window: int, ep: int, gemm: str, ffn_axis, how: How):
    """One round: the rows in receive-order positions [lo, lo + window) of every receiver, through their experts
    and back. Returns [A, D]: those rows' outputs at their places in the sender's sorted buffer, zero elsewhere."""
    n_assign = rows_AxD.shape[0]
    n_local = w_gate.shape[0]
    # Sender: the part of my chunk for device p that falls in p's window.
    a_P = jnp.clip(lo - ex.out_offsets_P, 0, ex.send_sizes_P)
    b_P = jnp.clip(lo + window - ex.out_offsets_P, 0, ex.send_sizes_P)
    # Receiver: the part of source p's chunk that falls in my window (the same rows, seen from here).
    c_P = jnp.clip(lo - ex.recv_offsets_P, 0, ex.recv_sizes_P)
    d_P = jnp.clip(lo + window - ex.recv_offsets_P, 0, ex.recv_sizes_P)
    # There: my rows for p from my buffer to p's window. Back: p's window rows from source q to q's buffer.
    there = Moves(ex.input_offsets_P + a_P, b_P - a_P, ex.out_offsets_P + a_P - lo, d_P - c_P)
    back = Moves(ex.recv_offsets_P + c_P - lo, d_P - c_P, ex.return_offsets_P + c_P, b_P - a_P)
    largest = largest_send(there.send_sizes, how) if ep > 1 else jnp.int32(0)
    x_WxD = checkpoint_name(_exchange(rows_AxD, there, back, largest, window, ep, how), EXPERT_EXCHANGE)
    # Each window row's local expert: source p's rows are sorted by expert, ending at recv_ends_PxL[p].
    g_W = lo + jnp.arange(window, dtype=jnp.int32)
    source_W = jnp.clip(_count_at_most(ex.recv_offsets_P, g_W, how.in_stage) - 1, 0, ep - 1)
    pos_W = g_W - ex.recv_offsets_P[source_W]
    expert_W = jnp.sum(pos_W[:, None] >= ex.recv_ends_PxL[source_W], axis=1).astype(jnp.int32)
    expert_W = jnp.where(pos_W < ex.recv_sizes_P[source_W], expert_W, n_local)
    y_WxD = window_expert_ffn(x_WxD, expert_W, w_gate, w_up, w_down, gemm=gemm, ffn_axis=ffn_axis,
                              in_stage=how.in_stage)
    return checkpoint_name(_exchange(y_WxD, back, there, largest, n_assign, ep, how), EXPERT_EXCHANGE)


def _overflow_round(static, r, *round_args):
    """Overflow round r >= 1: receive-order positions from first + (r - 1) x window. The FP8 format the forward
    was traced with is part of `static`: the backward re-traces the round outside the model's `fp8.gemms_in`."""
    kw = dict(static)
    first, fmt = kw.pop("first"), kw.pop("fp8")
    with fp8.gemms_in(fmt):
        return _round(first + (r - 1) * kw["window"], *round_args, **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overflow_rounds(static, n_rounds, rows_AxD, w_gate, w_up, w_down, ex: Exchange):
    """Overflow rounds 1..n_rounds-1 summed (each fills different rows). Memory of one round: the forward keeps only
    the inputs, the backward recomputes one round at a time."""
    def body(r, acc):
        return acc + _overflow_round(static, r, rows_AxD, w_gate, w_up, w_down, ex)

    return jax.lax.fori_loop(_one_like(n_rounds), n_rounds, body, jnp.zeros_like(rows_AxD))


def _one_like(n_rounds):
    """1, computed from n_rounds: under the pipeline's vmap over stages the loop bounds then are both batched (a
    constant lower bound is not, and jax refuses the mixed varying-axes compare in the batched loop)."""
    return n_rounds - n_rounds + 1


def _overflow_fwd(static, n_rounds, rows_AxD, w_gate, w_up, w_down, ex):
    out = _overflow_rounds(static, n_rounds, rows_AxD, w_gate, w_up, w_down, ex)
    return out, (n_rounds, rows_AxD, w_gate, w_up, w_down, ex)


def _overflow_bwd(static, residuals, dy_AxD):
    n_rounds, rows_AxD, w_gate, w_up, w_down, ex = residuals

    def body(r, grads):
        _, vjp = jax.vjp(lambda *p: _overflow_round(static, r, *p, ex), rows_AxD, w_gate, w_up, w_down)
        return tuple(g + d for g, d in zip(grads, vjp(dy_AxD)))

    zeros = tuple(jnp.zeros_like(p) for p in (rows_AxD, w_gate, w_up, w_down))
    grads = jax.lax.fori_loop(_one_like(n_rounds), n_rounds, body, zeros)
    return (_int_cotangent(n_rounds), *grads, jax.tree.map(_int_cotangent, ex))


_overflow_rounds.defvjp(_overflow_fwd, _overflow_bwd)


def dropless_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, n_experts: int,
                 ep: int, window: int, gemm: str, ffn_axis, collective: bool, chunks: int = 1):
    """Routed-expert output [T, D] and (mesh-wide int32 expert counts, rounds run). `window`: rows per round.

    chunks (moe.exchange_chunks): round 0 runs as that many exchanges of a slice of the receive order each
    (window_chunks): independent of one another, so XLA's scheduler can run one chunk's exchange under another's
    expert GEMMs (forward and backward). Every row still goes through the same expert once and the chunks fill
    different rows, so the result is the unchunked layer's; counts, overflow rounds and the round count are
    unchanged."""
    n_tokens, top_k = expert_idx_TxK.shape
    n_local = n_experts // ep
    how = trace_how()
    expert_A = expert_idx_TxK.reshape(-1).astype(jnp.int32)
    order_A = argsort_stable(expert_A)
    rank_A = argsort_stable(order_A)  # assignment -> its row in sorted order
    rows_AxD = dispatch_rows(x_TxD, rank_A, order_A, top_k)
    counts_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)
    ex = plan_exchange(counts_E, ep)
    y_AxD = None
    for lo, rows in window_chunks(window, chunks, grouped_gemm.row_multiple(gemm)):
        y_c = _round(lo, rows_AxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, ex, window=rows, ep=ep, gemm=gemm,
                     ffn_axis=ffn_axis, how=how)
        y_AxD = y_c if y_AxD is None else y_AxD + y_c
    n_rounds = jnp.int32(1)  # a window of the worst case always suffices: no overflow code, no pmax
    if window < worst_case_rows(n_tokens, top_k, ep, n_local):
        # Every device of the mesh runs the same number of rounds (collectives inside): the largest load decides.
        need = jnp.sum(ex.recv_sizes_P)
        if collective:
            need = jax.lax.pmax(need, how.axes)
        # Overflow rounds take a quarter window each: an overload a little above the window costs a little more.
        overflow_window = overflow_window_rows(window, grouped_gemm.row_multiple(gemm))
        n_rounds = 1 + jnp.maximum(need - window + overflow_window - 1, 0) // overflow_window
        static = (("first", window), ("window", overflow_window), ("ep", ep), ("gemm", gemm), ("ffn_axis", ffn_axis),
                  ("fp8", fp8.active()), ("how", how))
        if how.in_stage:  # no cond under the pipeline's vmap (How): the loop runs zero rounds when none is needed
            y_AxD = y_AxD + _overflow_rounds(static, n_rounds, rows_AxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, ex)
        else:
            y_AxD = y_AxD + jax.lax.cond(
                n_rounds > 1,
                lambda *a: _overflow_rounds(static, *a),
                lambda n, rows, *_: jnp.zeros_like(rows),
                n_rounds, rows_AxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, ex)
    out_TxD = combine_rows(y_AxD, expert_w_TxK, rank_A, order_A)
    return out_TxD, counts_E, n_rounds
