"""optim.master_weights: bf16 weights in the model, f32 masters in the optimizer state (split over `data` like the
Adam moments), the gradient formed in f32. One step equals the f32 step from the same (bf16-representable) weights:
masters to f32 rounding, the stored weights their rounding, on a data x expert mesh and under the 1F1B schedule,
whose chunks hold the bf16 weights and take their vjps at f32. Also the config's rules and the planner's terms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, default_config, validate
from moejax.config.changes import Continuation, changed_fields
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.planner.memory import state_memory
from moejax.planner.search import parse_layout
from moejax.program.optim import MasterWeights, as_f32, make_optimizer
from moejax.program.state import init_state, model_graphdef
from moejax.program.step import jit_train_step
from test_pipeline_step import pipeline_config, slow_pipeline
from test_train_step import small_config


def _with_masters(cfg):
    m = cfg.copy_and_resolve_references()
    m.model.param_dtype, m.optim.master_weights = "bfloat16", True
    return m


def _step(cfg, tokens, devices, params=None):
    """(weights before, state after, metrics) of one step; `params` (stored weights) replace the initial ones."""
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    tx = make_optimizer(cfg.optim)
    state, shardings = init_state(cfg, tx, mesh, seed=3)
    if params is not None:
        state = state.replace(params=jax.device_put(as_f32(params), shardings.params))
    before = jax.device_get(state.params)
    masters_before = jax.device_get(state.opt_state[-1].params) if params is None else None
    step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings)
    with jax.set_mesh(mesh):
        after, metrics = step(state, jax.device_put(tokens, batch_sharding(mesh)))
    return before, masters_before, jax.device_get(after), jax.device_get(metrics), shardings


def _assert_masters_are_the_f32_step(cfg, devices, tokens):
    masters_cfg = _with_masters(cfg)
    stored, masters_0, after_m, metrics_m, shardings = _step(masters_cfg, tokens, devices)
    assert {a.dtype for a in jax.tree.leaves(stored)} == {jnp.dtype(jnp.bfloat16)}
    # Created inside jit, the masters are the stored weights' values exactly (not the f32 values they round).
    for a, b in zip(jax.tree.leaves(masters_0), jax.tree.leaves(stored), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b, np.float32))
    _, _, after_f, metrics_f, _ = _step(cfg, tokens, devices, params=stored)
    for key in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(metrics_m[key], metrics_f[key], rtol=1e-6, err_msg=key)
    masters = after_m.opt_state[-1]
    assert isinstance(masters, MasterWeights)
    flat_f = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(after_f.params)))
    for (path, master), weight in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(masters.params)),
                                      jax.tree.leaves(nnx.to_pure_dict(after_m.params)), strict=True):
        name = jax.tree_util.keystr(path)
        assert master.dtype == np.float32 and weight.dtype == jnp.bfloat16, name
        # The f32 gradient and update: a bf16 gradient would be off by ~1e-3 of the weights' scale.
        np.testing.assert_allclose(master, flat_f[path], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(weight, master.astype(jnp.bfloat16), err_msg=name)
    return shardings


def test_master_weights_step_is_the_f32_step_at_the_stored_weights(devices):
    cfg = small_config()
    cfg.mesh.data, cfg.mesh.expert = 2, 4
    tokens = np.random.default_rng(21).integers(0, 259, size=(8, 17), dtype=np.int32)
    shardings = _assert_masters_are_the_f32_step(cfg, devices, tokens)
    # The masters are split like the moments (over data: the distributed optimizer), not like the weights.
    masters, mu = shardings.opt_state[-1].params, shardings.opt_state[1].mu
    for m, u, p in zip(jax.tree.leaves(masters), jax.tree.leaves(mu), jax.tree.leaves(shardings.params)):
        assert m.spec == u.spec
    assert any("data" in str(m.spec) and "data" not in str(p.spec)
               for m, p in zip(jax.tree.leaves(masters), jax.tree.leaves(shardings.params)))


@slow_pipeline
def test_master_weights_under_1f1b_are_the_f32_step(devices):
    # PP2 x expert 2 x tensor 2, 4 MoE layers, 4 micro-batches: a steady state (one round), a small 1F1B program
    cfg = pipeline_config("capacity", 4, n_moe=4)
    cfg.mesh.stage, cfg.mesh.virtual_stages, cfg.mesh.data = 2, 1, 1
    cfg.mesh.expert, cfg.mesh.tensor, cfg.mesh.pipeline_schedule = 2, 2, "1f1b"
    tokens = np.random.default_rng(22).integers(0, 259, size=(8, 17), dtype=np.int32)
    _assert_masters_are_the_f32_step(cfg, devices, tokens)


def test_master_weights_need_narrower_weights():
    cfg = default_config()
    cfg.optim.master_weights = True
    with pytest.raises(ConfigError, match="model.param_dtype"):
        validate(cfg, 1)
    cfg.model.param_dtype = "bfloat16"
    validate(cfg, 1)


def test_master_weights_are_kept_on_resume_only():
    saved, new = default_config().to_dict(), default_config().to_dict()
    new["optim"]["master_weights"] = True
    assert [f for f, _, _ in changed_fields(saved, new, Continuation.RESUME)] == ["optim.master_weights"]
    assert changed_fields(saved, new, Continuation.INIT_FROM) == []


def test_planner_counts_bf16_weights_f32_masters_and_gradients():
    cfg = small_config()
    layout = parse_layout("data=2,ep=4")
    f32 = state_memory(cfg, layout, platform="gpu")
    masters = state_memory(_with_masters(cfg), layout, platform="gpu")
    assert masters.params * 2 == pytest.approx(f32.params, rel=0.02)  # the router bias stays f32
    # the moments as before, plus the masters split as they are
    assert masters.opt_state == pytest.approx(1.5 * f32.opt_state, rel=0.01)
    assert masters.grads == f32.grads
    # the scanned stacks' f32 copies (no 1F1B here): every stacked leaf at f32, none without master weights
    assert f32.f32_weight_copies == 0 and 0 < masters.f32_weight_copies < f32.params
