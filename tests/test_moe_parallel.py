"""The MoE block on every mesh layout equals the single-device dense reference, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import default_config
from moejax.model.moe import MoE
from moejax.parallel.dispatch import capacity_per_expert
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.state import state_shardings
from tests.moe_reference import reference_moe, reference_routing

D_MODEL, BATCH, SEQ = 32, 16, 8


def moe_cfg(capacity_factor=0.0, score_func="sigmoid", mode="capacity", drop_policy="position",
            recv_factor=0.0):
    c = default_config().moe
    c.dropless_recv_factor = recv_factor
    c.n_routed_experts, c.top_k, c.d_ff_expert, c.n_shared_experts = 8, 2, 16, 1
    c.capacity_factor = capacity_factor
    c.score_func, c.dispatch, c.drop_policy = score_func, mode, drop_policy
    c.seq_aux_loss_coef = 0.1  # large, so its gradient is visible in the comparison
    c.batch_aux_loss_coef = 0.05
    return c


def make_moe(cfg, seed, gemm="einsum"):
    moe = MoE(D_MODEL, cfg, gemm, rngs=nnx.Rngs(seed), std=0.3)
    # A non-zero selection bias, so the test also checks that bias picks experts but does not weight them.
    moe.router.bias_E[...] = 0.05 * jax.random.normal(jax.random.key(seed + 1), (cfg.n_routed_experts,))
    return moe


def moejax_value_and_grad(graphdef):
    def loss(state, x, cotangent):
        moe = nnx.merge(graphdef, state)
        y, stats = moe(x)
        # The batch-wise term is model-wide (lm_loss adds it); for one layer it is the layer's own value.
        return jnp.sum(y * cotangent) + stats.aux_loss + moe.batch_aux_loss_coef * stats.batch_aux_loss, (y, stats)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def reference_value_and_grad(cfg, keep=None):
    def loss(p, x, cotangent):
        y, aux, counts = reference_moe(p, x, cfg, keep)
        return jnp.sum(y * cotangent) + aux, (y, counts)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def run_on_mesh(moe, x, cotangent, mesh_sizes, devices):
    graphdef, state = nnx.split(moe)
    mesh = make_mesh(mesh_sizes, devices[: int(np.prod(list(mesh_sizes.values())))])
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(x, batch_sharding(mesh))
    with jax.set_mesh(mesh):
        (value, (y, stats)), (g_state, g_x) = jax.jit(moejax_value_and_grad(graphdef))(state, x, cotangent)
    return value, y, stats, nnx.to_pure_dict(g_state), g_x


def inputs(seed):
    kx, kc = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (BATCH, SEQ, D_MODEL)), jax.random.normal(kc, (BATCH, SEQ, D_MODEL)))


MESHES = [  # (data, fsdp, expert, tensor)
    (8, 1, 1, 1), (4, 1, 2, 1), (2, 1, 4, 1), (1, 1, 8, 1),  # expert = 1, 2, 4, 8
    (4, 2, 1, 1), (1, 2, 4, 1), (2, 2, 2, 1),  # with fsdp
    (2, 1, 2, 2),  # with tensor
]


CASES = [(shape, mode, "einsum", "sigmoid") for mode in ("capacity", "allgather") for shape in MESHES] + [
    ((2, 1, 4, 1), "capacity", "ragged_dot", "sigmoid"),
    ((1, 2, 4, 1), "allgather", "ragged_dot", "softmax"),
    ((1, 2, 4, 1), "capacity", "einsum", "softmax"),
    ((2, 1, 4, 1), "dropless", "ragged_dot", "softmax"),
] + [(shape, "dropless", "einsum", "sigmoid") for shape in [(8, 1, 1, 1), (2, 1, 4, 1), (1, 1, 8, 1), (1, 2, 4, 1), (2, 1, 2, 2)]]


@pytest.mark.parametrize("shape,mode,backend,score_func", CASES,
                         ids=lambda v: "d{}f{}e{}t{}".format(*v) if isinstance(v, tuple) else v)
def test_moe_block_matches_dense_reference(shape, mode, backend, score_func, devices):
    seed = sum(shape) * 7 + shape[2] + len(backend) + len(score_func) + len(mode)
    cfg = moe_cfg(score_func=score_func, mode=mode)
    moe = make_moe(cfg, seed, backend)
    x, cot = inputs(seed)
    value, y, stats, g_state, g_x = run_on_mesh(moe, x, cot, dict(zip(("data", "fsdp", "expert", "tensor"), shape)), devices)

    p = nnx.to_pure_dict(nnx.state(moe))
    (ref_value, (ref_y, ref_counts)), (ref_gp, ref_gx) = reference_value_and_grad(cfg)(p, x, cot)

    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    # A sum with cancellation: its rounding error scales with the sum of the magnitudes, not with the result.
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6 * float(np.sum(np.abs(np.asarray(ref_y) * np.asarray(cot)))))
    np.testing.assert_allclose(g_x, ref_gx, rtol=1e-4, atol=1e-5)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_gp))
    for path, g in jax.tree_util.tree_leaves_with_path(g_state):
        if "bias_E" in jax.tree_util.keystr(path):
            continue  # not a trained parameter (stop_gradient); the reference differentiates it
        # A weight gradient sums over every token: an element near zero carries the rounding error of a sum of
        # large terms (the single-device f32 reference is the inexact one there, as float64 shows), so the
        # absolute tolerance follows the leaf's scale.
        ref = np.asarray(flat_ref[path])
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(ref).max())),
                                   err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(stats.tokens_per_expert_E, ref_counts)
    assert float(stats.dropped) == 0.0
    assert float(stats.assignments) == BATCH * SEQ * cfg.top_k


def expected_keep_mask(chosen_BxLxE, w_BxLxE, n_groups, capacity, policy):
    """What the drop policy keeps: in each group of consecutive tokens (one device's, or one expert
    group's for allgather), an expert keeps its first `capacity` assignments in token order ('position')
    or its `capacity` highest-weight ones ('probability')."""
    n_experts = chosen_BxLxE.shape[-1]
    chosen = np.asarray(chosen_BxLxE).reshape(n_groups, -1, n_experts) > 0
    if policy == "position":
        rank = np.cumsum(chosen, axis=1) - 1
    else:
        w = np.where(chosen, np.asarray(w_BxLxE).reshape(n_groups, -1, n_experts), -np.inf)
        rank = np.argsort(np.argsort(-w, axis=1, kind="stable"), axis=1)
    keep = chosen & (rank < capacity)
    return keep.reshape(chosen_BxLxE.shape).astype(np.float32)


DROP_CASES = [((2, 1, 4, 1), "capacity", "position"), ((1, 2, 4, 1), "capacity", "position"),
              ((2, 1, 4, 1), "capacity", "probability"), ((2, 1, 4, 1), "allgather", "position"),
              ((1, 2, 4, 1), "allgather", "probability")]


@pytest.mark.parametrize("shape,mode,policy", DROP_CASES,
                         ids=lambda v: "d{}f{}e{}t{}".format(*v) if isinstance(v, tuple) else v)
def test_capacity_drops_exactly_what_the_policy_says(shape, mode, policy, devices):
    seed = 11 + shape[0] + len(mode) + len(policy)
    cfg = moe_cfg(capacity_factor=1.0, mode=mode, drop_policy=policy)
    moe = make_moe(cfg, seed)
    # Skew the router so a few experts overflow their capacity.
    moe.router.bias_E[...] = jnp.array([0.5, 0.4, 0, 0, 0, 0, 0, 0], jnp.float32)
    x, cot = inputs(seed)
    value, y, stats, g_state, g_x = run_on_mesh(moe, x, cot, dict(zip(("data", "fsdp", "expert", "tensor"), shape)), devices)

    p = nnx.to_pure_dict(nnx.state(moe))
    chosen, w, _ = reference_routing(p, x, cfg)
    n_shards = shape[0] * shape[1] * shape[2]
    n_groups = n_shards // shape[2] if mode == "allgather" else n_shards
    tokens_per_group = BATCH * SEQ // n_groups
    capacity = capacity_per_expert(tokens_per_group, cfg.top_k, cfg.n_routed_experts, cfg.capacity_factor)
    keep = expected_keep_mask(chosen, w, n_groups, capacity, policy)
    expected_dropped = float(np.sum(np.asarray(chosen)) - keep.sum())
    assert expected_dropped > 0, "the skewed router should overflow some expert"
    assert float(stats.dropped) == expected_dropped

    (ref_value, (ref_y, _)), (ref_gp, ref_gx) = reference_value_and_grad(cfg, jnp.asarray(keep))(p, x, cot)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, ref_gx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_state["w_down_ExFxD"], ref_gp["w_down_ExFxD"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_state["router"]["w_DxE"], ref_gp["router"]["w_DxE"], rtol=1e-4, atol=1e-5)


def expected_dropless_keep(chosen_BxLxE, mesh_shape, recv_bound):
    """Dropless with a receive bound: each receiver takes its sources in expert-axis order, each source's
    rows sorted by expert then by (token, k), until recv_bound rows; the rest are dropped."""
    data, fsdp, ep, _ = mesh_shape
    n_experts = chosen_BxLxE.shape[-1]
    n_local = n_experts // ep
    shards = np.asarray(chosen_BxLxE).reshape(data * fsdp, ep, -1, n_experts) > 0  # [group, source, T, E]
    keep = np.zeros_like(shards)
    for g in range(data * fsdp):
        for d in range(ep):
            room = recv_bound
            for src in range(ep):
                for e in range(d * n_local, (d + 1) * n_local):  # sorted by expert, then token order
                    for t in np.nonzero(shards[g, src, :, e])[0]:
                        if room > 0:
                            keep[g, src, t, e] = True
                            room -= 1
    return keep.reshape(chosen_BxLxE.shape).astype(np.float32)


def test_dropless_never_drops_and_a_receive_bound_drops_exactly_the_overflow(devices):
    from moejax.parallel.dispatch import dropless_recv_bound

    shape = (2, 1, 4, 1)
    cfg = moe_cfg(mode="dropless", recv_factor=0.75)
    moe = make_moe(cfg, 21)
    moe.router.bias_E[...] = jnp.array([0.5, 0.4, 0, 0, 0, 0, 0, 0], jnp.float32)  # device 0 is swamped
    x, cot = inputs(21)
    value, y, stats, g_state, g_x = run_on_mesh(moe, x, cot, dict(zip(("data", "fsdp", "expert", "tensor"), shape)), devices)
    p = nnx.to_pure_dict(nnx.state(moe))
    chosen, _, _ = reference_routing(p, x, cfg)
    bound = dropless_recv_bound(BATCH * SEQ // 8, cfg.top_k, 4, 2, 0.75)
    keep = expected_dropless_keep(chosen, shape, bound)
    expected_dropped = float(np.sum(np.asarray(chosen)) - keep.sum())
    assert expected_dropped > 0
    assert float(stats.dropped) == expected_dropped
    (_, (ref_y, _)), (ref_gp, ref_gx) = reference_value_and_grad(cfg, jnp.asarray(keep))(p, x, cot)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, ref_gx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_state["w_up_ExDxF"], ref_gp["w_up_ExDxF"], rtol=1e-4, atol=1e-5)

    # The same skewed router with the worst-case buffer drops nothing.
    cfg.dropless_recv_factor = 0.0
    moe2 = make_moe(cfg, 21)
    moe2.router.bias_E[...] = moe.router.bias_E[...]
    _, y2, stats2, _, _ = run_on_mesh(moe2, x, cot, dict(zip(("data", "fsdp", "expert", "tensor"), shape)), devices)
    assert float(stats2.dropped) == 0.0
    (_, (ref_y2, _)), _ = reference_value_and_grad(cfg)(p, x, cot)
    np.testing.assert_allclose(y2, ref_y2, rtol=1e-5, atol=1e-5)
