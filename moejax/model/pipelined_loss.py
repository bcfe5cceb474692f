"""The training objective of a pipelined model under the 1F1B schedule (mesh.pipeline_schedule=1f1b,
parallel/one_f_one_b.py): the same value and gradients as model/loss.lm_loss, with the backward interleaved with
the forward, so the loss must be computed inside the schedule, one micro-batch at a time.

Where the loss runs: the head (final norm, the MTP modules, the LM head and cross-entropy) of a micro-batch runs
when the last stage has finished it, on one stage per micro-batch of the group of S the last stage has just
finished (stage j takes micro-batch g S + j), so the stages share the head's work as the outside parts share
theirs in the circular schedule, and no stage computes a head it does not need. Its gradient is the cotangent the
backward takes into the last chunk. The embedding and dense layers before the stages are differentiated by JAX as
usual, through the pipeline input's cotangent.

The objective is a weighted sum that gradient accumulation over passes can use as it is:
w_ce x cross-entropy + sum_k w_mtp[k] x MTP cross-entropy k + w_aux x balance losses, each a mean over the pass
(lm_loss's total is w = (1, mtp_weight / D, 1)). Per micro-batch m that is w_ce share_m ce_m + ... + w_aux / M
aux_m, share_m its share of the pass's targets, aux_m its balance losses (each micro-batch's batch-wise term over
its own rows, as lm_loss computes them per micro-batch for a pipelined model): the sum over m is lm_loss's value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.kernels import fp8
from moejax.model.loss import (LossParts, batch_balance_loss, head_ce, micro_batch_balance, target_mask,
                               valid_targets_H)
from moejax.model.moe import MoEStats
from moejax.model.layer_stack import _tick_policy
from moejax.model.transformer import ACT_BxLxD, _stack_stats, shift_left
from moejax.parallel.mesh import constrain, current_mesh, inside_stage
from moejax.parallel.one_f_one_b import one_f_one_b
from moejax.parallel.pipeline import micro_batches, slot_is_layer


def uses_1f1b(model) -> bool:
    return bool(getattr(model, "pipelined", False)) and getattr(model, "pipeline_schedule", "circular") == "1f1b"


def _zero_cotangent(tree):
    return jax.tree.map(lambda a: (jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.inexact)
                                   else np.zeros(a.shape, jax.dtypes.float0)), tree)


def pipelined_loss(model, tokens_BxL1, segment_ids_BxL1=None, *, weights):
    """(objective, LossParts) of one pass. weights = (w_ce, w_mtp [D], w_aux) (scalars or arrays, no gradient)."""
    mesh = current_mesh()
    n_micro, n_mtp = model.micro_batches, len(model.mtp)
    segments_BxL1 = jnp.zeros_like(tokens_BxL1) if segment_ids_BxL1 is None else segment_ids_BxL1
    with fp8.gemms_in(model.fp8):
        # The dense layers before the stages run on the whole pass, and their backward waits for the whole
        # schedule: what they keep is kept for every micro-batch at once. Under any remat policy they keep only
        # their inputs (`full`): a few layers' recompute for 1F1B's bound on live activations.
        x_BxLxD, positions_BxL, segments = model.pipeline_input(
            tokens_BxL1[:, :-1], None if segment_ids_BxL1 is None else segment_ids_BxL1[:, :-1],
            remat="full" if model.remat != "none" else "none")
    w_ce, w_mtp_D, w_aux = (jnp.asarray(w, jnp.float32) for w in weights)
    tokens_MxBxL1, segments_MxBxL1 = micro_batches(tokens_BxL1, n_micro), micro_batches(segments_BxL1, n_micro)
    counts_MxH = jax.vmap(lambda seg: valid_targets_H(seg, 1 + n_mtp))(segments_MxBxL1)
    share_MxH = counts_MxH / jnp.maximum(jnp.sum(counts_MxH, axis=0), 1.0)

    coef = float(model.moe_layers.ffn.batch_aux_loss_coef)
    stack_layout = model.stack_layout
    n_rows = model.n_moe + (n_mtp if _mtp_has_moe(model) else 0)  # rows of the batch-wise balance loss
    head_graph, head_state = nnx.split((model.final_norm, model.mtp, model.embed))

    def layer_rows(aux_VxSxC):
        """A micro-batch's statistics of every chunk [V, S, C, ...] -> its layers' rows [L, ...] in layer order."""
        return jax.tree.map(lambda a: stack_layout.from_slots(a.reshape(-1, *a.shape[3:])), aux_VxSxC)

    def head_fn(params, y_BxLxD, side, aux_VxSxC):
        (final_norm, mtp, embed), w_DxV = nnx.merge(head_graph, params[0]), params[1]
        tokens, segs, share_H = side["tokens"], side["segments_in"], side["share"]
        ce = head_ce(model, w_DxV, final_norm(y_BxLxD), tokens[:, 1:], target_mask(segs, 0))
        objective = w_ce * share_H[0] * ce
        mtp_ce_D, mtp_stats = jnp.zeros((0,), jnp.float32), None
        if n_mtp:
            with fp8.gemms_in(model.fp8):
                mtp_h_DxBxLxD, stats_list = model._mtp(mtp, embed, y_BxLxD, tokens[:, :-1], side["positions"],
                                                       side.get("segments"))
            mtp_ce_D = jnp.stack([head_ce(model, w_DxV, mtp_h_DxBxLxD[k - 1], shift_left(tokens[:, 1:], k),
                                          target_mask(segs, k)) for k in range(1, n_mtp + 1)])
            objective = objective + jnp.sum(w_mtp_D * share_H[1:] * mtp_ce_D)
            mtp_stats = _stack_stats(None, stats_list)
        load_E = jnp.zeros((0,), jnp.float32)
        if aux_VxSxC is not None:
            rows = layer_rows(aux_VxSxC)
            if mtp_stats is not None:
                rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), rows, mtp_stats)
            load_E = jnp.mean(jax.lax.stop_gradient(rows.router_load_E), axis=0)
            if mtp_stats is not None:  # the MTP blocks' balance losses (the layers' are the chunks' cotangents)
                objective = objective + w_aux / n_micro * jnp.sum(_balanced_aux(mtp_stats, load_E, coef, n_rows))
        return objective, ((ce, mtp_ce_D, mtp_stats), load_E)

    def aux_cotangent(chunk, aux_C, load_E):
        """d objective / d a chunk's statistics: its layers' balance losses (identity slots have none)."""
        is_layer_C = chunk[1]
        mask_C = jnp.ones(aux_C.aux_loss.shape[0], jnp.float32) if is_layer_C is None else is_layer_C.astype(
            jnp.float32)
        float_aux = {k: v for k, v in aux_C._asdict().items() if jnp.issubdtype(v.dtype, jnp.inexact)}

        def objective(f):
            stats = aux_C._replace(**f)
            return w_aux / n_micro * jnp.sum(mask_C * _balanced_aux(stats, load_E, coef, n_rows))

        grads = jax.grad(objective)(float_aux)
        return aux_C._replace(**{k: grads.get(k, jnp.zeros_like(v)) for k, v in aux_C._asdict().items()})

    side_MxB = model.stage_side(positions_BxL, segments)
    head_side_MxB = {"tokens": tokens_MxBxL1, "segments_in": segments_MxBxL1, "share": share_MxH, **side_MxB}
    params_VxSxC, stage_fn = model.stage_chunks()
    head_params = (head_state, model.head_DxV[...])
    policy = _tick_policy(model.remat)
    # An uneven split's chunks that end in an identity slot: ticks where every stage's does leave it out.
    last_slot_VxS = slot_is_layer(model.n_moe, model.stages, model.virtual_stages)[..., -1]
    last_slot_VxS = None if last_slot_VxS.all() else last_slot_VxS

    # optim.master_weights: the step differentiates the stored weights' f32 values; the schedule holds the stored
    # ones and forms the gradient in f32 (one_f_one_b's weights_dtype).
    stored = jnp.dtype(model.param_dtype)
    wide = any(jnp.dtype(a.dtype).itemsize > stored.itemsize for a in jax.tree.leaves(params_VxSxC)
               if jnp.issubdtype(a.dtype, jnp.floating))
    weights_dtype = stored if wide else None

    def schedule(params_VxSxC, head_params, x_MxBxLxD, rest):
        side_MxB, head_side_MxB = rest
        with inside_stage(), fp8.gemms_in(model.fp8):
            return one_f_one_b(stage_fn, params_VxSxC, x_MxBxLxD, mesh=mesh, axis="stage",
                               n_repeats=model.virtual_stages, side_MxB=side_MxB, chunk_policy=policy,
                               head_fn=head_fn, head_params=head_params, head_side_MxB=head_side_MxB,
                               aux_cotangent=aux_cotangent, last_slot_VxS=last_slot_VxS,
                               weights_dtype=weights_dtype)

    @jax.custom_vjp
    def run(params_VxSxC, head_params, x_MxBxLxD, rest):
        objective, _, aux, metrics = schedule(params_VxSxC, head_params, x_MxBxLxD, rest)
        return objective, (aux, metrics)

    def run_fwd(params_VxSxC, head_params, x_MxBxLxD, rest):
        objective, grads, aux, metrics = schedule(params_VxSxC, head_params, x_MxBxLxD, rest)
        return (objective, (aux, metrics)), (grads, rest)

    def run_bwd(saved, cts):
        (d_params, d_head, d_x), rest = saved
        ct = cts[0]  # the statistics and metrics are reported, not differentiated

        def scale(tree):
            return jax.tree.map(lambda d: d if d.dtype == jax.dtypes.float0 else (d * ct).astype(d.dtype), tree)

        return scale(d_params), scale(d_head), scale(d_x), _zero_cotangent(rest)

    run.defvjp(run_fwd, run_bwd)
    with inside_stage():
        x_MxBxLxD = constrain(micro_batches(constrain(x_BxLxD, ACT_BxLxD), n_micro), (None, *ACT_BxLxD))
    objective, (aux_VxSxMxC, (ce_M, mtp_ce_MxD, mtp_stats_MxD)) = run(params_VxSxC, head_params, x_MxBxLxD,
                                                                      (side_MxB, head_side_MxB))

    # Reported: as lm_loss reports a pipelined model's pass.
    ce = jnp.sum(share_MxH[:, 0] * ce_M)
    mtp_ce_D = jnp.sum(share_MxH[:, 1:] * mtp_ce_MxD, axis=0) if n_mtp else jnp.zeros((0,), jnp.float32)
    stats, aux = None, jnp.float32(0)
    if aux_VxSxMxC is not None:
        stats, aux = micro_batch_balance(model.micro_batch_stats(aux_VxSxMxC, mtp_stats_MxD), coef)
    # The schedule's objective holds the heads' terms; the layers' balance losses reach the gradient as their
    # statistics' cotangents, and the value here (lm_loss's weighted sum).
    total = w_ce * ce + jnp.sum(w_mtp_D * mtp_ce_D) + w_aux * aux
    return objective + jax.lax.stop_gradient(total - objective), LossParts(ce, mtp_ce_D, aux, stats)


def _mtp_has_moe(model) -> bool:
    return bool(len(model.mtp)) and model.n_moe > 0


def _balanced_aux(stats: MoEStats, load_E, coef: float, n_rows: int):
    """Rows' weighted balance losses given the micro-batch's mean load over all its rows (loss.with_batch_balance
    with the load from outside): aux_loss + coef x E sum_e load_e p_e / R."""
    if not coef:
        return stats.aux_loss
    return stats.aux_loss + coef * batch_balance_loss(load_E[None] * jnp.ones_like(stats.router_prob_E),
                                                      stats.router_prob_E) / n_rows
