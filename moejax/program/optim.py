"""AdamW with linear warmup + cosine decay, global-norm clipping, no weight decay on norm scales.

The optimizer gives AdamW's direction (clipped gradient -> Adam moments -> decoupled weight decay); the train
step multiplies it by `lr_schedule(step)` of the step counter itself. One clock: a step skipped by the
non-finite guard still advances the schedule (its batch is consumed), and the logged `lr` is the one applied.
Adam's own count (bias correction) counts only the updates applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


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
