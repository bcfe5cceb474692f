"""moe.exchange_chunks: the MoE layer with its expert exchange split into slices equals the unchunked layer, forward,
every gradient, expert loads and dropless rounds, on the test meshes (f32, fresh random inputs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.model.moe import MoE
from moejax.parallel.dispatch import slot_chunks
from moejax.parallel.dropless import window_chunks
from tests.test_moe_parallel import ADVERSARIAL, D_MODEL, inputs, moe_cfg, run_on_mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The dropless test meshes: one device's experts, expert x data, all expert, fsdp x expert, expert x tensor.
MESHES = [(8, 1, 1, 1), (2, 1, 4, 1), (1, 1, 8, 1), (1, 2, 4, 1), (2, 1, 2, 2)]
CASES = ([(shape, "dropless", "tile_loop", 3) for shape in MESHES]
         + [((2, 1, 4, 1), "dropless", "ragged_dot", 4)]
         + [(shape, "capacity", "einsum", 3) for shape in ((2, 1, 4, 1), (2, 1, 2, 2))])


def _run(cfg, chunks, seed, backend, shape, devices, x, cot, bias=None):
    moe = MoE(D_MODEL, cfg, backend, rngs=nnx.Rngs(seed), std=0.3, exchange_chunks=chunks)
    moe.router.bias_E[...] = (0.05 * jax.random.normal(jax.random.key(seed + 1), (cfg.n_routed_experts,))
                              if bias is None else jnp.asarray(bias, jnp.float32))
    return run_on_mesh(moe, x, cot, dict(zip(MESH_AXES, shape)), devices)


def assert_chunked_equals_unchunked(one, chunked, cot):
    value1, y1, stats1, g1, gx1 = one
    value_c, y_c, stats_c, g_c, gx_c = chunked
    # Forward: every row meets the same expert's weights, and the slices fill disjoint rows. A slice's GEMM has
    # fewer rows, and XLA:CPU may order a contraction's sum differently for another row count (one output of 4096
    # off by 1.2e-6 at 0.18 or at 0.004, about 80-2,000 f32 ulps of that output): f32 reassociation, whose bound
    # scales with the summands, i.e. with the outputs' magnitude (as for the weight gradients below), not equality.
    np.testing.assert_allclose(y_c, y1, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(y1).max())))
    # The value is sum(y * cot) (+ the small aux losses): what the outputs' differences carry into it, plus the sum's
    # own reassociation over 4096 terms, about 2 f32 ulps of its absolute sum (measured: the value's difference is
    # at most 0.15x what the outputs carry; a slice that lost or doubled rows moves it by whole terms, ~1)
    carried = float(np.sum(np.abs((np.asarray(y_c) - np.asarray(y1)) * cot)))
    np.testing.assert_allclose(value_c, value1, rtol=0,
                               atol=carried + 1e-7 * float(np.sum(np.abs(np.asarray(y1) * cot))))
    np.testing.assert_allclose(gx_c, gx1, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(gx1).max())))  # as y
    # A weight gradient sums over rows: chunked, the sum runs in slices (f32 reassociation, nothing else).
    flat1 = dict(jax.tree_util.tree_leaves_with_path(g1))
    for path, g in jax.tree_util.tree_leaves_with_path(g_c):
        ref = np.asarray(flat1[path])
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())),
                                   err_msg=jax.tree_util.keystr(path))
    # Integer statistics exactly: the loads drive the router-bias update, the rounds the overflow path.
    for name in ("tokens_per_expert_E", "dropped", "assignments", "dropless_rounds"):
        np.testing.assert_array_equal(getattr(stats_c, name), getattr(stats1, name), err_msg=name)


@pytest.mark.parametrize("shape,mode,backend,chunks", CASES,
                         ids=lambda v: "d{}f{}e{}t{}".format(*v) if isinstance(v, tuple) else str(v))
def test_chunked_exchange_equals_unchunked(shape, mode, backend, chunks, devices):
    seed = 5 * sum(shape) + chunks + len(mode) + len(backend)
    cfg = moe_cfg(mode=mode, capacity_factor=1.0 if mode == "capacity" else 0.0)
    x, cot = inputs(seed)
    one = _run(cfg, 1, seed, backend, shape, devices, x, cot)
    chunked = _run(cfg, chunks, seed, backend, shape, devices, x, cot)
    if mode == "capacity":
        assert int(one[2].dropped) > 0, "capacity factor 1 should drop some assignments: the same ones chunked"
    assert_chunked_equals_unchunked(one, chunked, cot)


def test_chunked_dropless_runs_the_same_overflow_rounds(devices):
    """Every token to one expert: far above the receive window, so overflow rounds follow the chunked round 0."""
    shape, seed = (2, 1, 4, 1), 41
    cfg = moe_cfg(mode="dropless", window=0.5)
    x, cot = inputs(seed)
    bias = ADVERSARIAL["all-to-one-expert"][0]
    one = _run(cfg, 1, seed, "tile_loop", shape, devices, x, cot, bias)
    chunked = _run(cfg, 2, seed, "tile_loop", shape, devices, x, cot, bias)
    assert int(one[2].dropless_rounds) >= 2
    assert_chunked_equals_unchunked(one, chunked, cot)


def test_chunk_sizes_cover_the_window_and_every_slot():
    assert window_chunks(96, 3) == [(0, 32), (32, 32), (64, 32)]
    assert window_chunks(80, 3) == [(0, 24), (24, 24), (48, 32)]  # whole row tiles, adding up to the window
    assert window_chunks(128, 4, 64) == [(0, 64), (64, 64)]  # never an empty exchange
    assert window_chunks(96, 1) == [(0, 96)]
    assert slot_chunks(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert slot_chunks(2, 4) == [(0, 1), (1, 2)]  # never an empty slice
    assert slot_chunks(7, 1) == [(0, 7)]
