"""Communication is byte-exact: the compiled forward of one MoE layer moves exactly the closed form."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moejax.config import default_config
from moejax.model.moe import MoE
from moejax.parallel.dispatch import capacity_per_expert
from moejax.parallel.hlo_collectives import collective_bytes
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.state import state_shardings

D, E, K, BATCH, SEQ = 32, 8, 2, 16, 8
MESH = dict(data=2, fsdp=1, expert=4, tensor=1)


def compiled_forward_hlo(mode, devices, n_groups=1):
    c = default_config().moe
    c.n_routed_experts, c.top_k, c.d_ff_expert, c.n_shared_experts = E, K, 16, 1
    c.dispatch, c.capacity_factor, c.n_groups, c.topk_groups = mode, 1.5, n_groups, min(2, n_groups)
    graphdef, state = nnx.split(MoE(D, c, "einsum", rngs=nnx.Rngs(0), std=0.3))
    mesh = make_mesh(MESH, devices)
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(jnp.ones((BATCH, SEQ, D)), batch_sharding(mesh))
    with jax.set_mesh(mesh):
        return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0]).lower(state, x).compile().as_text(), c


@pytest.mark.parametrize("n_groups", [1, 4])
def test_capacity_moves_experts_x_capacity_x_hidden_each_way(devices, n_groups):
    hlo, c = compiled_forward_hlo("capacity", devices, n_groups)
    tokens_per_device = BATCH * SEQ // 8
    capacity = capacity_per_expert(tokens_per_device, K, E, c.capacity_factor)
    # Dispatch and combine: one [E, C, D] f32 buffer each; the router's top-k adds no collective.
    assert collective_bytes(hlo) == {"all-to-all": 2 * E * capacity * D * 4}


def test_allgather_moves_the_expert_groups_tokens_and_reduce_scatters_back(devices):
    hlo, c = compiled_forward_hlo("allgather", devices)
    ep, tokens_per_device = MESH["expert"], BATCH * SEQ // 8
    gathered = ep * tokens_per_device
    assert collective_bytes(hlo) == {
        "all-gather": gathered * (D * 4 + K * 4 + K * 4),  # tokens f32, expert ids s32, weights f32
        "reduce-scatter": gathered * D * 4,  # every device's partial outputs for the group's tokens
    }


def test_hlo_parser_reads_tuples_groups_and_async_pairs():
    hlo = "\n".join([
        "%a = (f32[1,16,32]{2,1,0}, f32[1,16,32]{2,1,0}) all-to-all(%x, %y), channel_id=1",
        "%g = bf16[64,32]{1,0} all-gather-start(%x), replica_groups={{0,1,2,3}}",
        "%gd = bf16[64,32]{1,0} all-gather-done(%g)",
        "%r = f32[16,32]{1,0} reduce-scatter(%x), replica_groups=[2,4]<=[8], dimensions={0}",
    ])
    assert collective_bytes(hlo) == {"all-to-all": 2 * 16 * 32 * 4, "all-gather": 64 * 32 * 2,
                                     "reduce-scatter": 4 * 16 * 32 * 4}


def test_dropless_gpu_lowering_moves_only_routed_rows(devices):
    """Lowered for GPU (no GPU needed to lower), dropless exchanges each device's T*K routed rows with
    two ragged_all_to_all ops and nothing else of row size: the dense all_to_alls carry only counts and
    offsets. (XLA:CPU runs the emulation instead; tests/test_moe_parallel.py checks its results.)"""
    import re

    from moejax.parallel.dispatch import dropless_recv_bound

    c = default_config().moe
    c.n_routed_experts, c.top_k, c.d_ff_expert, c.n_shared_experts, c.dispatch = E, K, 16, 1, "dropless"
    graphdef, state = nnx.split(MoE(D, c, "einsum", rngs=nnx.Rngs(0), std=0.3))
    mesh = make_mesh(MESH, devices)
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(jnp.ones((BATCH, SEQ, D)), batch_sharding(mesh))
    with jax.set_mesh(mesh):
        traced = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0]).trace(state, x)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    routed_rows = BATCH * SEQ // 8 * K
    bound = dropless_recv_bound(BATCH * SEQ // 8, K, MESH["expert"], E // MESH["expert"], 0.0)
    ragged = re.findall(r"custom_call @ragged_all_to_all\(.*?\) \{.*?\} : \((tensor<[^>]+>), (tensor<[^>]+>)", text)
    assert ragged == [(f"tensor<{routed_rows}x{D}xf32>", f"tensor<{bound}x{D}xf32>"),
                      (f"tensor<{bound}x{D}xf32>", f"tensor<{routed_rows}x{D}xf32>")]
    dense = re.findall(r'"stablehlo.all_to_all"\(%\w+\).*?: \((tensor<[^>]+>)\)', text)
    assert dense and all(t.endswith("xi32>") or t == "tensor<4xi32>" for t in dense), dense
