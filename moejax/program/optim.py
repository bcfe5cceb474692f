"""AdamW with linear warmup + cosine decay, global-norm clipping, no weight decay on norm scales.

`make_optimizer` is the optax chain (clipped gradient -> Adam moments -> decoupled weight decay): it defines the
optimizer state (what checkpoints hold) and is the reference the train step's update is tested against.
The train step applies it through `adamw_update`: the same arithmetic as the chain followed by
`apply_learning_rate`, `optax.apply_updates` and the non-finite guard's select, written so that no
gradient-sized temporary is left besides the gradient itself (see its docstring). The learning rate is
`lr_schedule(step)` of the step counter itself. One clock: a step skipped by the non-finite guard still advances
the schedule (its batch is consumed), and the logged `lr` is the one applied. Adam's own count (bias correction)
counts only the updates applied.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.parallel.one_f_one_b import cast_floating


class MasterWeights(NamedTuple):
    """optim.master_weights: the f32 weights the optimizer updates; the model's narrower ones are their rounding."""
    params: Any


def uses_master_weights(optim_cfg) -> bool:
    return bool(optim_cfg.get("master_weights", False))


def as_f32(tree):
    """Each floating leaf of `tree` in f32 (the others as they are)."""
    return cast_floating(tree, jnp.float32)


def init_optimizer_state(optim_cfg, tx: optax.GradientTransformation, params):
    """tx's state for `params`; with master weights, tx's state for their f32 copies (Adam's moments in f32
    whatever the weights' dtype) followed by the copies themselves."""
    if not uses_master_weights(optim_cfg):
        return tx.init(params)
    master = jax.tree.map(_exactly_f32, params)
    return (*tx.init(master), MasterWeights(master))


def _exactly_f32(a):
    """a's values in f32, rounded to a's own precision again: where a is computed in the same program (the state
    created inside jit) XLA may drop the f32 -> bf16 -> f32 round trip (excess precision), and the masters must be
    the stored weights' values exactly."""
    if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == jnp.float32:
        return a
    info = jnp.finfo(a.dtype)
    return jax.lax.reduce_precision(a.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)


def lr_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    o = optim_cfg
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(total_steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio,
    )


def _decay_mask(params):
    # Decay matrices only: norm scales are tagged 'norm' in their logical axes.
    return jax.tree.map(lambda v: v.replace("norm" not in v.get_metadata()["logical_axes"]), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(optim_cfg) -> optax.GradientTransformation:
    """AdamW's update direction from the config's `optim` group; `apply_learning_rate` finishes the update."""
    o = optim_cfg
    return optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=_decay_mask),
    )


def apply_learning_rate(direction, lr: jax.Array):
    """The update: -lr x the direction (what optax.adamw's scale_by_learning_rate does, with lr given)."""
    return jax.tree.map(lambda d: jnp.asarray(-lr, d.dtype) * d, direction)


def adamw_update(optim_cfg, grads, grad_norm: jax.Array, opt_state, params, lr: jax.Array, apply: jax.Array,
                 opt_state_shardings=None):
    """(params, opt_state) after one step of make_optimizer's chain at learning rate `lr`, or unchanged where
    `apply` is False (the non-finite guard): the chain's arithmetic, operation for operation but for the clip's
    rounding (below). grad_norm: the global norm of `grads` (the step has it already).

    Why not tx.update + apply_updates + a select: that program reads each old moment again after the new one is
    written (the guard's select, the update direction), and optax's clip divides every element by the norm, which
    XLA will not duplicate into each consumer. XLA then keeps a clipped copy of the gradient tree and copies of the
    donated moments and parameters: on the compiled step (CPU, 8 devices, benchmarks/RESULTS.md "Memory") the
    temporaries were the gradients plus one or two more gradient-sized trees. Here each moment's new value is
    computed from its old value and the gradient in one expression (read once, written in place), the clip scale
    is a scalar multiply that fuses into both moments, and the parameters read the new moments (equal to the
    unselected ones whenever the step applies).

    opt_state_shardings (the state's shardings; a distributed optimizer's moments split over `data`): each
    update is computed where its moments live, so a data rank updates its slice and the new parameters are
    all-gathered to their own sharding (by the step's out_shardings); without the constraint GSPMD may gather the
    moments instead.

    With master weights (init_optimizer_state's fourth element) the f32 masters are updated, by the f32 gradient,
    and the parameters returned are the new masters in the parameters' own dtype."""
    o = optim_cfg
    clip_state, adam, decay_state, *master = opt_state
    stored = params  # the model's weights: the update's result is written in their dtype
    if master:  # optim.master_weights: the update runs on the f32 masters (the gradient is f32 too)
        params = master[0].params
    # optax.clip_by_global_norm: t if norm < max else t / norm * max. The scale as one scalar (rounding differs from
    # t / norm * max by at most one ulp of f32).
    clip_scale = jnp.where(grad_norm < o.clip_norm, 1.0, o.clip_norm / grad_norm)
    count = jnp.where(adam.count < jnp.iinfo(jnp.int32).max, adam.count + 1, adam.count)  # optax safe_increment
    bias_mu, bias_nu = 1 - o.b1 ** count, 1 - o.b2 ** count
    clipped = lambda g: g * clip_scale.astype(g.dtype)  # noqa: E731  (fuses into each moment's pass)
    mu = jax.tree.map(lambda g, m: jnp.where(apply, (1 - o.b1) * clipped(g) + o.b1 * m, m), grads, adam.mu)
    nu = jax.tree.map(lambda g, v: jnp.where(apply, (1 - o.b2) * (clipped(g) ** 2) + o.b2 * v, v), grads, adam.nu)

    def param(p, mu, nu, decays, sharding):
        direction = (mu / bias_mu.astype(mu.dtype)) / (jnp.sqrt(nu / bias_nu.astype(nu.dtype)) + o.eps)
        if decays and o.weight_decay:  # optax skips a zero decay
            direction = direction + o.weight_decay * p
        if sharding is not None:
            direction = jax.lax.with_sharding_constraint(direction, sharding)
        new = jnp.asarray(p + jnp.asarray(-lr, direction.dtype) * direction).astype(p.dtype)
        return jnp.where(apply, new, p)

    decays_of = [bool(d) for d in jax.tree.leaves(_decay_mask(params))]
    leaves, treedef = jax.tree.flatten(params)
    shardings = [None] * len(leaves) if opt_state_shardings is None else jax.tree.leaves(opt_state_shardings[1].mu)
    new_leaves = [param(*args) for args in zip(leaves, jax.tree.leaves(mu), jax.tree.leaves(nu), decays_of, shardings,
                                               strict=True)]
    adam = adam._replace(count=jnp.where(apply, count, adam.count), mu=mu, nu=nu)
    new_params = treedef.unflatten(new_leaves)
    if not master:
        return new_params, (clip_state, adam, decay_state)
    # The model's weights: the new masters rounded (all-gathered to their sharding in their own, narrower dtype).
    rounded = jax.tree.map(lambda new, old: new.astype(old.dtype), new_params, stored)
    return rounded, (clip_state, adam, decay_state, MasterWeights(new_params))
