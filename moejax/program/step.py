"""The jitted training and eval steps: explicit in/out shardings, donated state, metrics on device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.config.layers import accumulation_passes
from moejax.model.loss import lm_loss, valid_targets_H
from moejax.model.moe import combine_micro_stats, exact_dispatch
from moejax.model.pipelined_loss import pipelined_loss, uses_1f1b
from moejax.parallel.mesh import batch_sharding
from moejax.parallel.pipeline import micro_batches
from moejax.program.optim import adamw_update, as_f32, lr_schedule, uses_master_weights
from moejax.program.state import TrainState


def _loss(params, model_state, graphdef, tokens_BxL1, segment_ids_BxL1=None, mtp_weight: float = 0.0,
          weights=None, train: bool = True):
    """(objective, (main cross-entropy, MoE stats, LossParts)). The objective is lm_loss's total, or with
    weights = (w_ce, w_mtp [D], w_aux) that weighted sum of its parts (gradient accumulation's share of each). A
    training step of a pipelined model under mesh.pipeline_schedule=1f1b computes it inside the schedule
    (model/pipelined_loss.py); evaluation runs the forward alone."""
    model = nnx.merge(graphdef, params, model_state)
    if train and uses_1f1b(model):
        if weights is None:
            depth = len(model.mtp)
            weights = (1.0, jnp.full((depth,), mtp_weight / max(depth, 1), jnp.float32), 1.0)
        total, parts = pipelined_loss(model, tokens_BxL1, segment_ids_BxL1, weights=weights)
    else:
        total, parts = lm_loss(model, tokens_BxL1, segment_ids_BxL1, mtp_weight=mtp_weight)
        if weights is not None:
            total = weights[0] * parts.ce + jnp.sum(weights[1] * parts.mtp_ce_D) + weights[2] * parts.aux
    return total, (parts.ce, parts.stats, parts)


def _moe_metrics(stats, model_state) -> dict:
    if stats is None:
        return {}
    load_LxE = stats.tokens_per_expert_E
    imbalance_L = jnp.max(load_LxE, axis=-1) / jnp.maximum(jnp.mean(load_LxE, axis=-1), 1e-9)
    bias = [v[...] for v in jax.tree.leaves(model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    return {
        "aux_loss": jnp.sum(stats.aux_loss),
        "seq_aux_loss": jnp.mean(stats.seq_aux_loss),
        "batch_aux_loss": jnp.mean(stats.batch_aux_loss),
        "z_loss": jnp.mean(stats.z_loss),
        "expert_imbalance": jnp.max(imbalance_L),
        "expert_imbalance_per_layer": imbalance_L,
        "dropped_fraction": jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(stats.assignments), 1),
        "dropless_rounds": jnp.max(stats.dropless_rounds),
        "router_bias_norm": jnp.sqrt(sum(jnp.sum(b * b) for b in bias)) if bias else jnp.float32(0),
        "tokens_per_expert": load_LxE,
    }


def _unpack(batch):
    """(tokens_BxL1, segment_ids_BxL1 or None) of a pipeline batch dict, or of a bare token array."""
    if isinstance(batch, dict):
        return batch["tokens"], batch.get("segment_ids")
    return batch, None


def _accumulate(state, params, graphdef, tokens_BxL1, segments_BxL1, mtp_weight, mtp_depth: int, n: int):
    """Gradient accumulation over n micro-batches (lax.scan) that equals the full batch's gradient: each head's
    cross-entropy is a mean over the whole batch's valid targets, so micro-batch m's is weighted by its share
    of them (packed documents leave micro-batches with unequal counts); the balance losses, defined per pass,
    are averaged; expert loads are summed (the bias update sees the whole step's load)."""
    segments_BxL1 = jnp.zeros_like(tokens_BxL1) if segments_BxL1 is None else segments_BxL1
    tokens_NxBxL1, segments_NxBxL1 = micro_batches(tokens_BxL1, n), micro_batches(segments_BxL1, n)
    n_heads = 1 + mtp_depth
    counts_NxH = jax.vmap(lambda seg: valid_targets_H(seg, n_heads))(segments_NxBxL1)
    share_NxH = counts_NxH / jnp.maximum(jnp.sum(counts_NxH, axis=0), 1.0)

    def objective(params, model_state, tokens, segments, share_H):
        # DeepSeek-V3 eq. 25: lambda / D * sum_k L_MTP^k
        weights = (share_H[0], mtp_weight / max(n_heads - 1, 1) * share_H[1:], 1.0 / n)
        return _loss(params, model_state, graphdef, tokens, segments, mtp_weight, weights)

    grad_fn = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)

    def body(grad_sum, xs):
        (loss, (ce, stats, parts)), (grads, _) = grad_fn(params, state.model_state, *xs)
        return jax.tree.map(jnp.add, grad_sum, grads), (loss, ce, stats, parts)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (loss_N, ce_N, stats, parts) = jax.lax.scan(body, zeros, (tokens_NxBxL1, segments_NxBxL1, share_NxH))
    if stats is not None:
        stats = combine_micro_stats(stats)
    parts = parts._replace(stats=None, ce=jnp.sum(share_NxH[:, 0] * ce_N), aux=jnp.mean(parts.aux, axis=0),
                           mtp_ce_D=jnp.sum(share_NxH[:, 1:] * parts.mtp_ce_D, axis=0))
    return jnp.sum(loss_N), parts.ce, stats, parts, grads


def train_step(state: TrainState, batch: dict, *, graphdef, optim_cfg, schedule, bias_rate: float,
               mtp_weight: float = 0.0, mtp_depth: int = 0, nan_steps: tuple[int, ...] = (), micro_batches: int = 1,
               opt_state_shardings=None):
    """One optimizer step on batch {"tokens", "segment_ids"} ([B, L + 1] int32; or just the tokens). A step whose loss or
    gradient is not finite changes nothing but the step counter (its batch is skipped) and reports
    skipped=1, so one bad batch cannot poison the parameters or the Adam moments."""
    # Differentiate w.r.t. model_state too (its gradient is zero, the bias is stop_gradient'ed): nnx needs
    # every variable of one module at the same trace level.
    grad_fn = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)
    tokens, segments = _unpack(batch)
    # optim.master_weights: the gradient is taken at the stored (narrower) weights' f32 values, so it is f32; each
    # GEMM casts its weight back to the compute dtype, which XLA folds into the stored array (model/layers.project),
    # and the 1F1B schedule holds the stored arrays and takes each chunk's vjp at f32 (parallel/one_f_one_b.py).
    params = as_f32(state.params) if uses_master_weights(optim_cfg) else state.params
    if micro_batches == 1:
        (loss, (ce, stats, parts)), (grads, _) = grad_fn(params, state.model_state, graphdef, tokens,
                                                         segments, mtp_weight)
    else:
        loss, ce, stats, parts, grads = _accumulate(state, params, graphdef, tokens, segments, mtp_weight,
                                                    mtp_depth, micro_batches)
    if nan_steps:  # guards.inject_nan_steps: poison these steps' loss and gradient (tests the guard end to end)
        poison = jnp.where(jnp.isin(state.step, jnp.asarray(nan_steps, jnp.int32)), jnp.nan, 1.0)
        loss, ce = loss * poison, ce * poison
        grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    lr = schedule(state.step)  # the step counter is the schedule's clock, skipped steps included
    params, opt_state = adamw_update(optim_cfg, grads, grad_norm, state.opt_state, state.params, lr, finite,
                                     opt_state_shardings)
    model_state = state.model_state
    if stats is not None and bias_rate:
        # The bias follows the loads of this step, summed over the whole mesh (psum in dispatch).
        model = nnx.merge(graphdef, params, model_state)
        model.update_router_bias(stats.tokens_per_expert_E, bias_rate)
        _, _, model_state = nnx.split(model, nnx.Param, ...)
    # jnp.where, not lax.cond: the select fuses into the update's elementwise pass and keeps donation.
    model_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), model_state, state.model_state)
    metrics = {"loss": ce, "total_loss": loss, "grad_norm": grad_norm, "skipped": 1.0 - finite.astype(jnp.float32),
               "lr": lr, **_moe_metrics(stats, model_state)}
    if parts.mtp_ce_D.shape[0]:
        metrics["mtp_loss"] = jnp.mean(parts.mtp_ce_D)  # mean over MTP depths, unweighted
    new_state = state.replace(step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state)
    return new_state, metrics


