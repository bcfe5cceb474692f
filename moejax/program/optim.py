"""AdamW with linear warmup + cosine decay, global-norm clipping, no weight decay on norm scales."""

from __future__ import annotations

import jax
import optax
from flax import nnx


def lr_schedule(cfg) -> optax.Schedule:
    o = cfg.optim
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(cfg.train.steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio,
    )


def _decay_mask(params):
    # Decay matrices only: norm scales are tagged 'norm' in their logical axes.
    return jax.tree.map(lambda v: v.replace("norm" not in v.get_metadata()["logical_axes"]), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg) -> optax.GradientTransformation:
    o = cfg.optim
    return optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask),
    )
