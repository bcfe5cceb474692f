"""The aux-loss-free bias moves a skewed router's load toward balance within a few steps."""

import jax
import numpy as np

from moejax.config import validate
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.optim import make_optimizer
from moejax.program.state import init_state, model_graphdef
from moejax.program.step import jit_train_step
from tests.test_train_step import small_config


def test_bias_update_balances_a_skewed_router(devices):
    cfg = small_config()
    cfg.optim.lr = 0.0  # only the bias moves: any balancing is its doing
    cfg.moe.bias_update_rate = 0.05
    cfg.moe.seq_aux_loss_coef = 0.0
    cfg.mesh.data, cfg.mesh.expert = 2, 4
    mesh = make_mesh(validate(cfg, 8), devices)
    tx = make_optimizer(cfg.optim)
    state, shardings = init_state(cfg, tx, mesh, seed=1)
    skew = np.zeros(cfg.moe.n_routed_experts, np.float32)
    skew[:2] = 0.5  # experts 0 and 1 win every token at first
    state = jax.device_put(state.replace(model_state=jax.tree.map(lambda b: b + skew, state.model_state)), shardings)
    step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings)
    tokens = np.random.default_rng(2).integers(0, 259, size=(8, 17), dtype=np.int32)
    batch = jax.device_put(tokens, batch_sharding(mesh))
    imbalance = []
    with jax.set_mesh(mesh):
        for _ in range(12):
            state, metrics = step(state, batch)
            imbalance.append(float(metrics["expert_imbalance"]))
    assert imbalance[0] > 3.0, imbalance  # 2 of 8 experts take every top-2 choice: 4x the mean
    assert imbalance[-1] < 0.6 * imbalance[0], imbalance
    assert min(imbalance[-3:]) < 2.0, imbalance
