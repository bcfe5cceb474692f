"""One training step on the (data=2, expert=4) mesh equals the same step on a single device."""

import jax
import numpy as np
from flax import nnx

from moejax.config import default_config, validate
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.optim import make_optimizer
from moejax.program.state import init_state, model_graphdef
from moejax.program.step import jit_train_step


def small_config():
    c = default_config()
    c.model.d_model, c.model.n_layers, c.model.first_k_dense = 32, 3, 1
    c.model.n_heads, c.model.head_dim, c.model.d_ff = 2, 16, 64
    c.model.init_std = 0.1
    c.moe.n_routed_experts, c.moe.top_k, c.moe.d_ff_expert = 8, 2, 16
    c.moe.capacity_factor = 0.0  # no drops: capacity per device differs between the two layouts
    c.moe.seq_aux_loss_coef = 1e-2
    c.moe.bias_update_rate = 1e-2
    c.train.global_batch, c.train.seq_len, c.train.steps = 8, 16, 10
    c.optim.warmup_steps = 0
    c.optim.eps = 1e-4  # keeps Adam's first update smooth in g, so f32 reduction-order noise stays small
    return c


def one_step(cfg, devices, tokens):
    sizes = validate(cfg, len(devices))
    mesh = make_mesh(sizes, devices)
    tx = make_optimizer(cfg.optim)
    state, shardings = init_state(cfg, tx, mesh, seed=3)
    step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings)
    with jax.set_mesh(mesh):
        state, metrics = step(state, jax.device_put(tokens, batch_sharding(mesh)))
    return jax.device_get(nnx.to_pure_dict(state.params)), jax.device_get(nnx.to_pure_dict(state.model_state)), jax.device_get(metrics)


def test_step_on_data2_expert4_equals_single_device(devices):
    tokens = np.random.default_rng(5).integers(0, 259, size=(8, 17), dtype=np.int32)
    single = small_config()
    single.mesh.data = 1
    params_1, model_state_1, metrics_1 = one_step(single, devices[:1], tokens)
    multi = small_config()
    multi.mesh.data, multi.mesh.expert = 2, 4
    params_8, model_state_8, metrics_8 = one_step(multi, devices, tokens)

    for key in ("loss", "total_loss", "grad_norm", "aux_loss", "lr"):
        np.testing.assert_allclose(metrics_8[key], metrics_1[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(metrics_8["tokens_per_expert"], metrics_1["tokens_per_expert"])
    assert np.asarray(metrics_1["tokens_per_expert"]).sum() == 2 * 8 * 16 * 2  # 2 MoE layers x tokens x k
    flat_1 = dict(jax.tree_util.tree_leaves_with_path(params_1))
    for path, p in jax.tree_util.tree_leaves_with_path(params_8):
        np.testing.assert_allclose(p, flat_1[path], rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # The aux-loss-free bias moved, identically, from the same mesh-wide loads.
    bias_1 = model_state_1["moe_layers"]["ffn"]["router"]["bias_E"]
    np.testing.assert_array_equal(model_state_8["moe_layers"]["ffn"]["router"]["bias_E"], bias_1)
    assert np.abs(bias_1).max() > 0


def test_gradient_accumulation_equals_the_full_batch(devices):
    """train.micro_batches=2 on data=2 x expert=4: the same loss, gradient norm, parameters and bias as one pass."""
    tokens = np.random.default_rng(6).integers(0, 259, size=(16, 17), dtype=np.int32)
    runs = {}
    for micro in (1, 2):
        cfg = small_config()
        cfg.train.global_batch = 16
        cfg.mesh.data, cfg.mesh.expert = 2, 4
        cfg.train.micro_batches = micro
        runs[micro] = one_step(cfg, devices, tokens)
    (p1, s1, m1), (p2, s2, m2) = runs[1], runs[2]
    for key in ("loss", "grad_norm", "aux_loss"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(m2["tokens_per_expert"], m1["tokens_per_expert"])
    flat_1 = dict(jax.tree_util.tree_leaves_with_path(p1))
    for path, p in jax.tree_util.tree_leaves_with_path(p2):
        np.testing.assert_allclose(p, flat_1[path], rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(s2["moe_layers"]["ffn"]["router"]["bias_E"], s1["moe_layers"]["ffn"]["router"]["bias_E"])


def test_accumulation_weights_micro_batches_by_their_valid_targets(devices):
    """Packed documents leave micro-batches with unequal numbers of valid targets (main head and MTP): the
    accumulated step still equals the full batch's token-weighted loss, gradient and update."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 259, size=(16, 17), dtype=np.int32)
    # Micro-batch m holds rows m, m + 2, ...: even rows are one document each, odd rows many short ones, so
    # micro-batch 1 has far fewer valid (same-document) targets than micro-batch 0.
    segments = np.zeros((16, 17), np.int32)
    segments[1::2] = np.arange(17) // 3
    batch = {"tokens": tokens, "segment_ids": segments}
    runs = {}
    for micro in (1, 2):
        cfg = small_config()
        cfg.model.mtp_depth, cfg.model.mtp_loss_weight = 1, 0.3
        cfg.train.global_batch = 16
        cfg.mesh.data, cfg.mesh.expert = 2, 4
        cfg.train.micro_batches = micro
        runs[micro] = one_step(cfg, devices, batch)
    (p1, _, m1), (p2, _, m2) = runs[1], runs[2]
    for key in ("loss", "total_loss", "mtp_loss", "grad_norm"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, err_msg=key)
    flat_1 = dict(jax.tree_util.tree_leaves_with_path(p1))
    for path, p in jax.tree_util.tree_leaves_with_path(p2):
        np.testing.assert_allclose(p, flat_1[path], rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_a_skipped_step_advances_the_schedule_and_the_logged_lr_is_applied(devices):
    """One clock: step 0 is non-finite and skipped; step 1 applies lr(1) (not lr(0) = 0 of warm-up) and logs
    it. Adam's first applied update moves every weight by about lr (|m_hat / sqrt(v_hat)| = 1)."""
    cfg = small_config()
    cfg.mesh.data = 1
    cfg.optim.warmup_steps, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.eps = 4, 1e-2, 0.0, 1e-12
    cfg.guards.inject_nan_steps = "0"
    sizes = validate(cfg, 1)
    mesh = make_mesh(sizes, devices[:1])
    tx = make_optimizer(cfg.optim)
    state, shardings = init_state(cfg, tx, mesh, seed=3)
    step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings)
    tokens = np.random.default_rng(8).integers(0, 259, size=(8, 17), dtype=np.int32)
    before = jax.device_get(nnx.to_pure_dict(state.params))
    with jax.set_mesh(mesh):
        state, m0 = step(state, tokens)
        state, m1 = step(state, tokens)
    after = jax.device_get(nnx.to_pure_dict(state.params))
    assert m0["skipped"] == 1.0 and m1["skipped"] == 0.0
    assert m0["lr"] == 0.0 and np.isclose(m1["lr"], 1e-2 / 4)
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
             for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    np.testing.assert_allclose(max(moved), m1["lr"], rtol=1e-3)
