"""Router semantics: group-limited top-k (DeepSeek-V3), bias selects but does not weight, scaling."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import default_config
from moejax.model.router import Router


def router(n_groups=1, topk_groups=1, top_k=2, scaling=1.0, norm=True):
    c = default_config().moe
    c.n_routed_experts, c.top_k, c.n_groups, c.topk_groups = 16, top_k, n_groups, topk_groups
    c.routed_scaling, c.norm_topk_prob = scaling, norm
    return Router(8, c, rngs=nnx.Rngs(0), std=1.0)


def test_group_limited_choice_stays_in_best_groups():
    r = router(n_groups=4, topk_groups=2, top_k=4)
    x = jax.random.normal(jax.random.key(1), (4, 32, 8))
    out = r(x)
    scores = np.asarray(jax.nn.sigmoid(x @ r.w_DxE[...])).reshape(4, 32, 4, 4)
    group_score = np.sort(scores, axis=-1)[..., -2:].sum(-1)  # sum of each group's top-2
    best = np.argsort(-group_score, axis=-1)[..., :2]
    chosen_groups = np.asarray(out.expert_idx_BxLxK) // 4
    for b in range(4):
        for t in range(32):
            assert set(chosen_groups[b, t]) <= set(best[b, t])
    # Within the allowed groups, the choice is the plain top-k of their experts.
    flat = scores.reshape(4, 32, 16)
    b, t = 2, 5
    allowed = [e for e in range(16) if e // 4 in best[b, t]]
    expect = sorted(allowed, key=lambda e: -flat[b, t, e])[:4]
    assert sorted(np.asarray(out.expert_idx_BxLxK)[b, t]) == sorted(expect)


def test_bias_changes_choice_not_weights_and_scaling_applies():
    r = router(top_k=2, scaling=2.5)
    x = jax.random.normal(jax.random.key(2), (2, 16, 8))
    bias = np.zeros(16, np.float32)
    bias[3] = 10.0  # expert 3 always chosen
    r.bias_E[...] = jnp.asarray(bias)
    out = r(x)
    idx, w = np.asarray(out.expert_idx_BxLxK), np.asarray(out.expert_w_BxLxK)
    assert (idx == 3).any(-1).all()
    scores = np.asarray(jax.nn.sigmoid(x @ r.w_DxE[...]))
    picked = np.take_along_axis(scores, idx, -1)
    np.testing.assert_allclose(w, 2.5 * picked / picked.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(w.sum(-1), 2.5, rtol=1e-5)
