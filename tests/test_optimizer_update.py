"""The train step's optimizer update (optim.adamw_update) is make_optimizer's optax chain, step for step: over three
steps on a small model's real parameter tree (norm scales undecayed), with the clip idle and active, and a skipped
(non-finite) step that changes nothing. One device, two small jitted elementwise programs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.config import default_config
from moejax.program.optim import adamw_update, apply_learning_rate, make_optimizer
from moejax.program.state import create_model


def tiny_params():
    c = default_config()
    c.model.d_model, c.model.n_layers, c.model.first_k_dense = 16, 2, 1
    c.model.n_heads, c.model.head_dim, c.model.d_ff, c.model.vocab_size = 2, 8, 32, 64
    c.moe.n_routed_experts, c.moe.top_k, c.moe.d_ff_expert = 4, 2, 8
    c.optim.weight_decay = 0.1
    _, params, _ = nnx.split(create_model(c, 0), nnx.Param, ...)
    return c.optim, params


def reference(tx, grads, opt_state, params, lr, apply):
    direction, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, apply_learning_rate(direction, lr))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt, opt_state)


def assert_trees_close(a, b, what):
    # The clip is one scalar multiply here, t / norm * max_norm in optax: a clipped gradient may differ by an ulp,
    # which Adam's direction carries into the update (lr x O(1), lr <= 4e-3 here): 1e-8 absolute is ~1e-5 of it.
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=1e-8,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("clip_norm", [1e6, 1e-2], ids=["clip-idle", "clip-active"])
def test_fused_update_is_the_optax_chain(clip_norm):
    optim_cfg, params = tiny_params()
    optim_cfg.clip_norm = clip_norm
    tx = make_optimizer(optim_cfg)
    rng = np.random.default_rng(7)
    ref_params, ref_opt = params, tx.init(params)
    fused_params, fused_opt = params, tx.init(params)
    # jitted (one compile each) rather than op by op: eager dispatch of every leaf's ops took 10 s
    ref_step = jax.jit(lambda *args: reference(tx, *args))
    fused_step = jax.jit(lambda g, *rest: adamw_update(optim_cfg, g, optax.tree.norm(g), *rest))
    for step, apply in enumerate([True, True, False, True]):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        lr = jnp.float32(1e-3 * (step + 1))
        ref_params, ref_opt = ref_step(grads, ref_opt, ref_params, lr, jnp.bool_(apply))
        fused_params, fused_opt = fused_step(grads, fused_opt, fused_params, lr, jnp.bool_(apply))
        assert_trees_close(fused_params, ref_params, f"step {step} params")
        assert_trees_close(fused_opt, ref_opt, f"step {step} opt_state")
    assert int(fused_opt[1].count) == 3  # the skipped step did not count
    assert jax.tree.structure(fused_opt) == jax.tree.structure(ref_opt)  # what checkpoints hold is unchanged
