"""Interleaved 1F1B pipeline schedule with an explicit backward, in one SPMD program (the circular pipeline's GSPMD
design, parallel/pipeline.py: a leading stage dim split over the stage axis, each tick's stage function under
`jax.vmap(spmd_axis_name=axis)`, `jnp.roll` along the stage dim for the hand-offs).

Order (Megatron's interleaved 1F1B): micro-batches go through the chunks in groups of S (the stage count). Forward
item i = g V S + r S + j is micro-batch m = g S + j in chunk r S + s (repeat r) on stage s, at tick i + s: the last
stage's output of repeat r reaches stage 0 exactly when it takes repeat r + 1 (no wait buffer). At the end of the
round in which the last stage finishes group g (ticks [S - 1 + g V S, S - 1 + (g + 1) V S)), the head (final norm,
MTP, LM head, loss) runs on the group's S micro-batches, one per stage, and its gradient is the cotangent that the
backward takes into the last chunk. Backward item i' = g V S + r' S + j is the same micro-batch in chunk
(V - 1 - r') S + s, at tick T0 + i' + S - 1 - s (T0 = V S + S - 1): the cotangents run round the ring the other way.
In the steady state each tick runs one forward and one backward (of other micro-batches, independent of each other:
one's expert exchange and hand-off can run under the other's GEMMs); the ticks before the first backward run forwards
only and those after the last forward backwards only, so the bubble is (S - 1) / (M V) of the step, paid once.

Each forward keeps its chunk's residuals (a `jax.vjp` of the chunk under the layers' remat policy: their inputs and
what the policy saves; never the weights, which the backward re-selects) in one of K slots (residual_slot_table:
V S + 2 S - 2 in the steady state) until its backward: live activations are bounded by the stages and virtual
stages, not by the micro-batches. The gradients are accumulated in the loop's carry. M not a multiple of S pads the last group with copies of the first
micro-batches whose loss weight is zero.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.parallel.one_f_one_b_tables import residual_slot_table, schedule_ticks_1f1b, tick_runs
from moejax.parallel.pipeline import _index


def _inexact(tree):
    """(the leaves of `tree` that have a gradient, a function that puts new ones back in their places)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]

    def rebuild(diff):
        out = list(leaves)
        for i, leaf in zip(where, diff):
            out[i] = leaf
        return jax.tree.unflatten(treedef, out)

    return [leaves[i] for i in where], rebuild


