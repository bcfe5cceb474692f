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
from gpu_extra import tokamax_or_skip
from tests.moe_reference import reference_moe, reference_routing

D_MODEL, BATCH, SEQ = 32, 16, 8


def moe_cfg(capacity_factor=0.0, score_func="sigmoid", mode="capacity", drop_policy="position", window=1.25):
    c = default_config().moe
    c.dropless_window = window
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
] + [(shape, "dropless", backend, "sigmoid") for backend in ("tile_loop", "einsum")
      for shape in [(8, 1, 1, 1), (2, 1, 4, 1), (1, 1, 8, 1), (1, 2, 4, 1), (2, 1, 2, 2)]]


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


# tokamax's grouped GEMM as run on Blackwell (the weight gradient as tiled GEMMs, the dispatch untyped) and on
# Hopper (tokamax's kernel for it), through tokamax's XLA reference kernels on CPU: data x expert (the replica
# sum left to shard_map), fsdp x expert and expert x tensor.
TOKAMAX_CASES = [((2, 1, 4, 1), "tiles"), ((1, 2, 4, 1), "tiles"), ((2, 1, 2, 2), "tiles"), ((2, 1, 4, 1), "kernel")]


@pytest.mark.parametrize("shape,weight_grad", TOKAMAX_CASES,
                         ids=lambda v: "d{}f{}e{}t{}".format(*v) if isinstance(v, tuple) else v)
def test_dropless_through_tokamax_matches_dense_reference(shape, weight_grad, devices, monkeypatch):
    tokamax_or_skip()
    from moejax.kernels import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "TOKAMAX_IMPLEMENTATION", "xla")
    monkeypatch.setattr(grouped_gemm, "TOKAMAX_WEIGHT_GRAD", weight_grad)
    test_moe_block_matches_dense_reference(shape, "dropless", "tokamax", "sigmoid", devices)


# Transformer Engine's layout (rows grouped by expert, each group padded to 128 rows, the sizes summing to the rows;
# capacity rounded up to 128 slots) through te_gemm's emulation of TE's grouped GEMM (bf16 here: lax.ragged_dot),
# which does not run on CPU: dropless on data x expert, fsdp x expert (the replica sum left to shard_map: untyped, as TE runs) and
# expert x tensor; capacity and allgather's equal groups.
TE_CASES = [((2, 1, 4, 1), "dropless"), ((1, 2, 4, 1), "dropless"), ((2, 1, 2, 2), "dropless"),
            ((2, 1, 4, 1), "capacity"), ((1, 2, 4, 1), "allgather")]


@pytest.mark.parametrize("shape,mode", TE_CASES, ids=lambda v: "d{}f{}e{}t{}".format(*v) if isinstance(v, tuple) else v)
def test_transformer_engine_layout_matches_dense_reference(shape, mode, devices):
    from moejax.kernels import te_gemm

    with te_gemm.stand_in():
        test_moe_block_matches_dense_reference(shape, mode, "te", "sigmoid", devices)


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


