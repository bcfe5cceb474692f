"""The mixed-precision contract in training: the same model, data and seed trained with bf16 compute (params,
optimizer state and gradient reductions f32) follows the f32 run's loss curve within a stated tolerance, and its
parameters stay f32."""

import jax
import numpy as np

from moejax.config import validate
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.optim import make_optimizer
from moejax.program.state import init_state, model_graphdef
from moejax.program.step import jit_train_step
from test_train_step import small_config

STEPS = 40


def learnable_batches(vocab: int, steps: int):
    """Rows of counting sequences (t, t + s, t + 2s, ... mod vocab) with a random start t and stride s in 1..4:
    the loss falls far below log(vocab) within tens of steps."""
    rng = np.random.default_rng(11)
    for _ in range(steps):
        start = rng.integers(0, vocab, size=(8, 1))
        stride = rng.integers(1, 5, size=(8, 1))
        yield ((start + stride * np.arange(17)[None, :]) % vocab).astype(np.int32)


def losses(dtype: str, devices) -> tuple[list[float], dict]:
    cfg = small_config()
    cfg.model.dtype = dtype
    cfg.model.vocab_size = 64
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps = 1e-2, 5, STEPS
    cfg.mesh.data, cfg.mesh.expert = 2, 4
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    tx = make_optimizer(cfg.optim)
    state, shardings = init_state(cfg, tx, mesh, seed=3)
    step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings)
    out = []
    with jax.set_mesh(mesh):
        for tokens in learnable_batches(cfg.model.vocab_size, STEPS):
            state, metrics = step(state, jax.device_put(tokens, batch_sharding(mesh)))
            out.append(float(metrics["loss"]))
    return out, state


def test_bf16_training_follows_f32(devices):
    f32, _ = losses("float32", devices)
    bf16, state = losses("bfloat16", devices)
    assert f32[-1] < 0.5 * f32[0], f32  # it learns
    gap = np.abs(np.asarray(bf16) - np.asarray(f32)) / np.asarray(f32)
    # Measured 2026-12-03 (loss 4.26 -> 1.96 in f32): max relative gap over the 40 steps 0.89% on jax 0.10.2,
    # 0.48% on jax 0.12 (bf16 rounding of activations; what the contract keeps in f32 is f32). Bound: 3%.
    assert gap.max() < 0.03, (gap.max(), f32, bf16)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    assert {leaf.dtype for leaf in jax.tree.leaves(state.opt_state) if hasattr(leaf, "dtype") and leaf.ndim} \
        == {np.dtype("float32")}
