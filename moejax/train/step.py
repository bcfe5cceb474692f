"""The jitted training and eval steps: explicit in/out shardings, donated state, metrics on device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.parallel.mesh import batch_sharding
from moejax.train.optim import lr_schedule
from moejax.train.state import TrainState


def cross_entropy(logits_BxLxV, targets_BxL):
    """Mean next-token cross-entropy in f32 (nats per token)."""
    logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1))


def _loss(params, model_state, graphdef, tokens_BxL1):
    model = nnx.merge(graphdef, params, model_state)
    logits, stats = model(tokens_BxL1[:, :-1])
    ce = cross_entropy(logits, tokens_BxL1[:, 1:])
    aux = jnp.sum(stats.aux_loss) if stats is not None else jnp.float32(0)
    return ce + aux, (ce, stats)


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
        "dropped_fraction": jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(stats.assignments), 1.0),
        "router_bias_norm": jnp.sqrt(sum(jnp.sum(b * b) for b in bias)) if bias else jnp.float32(0),
        "tokens_per_expert": load_LxE,
    }


def train_step(state: TrainState, tokens_BxL1, *, graphdef, tx, schedule, bias_rate: float):
    # Differentiate w.r.t. model_state too (its gradient is zero, the bias is stop_gradient'ed): nnx needs
    # every variable of one module at the same trace level.
    grad_fn = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)
    (loss, (ce, stats)), (grads, _) = grad_fn(state.params, state.model_state, graphdef, tokens_BxL1)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    model_state = state.model_state
    if stats is not None and bias_rate:
        # The bias follows the loads of this step, summed over the whole mesh (psum in dispatch).
        model = nnx.merge(graphdef, params, model_state)
        model.update_router_bias(stats.tokens_per_expert_E, bias_rate)
        _, _, model_state = nnx.split(model, nnx.Param, ...)
    metrics = {"loss": ce, "total_loss": loss, "grad_norm": optax.tree.norm(grads),
               "lr": schedule(state.step), **_moe_metrics(stats, model_state)}
    new_state = state.replace(step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state)
    return new_state, metrics


def eval_step(state: TrainState, tokens_BxL1, *, graphdef):
    _, (ce, _) = _loss(state.params, state.model_state, graphdef, tokens_BxL1)
    return ce


def jit_train_step(cfg, graphdef, tx, mesh: Mesh, shardings):
    """jax.jit of the train step with the state donated and every in/out sharding explicit."""
    fn = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=lr_schedule(cfg),
                           bias_rate=float(cfg.moe.bias_update_rate))
    return jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def jit_eval_step(graphdef, mesh: Mesh, shardings):
    fn = functools.partial(eval_step, graphdef=graphdef)
    return jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=NamedSharding(mesh, P()))