def eval_step(state: TrainState, batch: dict, *, graphdef):
    """Held-out cross-entropy, every MoE layer dropless (exact) whatever moe.dispatch trains with."""
    with exact_dispatch():
        _, (ce, _, _) = _loss(state.params, state.model_state, graphdef, *_unpack(batch), train=False)
    return ce


def parse_steps(spec: str) -> tuple[int, ...]:
    """'3,4' -> (3, 4): the 0-based steps whose loss guards.inject_nan_steps poisons."""
    return tuple(int(x) for x in str(spec).split(",") if x.strip())


def jit_train_step(cfg, graphdef, tx, mesh: Mesh, shardings):
    """jax.jit of the train step with the state donated and every in/out sharding explicit."""
    del tx  # the state was made with make_optimizer(cfg.optim); the step applies that chain (optim.adamw_update)
    fn = functools.partial(train_step, graphdef=graphdef, optim_cfg=cfg.optim,
                           schedule=lr_schedule(cfg.optim, cfg.train.steps), bias_rate=float(cfg.moe.bias_update_rate),
                           mtp_weight=float(cfg.model.mtp_loss_weight),
                           mtp_depth=int(cfg.model.mtp_depth),
                           nan_steps=parse_steps(cfg.guards.inject_nan_steps),
                           micro_batches=accumulation_passes(cfg), opt_state_shardings=shardings.opt_state)
    return jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def jit_eval_step(graphdef, mesh: Mesh, shardings):
    fn = functools.partial(eval_step, graphdef=graphdef)
    return jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=NamedSharding(mesh, P()))