def cast_floating(tree, dtype):
    """Each floating leaf of `tree` in `dtype` (the others, an uneven split's slot masks, as they are)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _cotangent(primal, ct):
    """The cotangent a vjp takes for `primal`: `ct` where primal is inexact, float0 zeros where it is an integer."""
    def one(p, c):
        if jnp.issubdtype(p.dtype, jnp.inexact):
            return c.astype(p.dtype)
        return np.zeros(p.shape, jax.dtypes.float0)
    return jax.tree.map(one, primal, ct)


def one_f_one_b(stage_fn: Callable, params_VxSxC, x_MxB, *, mesh, axis: str, n_repeats: int, side_MxB,
                chunk_policy, head_fn: Callable, head_params, head_side_MxB, aux_cotangent: Callable,
                last_slot_VxS=None, weights_dtype=None):
    """The pipeline's forward and backward, and the head's, for one pass of M micro-batches.

    stage_fn(chunk, x_B, side_B) -> (y_B, aux): one chunk of layers (as parallel/pipeline.circular_pipeline's).
    head_fn(head_params, y_B, head_side_B, aux_all) -> (J, (metrics, shared)): the scalar objective of one micro-batch
    given its last chunk's output (the caller's loss weights included); aux_all is that micro-batch's aux of every
    chunk ([V, S, ...] leaves), `metrics` are kept per micro-batch and returned, `shared` is handed to
    aux_cotangent(chunk, aux_chunk, shared) -> the cotangent of a chunk's aux output (J's dependence on it).
    chunk_policy: the jax.checkpoint policy a forward's kept residuals follow (None: keep everything).
    last_slot_VxS: [V, S] bool, whether each chunk's last slot holds a layer (an uneven split's chunks end in an
    identity slot; every leaf of a chunk has the slots as its leading dim), or None: every chunk's does. With
    identity last slots, ticks at which no stage needs its last slot skip it (skip_last_slot).
    weights_dtype: the dtype the weights are stored in when the caller differentiates their f32 values
    (optim.master_weights), or None. The schedule then holds params and head_params in it (the cast folds into the
    caller's upcast: no f32 copy of the stage's weights) and takes each chunk's and head's vjp at f32, so the
    gradients are f32, accumulated in f32, without ever being rounded to the stored dtype.

    Returns (J summed over the micro-batches, (d params_VxSxC, d head_params, d x_MxB), aux_VxSxMx..., metrics_Mx...).
    """
    n_stages = mesh.shape[axis]
    n_micro = x_MxB.shape[0]
    n_groups = -(-n_micro // n_stages)
    n_pad = n_groups * n_stages
    n_items = n_pad * n_repeats
    round_ticks = n_repeats * n_stages
    slot_SxI, n_slots = residual_slot_table(n_stages, n_pad, n_repeats)
    slot_SxI = jnp.asarray(slot_SxI)
    t_back = round_ticks + n_stages - 1  # T0: the last stage's first backward
    stage_S = jnp.arange(n_stages, dtype=jnp.int32)
    by_stage = functools.partial(jax.vmap, spmd_axis_name=axis)

    def split(a, dim=0):
        spec = [P.UNCONSTRAINED] * a.ndim
        spec[dim] = axis
        return lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    wide_params_VxSxC, wide_head_params = params_VxSxC, head_params  # the primals: the gradients take their dtypes
    if weights_dtype is not None:
        params_VxSxC, head_params = cast_floating((params_VxSxC, head_params), weights_dtype)
    widen = (lambda tree: tree) if weights_dtype is None else (lambda tree: cast_floating(tree, jnp.float32))

    take = np.arange(n_pad) % n_micro  # padded micro-batches: copies of the first, weight 0
    x_MxB, side_MxB, head_side_MxB = jax.tree.map(lambda a: a[take], (x_MxB, side_MxB, head_side_MxB))
    real_M = jnp.asarray(np.arange(n_pad) < n_micro, jnp.float32)

    chunk_fn = stage_fn if chunk_policy is None else jax.checkpoint(stage_fn, policy=chunk_policy, prevent_cse=False)
    vjp_layout = {}
    n_chunk_slots = jax.tree.leaves(params_VxSxC)[0].shape[2]
    skipping = last_slot_VxS is not None and not np.all(last_slot_VxS)
    # With identity last slots a chunk runs as two pieces, its first C - 1 slots and its last, each its own vjp, so
    # a tick can leave the last out (statically: the ticks are split into runs that need it or not).
    pieces = ((slice(0, n_chunk_slots - 1), slice(n_chunk_slots - 1, n_chunk_slots)) if skipping
              else (slice(0, n_chunk_slots),))

    def piece(tree, k):
        return jax.tree.map(lambda a: a[pieces[k]], tree)

    def like_piece(tree, k):
        n = len(range(n_chunk_slots)[pieces[k]])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype), tree)

    def forward(chunk, x_B, side_B, key=0):
        """One piece's forward: (y, aux, the residuals its backward needs, the chunk's weights left out)."""
        diff, rebuild = _inexact(chunk)
        diff = widen(diff)
        (y_B, aux), vjp = jax.vjp(lambda d, x: chunk_fn(rebuild(d), x, side_B), diff, x_B)
        leaves, treedef = jax.tree.flatten(vjp)
        # The weights are the chunk's own arrays among the vjp's residuals (the checkpoint saves its inputs as they
        # are): kept out of the per-item buffer, the backward puts the re-selected chunk back in their places.
        weight_at = [next((k for k, w in enumerate(diff) if w is leaf), -1) for leaf in leaves]
        vjp_layout.setdefault(key, (treedef, weight_at))
        return y_B, aux, [leaf for leaf, k in zip(leaves, weight_at) if k < 0]

    def backward(chunk, res, ct_y, ct_aux, y_like, aux_like, key=0):
        diff, _ = _inexact(chunk)
        diff = widen(diff)
        treedef, weight_at = vjp_layout[key]
        rest = iter(res)
        vjp = jax.tree.unflatten(treedef, [diff[k] if k >= 0 else next(rest) for k in weight_at])
        d_diff, dx = vjp((ct_y.astype(y_like.dtype), _cotangent(aux_like, ct_aux)))
        return d_diff, dx

    def chunk_forward(chunk, x_B, side_B, last=True):
        """A chunk's forward, piece by piece; last=False leaves the last piece out (an identity slot on every
        stage at this tick): its aux zeros, its residuals None (their slots not written)."""
        y_B, aux, res = forward(piece(chunk, 0), x_B, side_B, 0)
        if not skipping:
            return y_B, aux, res
        if last:
            y_B, aux_last, res_last = forward(piece(chunk, 1), y_B, side_B, 1)
        else:
            aux_last, res_last = jax.tree.map(lambda a: jnp.zeros_like(a[:1]), aux), None
        return y_B, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), aux, aux_last), (res, res_last)

    def chunk_backward(chunk, res, ct_y, ct_aux, last=True):
        if not skipping:
            return backward(chunk, res, ct_y, ct_aux, y_like, aux_like)
        res_first, res_last = res
        if last:
            d_last, ct_y = backward(piece(chunk, 1), res_last, ct_y, piece(ct_aux, 1), y_like, like_piece(aux_like, 1),
                                    1)
        else:
            d_last = [jnp.zeros(a.shape, a.dtype) for a in _inexact(piece(chunk, 1))[0]]
        d_first, dx = backward(piece(chunk, 0), res_first, ct_y, piece(ct_aux, 0), y_like, like_piece(aux_like, 0),
                               0)
        return [jnp.concatenate([a, b]) for a, b in zip(d_first, d_last)], dx

    # The vjp's layout is taken from a trace under the stages' vmap, as the ticks run it: a shard_map's residual
    # specs name every mesh axis but the vmap's spmd axis, so one traced outside the vmap would not batch.
    def per_stage(shape, dtype):
        return jax.ShapeDtypeStruct((n_stages, *shape), dtype)

    chunk_S = jax.tree.map(lambda a: per_stage(a.shape[2:], a.dtype), params_VxSxC)
    x_S = per_stage(x_MxB.shape[1:], x_MxB.dtype)
    side_S = jax.tree.map(lambda a: per_stage(a.shape[1:], a.dtype), side_MxB)
    y_like, aux_like, res_like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                              jax.eval_shape(by_stage(chunk_forward), chunk_S, x_S, side_S))
    n_first = len(res_like[0]) if skipping else len(res_like)
    res_like = [*res_like[0], *res_like[1]] if skipping else res_like
    diff_like, _ = _inexact(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), wide_params_VxSxC))

    def select(tree_VxSxC, r_S):
        """Each stage's chunk of repeat r (dim 1 split over the stage axis)."""
        if n_repeats == 1:
            return jax.tree.map(lambda a: a[0], tree_VxSxC)
        return by_stage(lambda t, r: jax.tree.map(lambda a: _index(a, r), t), in_axes=(1, 0))(tree_VxSxC, r_S)

    def put(buf, value, idx, on):
        """buf[idx] = value where `on` (one stage's row; buf's leading dim indexed)."""
        return jnp.where(on, lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), idx, 0), buf)

    def coords(item_S):
        """(busy, repeat slot r of the order, j, micro-batch m, clipped item) of items g V S + r S + j."""
        busy = (item_S >= 0) & (item_S < n_items)
        item = jnp.clip(item_S, 0, n_items - 1)
        g, rest = item // round_ticks, item % round_ticks
        r, j = rest // n_stages, rest % n_stages
        return busy, r, j, g * n_stages + j, item

    def zeros_S(like, *lead):
        return jax.tree.map(lambda a: split(jnp.zeros((n_stages, *lead, *a.shape), a.dtype)), like)

    # ---- one tick's forward and backward
    x_SxM = split(jnp.broadcast_to(x_MxB[None], (n_stages, *x_MxB.shape)))  # read by stage 0 only

    def forward_tick(carry, t, last=True):
        state_SxB, res_SxK, aux_VxS, fin_SxS = carry
        busy, r, j, m, item = coords(t - stage_S)
        first = (stage_S == 0) & (r == 0)
        in_SxB = split(by_stage(lambda x_M, mm, f, s: jnp.where(f, _index(x_M, mm), s))(x_SxM, m, first, state_SxB))
        side_SxB = jax.tree.map(lambda a: split(a[m]), side_MxB)
        y_SxB, aux_S, res_S = by_stage(functools.partial(chunk_forward, last=last))(
            select(params_VxSxC, r), in_SxB, side_SxB)
        y_SxB = split(y_SxB)
        slot = slot_SxI[stage_S, item]
        if skipping:  # a skipped last piece leaves its slots as they were (a backward that runs it masks them out)
            res_S = res_S[0] + (res_S[1] if last else [None] * (len(res_SxK) - n_first))
        res_SxK = [buf if v is None else split(by_stage(put)(buf, v, slot, busy)) for buf, v in zip(res_SxK, res_S)]
        aux_VxS = jax.tree.map(lambda buf, a: by_stage(
            lambda b, v, rr, mm, on: put(b, put(_index(b, rr), v, mm, on), rr, on), in_axes=(1, 0, 0, 0, 0),
            out_axes=1)(buf, a, r, m, busy), aux_VxS, aux_S)
        done = busy & (stage_S == n_stages - 1) & (r == n_repeats - 1)
        fin_SxS = split(by_stage(put)(fin_SxS, y_SxB, j, done))
        return (split(jnp.roll(y_SxB, 1, axis=0)), res_SxK, aux_VxS, fin_SxS)

    def backward_tick(carry, t, res_SxK, aux_VxS, shared_M, last=True):
        ct_SxB, dy_SxS, grads_VxS, dx_SxM = carry
        busy, rb, j, m, item = coords(t - t_back - (n_stages - 1 - stage_S))
        r = n_repeats - 1 - rb  # the chunk's repeat
        from_head = (stage_S == n_stages - 1) & (rb == 0)
        ct_SxB = split(by_stage(lambda d, jj, h, c: jnp.where(h, _index(d, jj), c))(dy_SxS, j, from_head, ct_SxB))
        slot = slot_SxI[stage_S, item + (r - rb) * n_stages]  # the same micro-batch's forward in this chunk
        res_S = [split(by_stage(_index)(buf, slot)) for buf in res_SxK]
        res_S = (res_S[:n_first], res_S[n_first:]) if skipping else res_S
        aux_S = jax.tree.map(lambda buf: by_stage(lambda b, rr, mm: _index(_index(b, rr), mm), in_axes=(1, 0, 0))(
            buf, r, m), aux_VxS)
        shared_S = jax.tree.map(lambda a: split(a[m]), shared_M)
        chunk_S = select(params_VxSxC, r)
        ct_aux_S = by_stage(lambda c, a, s, w: jax.tree.map(lambda x: x * w, aux_cotangent(c, a, s)))(
            chunk_S, aux_S, shared_S, real_M[m])
        d_S, dx_SxB = by_stage(functools.partial(chunk_backward, last=last))(chunk_S, res_S, ct_SxB, ct_aux_S)
        d_S = jax.tree.map(lambda d: jnp.where(busy.reshape(-1, *[1] * (d.ndim - 1)), d, 0), d_S)
        if n_repeats == 1:
            grads_VxS = [g.at[0].add(d) for g, d in zip(grads_VxS, d_S)]
        else:
            grads_VxS = [by_stage(lambda g, dd, rr: lax.dynamic_update_index_in_dim(g, _index(g, rr) + dd, rr, 0),
                                  in_axes=(1, 0, 0), out_axes=1)(g, d, r) for g, d in zip(grads_VxS, d_S)]
        dx_SxB = split(dx_SxB)
        dx_SxM = split(by_stage(put)(dx_SxM, dx_SxB, m, busy & (stage_S == 0) & (r == 0)))
        return (split(jnp.roll(dx_SxB, -1, axis=0)), dy_SxS, grads_VxS, dx_SxM)

    # ---- the head of group g: the last stage's S finished micro-batches, one per stage
    def head(head_carry, g, fin_SxS, aux_VxS):
        head_grads_S, objective_S, metrics_SxG, shared_M = head_carry
        # Stage j takes micro-batch g S + j: the last stage's output j moves to stage j (a roll of one slot each).
        y_SxB = by_stage(lambda rows, s: _index(rows, s), in_axes=(1, 0))(
            jnp.stack([split(jnp.roll(fin_SxS[:, k], (k + 1) % n_stages, axis=0)) for k in range(n_stages)]), stage_S)
        y_SxB = split(y_SxB)
        micro_S = g * n_stages + stage_S
        side_S = jax.tree.map(lambda a: split(lax.dynamic_slice_in_dim(a, g * n_stages, n_stages)), head_side_MxB)
        aux_all_S = jax.tree.map(lambda a: split(jnp.moveaxis(
            lax.dynamic_slice_in_dim(a, g * n_stages, n_stages, axis=2), 2, 0)), aux_VxS)
        real_S = lax.dynamic_slice_in_dim(real_M, g * n_stages, n_stages)

        def one(params, y, side, aux_all, real):
            (objective, (metrics, shared)), (d_params, dy) = jax.value_and_grad(
                lambda p, yy: (lambda o: (o[0] * real, o[1]))(head_fn(p, yy, side, aux_all)), argnums=(0, 1),
                has_aux=True)(widen(params), y)
            return objective, metrics, shared, d_params, dy

        objective_g, metrics_g, shared_g, d_params_S, dy_SxB = by_stage(one, in_axes=(None, 0, 0, 0, 0))(
            head_params, y_SxB, side_S, aux_all_S, real_S)
        head_grads_S = jax.tree.map(jnp.add, head_grads_S, d_params_S)
        metrics_SxG = jax.tree.map(lambda buf, v: by_stage(lambda b, vv: lax.dynamic_update_index_in_dim(
            b, vv, g, 0))(buf, v), metrics_SxG, metrics_g)
        # What every stage's backward needs of these micro-batches (tiny): to every stage.
        shared_M = jax.tree.map(lambda buf, v: lax.dynamic_update_slice_in_dim(
            buf, lax.with_sharding_constraint(v, NamedSharding(mesh, P())), g * n_stages, 0), shared_M, shared_g)
        # The cotangents go to the last stage: dy of micro-batch j from stage j (a roll each).
        dy_SxB = split(dy_SxB)
        dy_SxS = split(jnp.stack([jnp.roll(dy_SxB, n_stages - 1 - k, axis=0) for k in range(n_stages)], axis=1))
        return (head_grads_S, objective_S + objective_g, metrics_SxG, shared_M), dy_SxS

    # ---- buffers
    res_SxK = [split(jnp.zeros((n_stages, n_slots, *a.shape), a.dtype)) for a in res_like]
    aux_VxS = jax.tree.map(lambda a: jnp.zeros((n_repeats, n_stages, n_pad, *a.shape), a.dtype), aux_like)
    fin_SxS = zeros_S(y_like, n_stages)
    f_carry = (split(jnp.zeros((n_stages, *y_like.shape), y_like.dtype)), res_SxK, aux_VxS, fin_SxS)
    grads_VxS = [split(jnp.zeros((n_repeats, n_stages, *a.shape), a.dtype), 1) for a in diff_like]
    b_carry = (zeros_S(y_like), zeros_S(y_like, n_stages), grads_VxS, zeros_S(y_like, n_pad))
    head_like = jax.eval_shape(lambda p, y, s, a: head_fn(p, y, s, a)[1], head_params, y_like,
                               jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), head_side_MxB),
                               jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], a.shape[1], *a.shape[3:]),
                                                                           a.dtype), aux_VxS))
    metrics_like, shared_like = head_like
    head_carry = (jax.tree.map(lambda a: split(jnp.zeros((n_stages, *a.shape), a.dtype)), wide_head_params),
                  split(jnp.zeros((n_stages,), jnp.float32)), zeros_S(metrics_like, n_groups),
                  jax.tree.map(lambda a: jnp.zeros((n_pad, *a.shape), a.dtype), shared_like))

    edge, middle = schedule_ticks_1f1b(n_stages, n_pad, n_repeats)
    ticks = functools.partial(jnp.arange, dtype=jnp.int32)

    def scan_ticks(body, carry, start, n):
        return lax.scan(lambda c, t: (body(c, t), None), carry, start + ticks(n))[0]

    # Each loop in runs of ticks with equal needs of an uneven split's last slot (tick_runs), a scan each.
    warm_up_runs, round_runs, cool_down_runs = tick_runs(n_stages, n_pad, n_repeats, last_slot_VxS)

    # Warm-up: forwards only, through the last stage's round of group 0; then group 0's head.
    for t0, n, need in warm_up_runs:
        f_carry = scan_ticks(functools.partial(forward_tick, last=bool(need)), f_carry, t0, n)
    head_carry, dy_SxS = head(head_carry, 0, f_carry[3], f_carry[2])
    b_carry = (b_carry[0], dy_SxS, *b_carry[2:])

    # Steady state: round g (g = 1 .. G - 1) runs V S ticks of one forward and one backward each, then group g's head.
    def round_g(carry, g):
        f_carry, b_carry, head_carry = carry

        def tick(c, t, last_f, last_b):
            fc, bc = c
            bc = backward_tick(bc, t, fc[1], fc[2], head_carry[3], last=last_b)
            return (forward_tick(fc, t, last=last_f), bc)

        for k0, n, (last_f, last_b) in round_runs:
            f_carry, b_carry = scan_ticks(functools.partial(tick, last_f=last_f, last_b=last_b), (f_carry, b_carry),
                                          edge + (g - 1) * round_ticks + k0, n)
        head_carry, dy_SxS = head(head_carry, g, f_carry[3], f_carry[2])
        return (f_carry, (b_carry[0], dy_SxS, *b_carry[2:]), head_carry), None

    if middle:
        (f_carry, b_carry, head_carry), _ = lax.scan(round_g, (f_carry, b_carry, head_carry),
                                                     jnp.arange(1, n_groups, dtype=jnp.int32))
    # Cool-down: backwards only.
    for t0, n, need in cool_down_runs:
        b_carry = scan_ticks(functools.partial(backward_tick, res_SxK=f_carry[1], aux_VxS=f_carry[2],
                                               shared_M=head_carry[3], last=bool(need)), b_carry, t0, n)

    _, _, grads_VxS, dx_SxM = b_carry
    head_grads_S, objective_S, metrics_SxG, _ = head_carry
    diff_params, rebuild = _inexact(wide_params_VxSxC)
    d_params = jax.tree.map(  # integer leaves (an uneven split's slot mask) take float0 zeros
        lambda d, p: d if jnp.issubdtype(p.dtype, jnp.inexact) else np.zeros(p.shape, jax.dtypes.float0),
        rebuild([g.astype(p.dtype) for g, p in zip(grads_VxS, diff_params)]), wide_params_VxSxC)
    d_head = jax.tree.map(lambda a: jnp.sum(a, axis=0), head_grads_S)  # each stage's heads, summed over the stages
    d_x = dx_SxM[0][:n_micro]
    aux_VxSxM = jax.tree.map(lambda a: a[:, :, :n_micro], f_carry[2])
    metrics_M = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(n_pad, *a.shape[2:])[:n_micro], metrics_SxG)
    return jnp.sum(objective_S), (d_params, d_head, d_x), aux_VxSxM, metrics_M