def receive_loads(chosen_BxLxE, mesh_shape):
    """Rows each device receives in the dropless exchange: its local experts' assignments from its expert
    group's tokens (the batch splits over (data, fsdp, expert) in that order)."""
    data, fsdp, ep, _ = mesh_shape
    n_experts = chosen_BxLxE.shape[-1]
    per_expert_GxE = (np.asarray(chosen_BxLxE).reshape(data * fsdp, -1, n_experts) > 0).sum(axis=1)
    return per_expert_GxE.reshape(data * fsdp, ep, n_experts // ep).sum(axis=-1)  # [group, device in group]


ADVERSARIAL = {
    # every token to expert 0 (and one other: top-2 picks two distinct experts): device 0 receives every row
    "all-to-one-expert": (np.array([9.0, 8.0, 0, 0, 0, 0, 0, 0]), None),
    # the tokens of the first expert-group device all to a remote expert (7, on device 3 of 4), others routed
    "one-device-to-one-remote-expert": (None, 7),
}


# Each case on one mesh (the suite's time budget): both cases meet data x expert, fsdp x expert and expert x tensor.
@pytest.mark.parametrize("case,shape,window,backend", [
    ("all-to-one-expert", (2, 1, 4, 1), 0.5, "tile_loop"), ("one-device-to-one-remote-expert", (2, 1, 4, 1), 1.0, "tile_loop"),
    ("one-device-to-one-remote-expert", (1, 2, 4, 1), 0.75, "tile_loop"), ("all-to-one-expert", (2, 1, 2, 2), 0.75, "tile_loop"),
    ("all-to-one-expert", (2, 1, 4, 1), 0.5, "einsum")],
    ids=lambda v: "d{}f{}e{}t{}".format(*v) if isinstance(v, tuple) else str(v))
def test_dropless_is_exact_under_adversarial_routing_in_overflow_rounds(case, shape, window, backend, devices):
    """Adversarial loads far above the receive window: overflow rounds run (as many as the largest load needs),
    nothing is dropped, and the result and every gradient equal the dense reference (the CPU default grouped
    GEMM, tile_loop, on every case; the static tiles on one)."""
    seed = 31 + sum(shape) + len(case)
    cfg = moe_cfg(mode="dropless", window=window)
    moe = make_moe(cfg, seed, backend)
    bias, hot_expert = ADVERSARIAL[case]
    x, cot = inputs(seed)
    if bias is not None:
        moe.router.bias_E[...] = jnp.asarray(bias, jnp.float32)
    else:
        # The first device's tokens (its batch rows) get router logits of +4 for `hot_expert` and -4 for the others
        # (solved through the router weights), plus a little of their random input.
        target_E = jnp.full((cfg.n_routed_experts,), -4.0).at[hot_expert].set(4.0)
        v_D = jnp.linalg.lstsq(moe.router.w_DxE[...].T, target_E)[0]
        rows = BATCH // (shape[0] * shape[1] * shape[2])
        x = x.at[:rows].set(v_D + 0.05 * x[:rows])
    mesh_sizes = dict(zip(("data", "fsdp", "expert", "tensor"), shape))
    value, y, stats, g_state, g_x = run_on_mesh(moe, x, cot, mesh_sizes, devices)
    p = nnx.to_pure_dict(nnx.state(moe))
    chosen, _, _ = reference_routing(p, x, cfg)
    if hot_expert is not None:
        rows = BATCH // (shape[0] * shape[1] * shape[2])
        assert np.all(np.asarray(chosen)[:rows, :, hot_expert] > 0), "the first device's tokens all pick the hot expert"
    tokens_per_device = BATCH * SEQ // (shape[0] * shape[1] * shape[2])
    window_rows = int(np.ceil(window * tokens_per_device * cfg.top_k))
    # Round 0 takes a window, each overflow round a quarter window (at least 8 rows).
    overflow = receive_loads(chosen, shape).max() - window_rows
    expected_rounds = 1 + int(np.ceil(max(overflow, 0) / (8 * int(np.ceil(window_rows / 32)))))
    assert expected_rounds >= 2, "the routing should overflow the window"
    assert int(stats.dropless_rounds) == expected_rounds
    assert int(stats.dropped) == 0
    (ref_value, (ref_y, ref_counts)), (ref_gp, ref_gx) = reference_value_and_grad(cfg)(p, x, cot)
    np.testing.assert_array_equal(stats.tokens_per_expert_E, ref_counts)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, ref_gx, rtol=1e-4, atol=1e-5)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_gp))
    for path, g in jax.tree_util.tree_leaves_with_path(g_state):
        if "bias_E" not in jax.tree_util.keystr(path):
            ref = np.asarray(flat_ref[path])
            np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(ref).max())),
                                       err_msg=jax.tree_util.keystr(path))


def test_dropless_counts_are_int32_and_a_balanced_step_runs_one_round(devices):
    cfg = moe_cfg(mode="dropless", window=2.0)
    moe = make_moe(cfg, 3)
    x, cot = inputs(3)
    _, _, stats, _, _ = run_on_mesh(moe, x, cot, dict(data=2, fsdp=1, expert=4, tensor=1), devices)
    assert stats.tokens_per_expert_E.dtype == jnp.int32 and stats.dropped.dtype == jnp.int32
    assert int(stats.dropless_rounds) == 1 and int(stats.dropped) == 0
