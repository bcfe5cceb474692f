"""Communication is byte-exact: the compiled forward of one MoE layer moves exactly the closed form."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moejax.config import default_config
from moejax.model.moe import MoE
from moejax.parallel import dropless
from moejax.parallel.dispatch import capacity_per_expert
from moejax.parallel.hlo_collectives import collective_bytes, collectives, overlap
from moejax.planner.dry_run import expert_exchange_overlap
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


SCHEDULED = """HloModule step, is_scheduled=true, num_partitions=4

%exchange (p0: bf16[8,4], p1: bf16[8,4]) -> bf16[8,4] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[8,4]{1,0} parameter(1)
  ROOT %ra = bf16[8,4]{1,0} ragged-all-to-all(%p0, %p1), replica_groups={{0,1,2,3}}
}

%sync_exchange (q0: bf16[8,4]) -> bf16[8,4] {
  %q0 = bf16[8,4]{1,0} parameter(0)
  ROOT %a2a = bf16[8,4]{1,0} all-to-all(%q0), replica_groups={{0,1,2,3}}
}

ENTRY %main (x: bf16[8,4]) -> bf16[8,4] {
  %x = bf16[8,4]{1,0} parameter(0)
  %s = ((bf16[8,4]{1,0}, bf16[8,4]{1,0}), bf16[8,4]{1,0}) async-start(%x, %x), calls=%exchange, backend_config={"collective_backend_config":{"is_sync":false}}
  %f = bf16[8,4]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %d = bf16[8,4]{1,0} async-done(%s)
  %s2 = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}) async-start(%d), calls=%sync_exchange, backend_config={"collective_backend_config":{"is_sync":true}}
  %f2 = bf16[8,4]{1,0} fusion(%d), kind=kLoop, calls=%fused
  %d2 = bf16[8,4]{1,0} async-done(%s2)
  %g = (bf16[8,4]{1,0}, bf16[32,4]{1,0}) all-gather-start(%d2), replica_groups={{0,1,2,3}}, dimensions={0}
  %b = bf16[8,4]{1,0} bitcast(%d2)
  %gd = bf16[32,4]{1,0} all-gather-done(%g)
  %r = f32[8,4]{1,0} all-reduce(%f2), replica_groups={{0,1,2,3}}, to_apply=%sum
  %cp = (bf16[8,4]{1,0}, bf16[8,4]{1,0}) collective-permute-start(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %mm = bf16[8,8]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm
  %cpd = bf16[8,4]{1,0} collective-permute-done(%cp)
  ROOT %out = bf16[8,4]{1,0} fusion(%gd, %r), kind=kLoop, calls=%fused
}
"""


def test_overlap_counts_async_collectives_with_compute_scheduled_under_them():
    """An exchange whose start and done have a fusion between them is overlapped; one marked is_sync (XLA runs
    it on the compute stream), a gather with only a bitcast under it and a plain all-reduce are not. A GEMM
    fusion (kind=kCustom) under a collective also counts as a GEMM under it; an elementwise fusion does not."""
    colls = {c.kind: c for c in collectives(SCHEDULED)}
    kinds = ("ragged-all-to-all", "all-to-all", "all-gather", "all-reduce", "collective-permute")
    assert [colls[k].overlapped for k in kinds] == [True, False, False, False, True]
    assert [colls[k].under_gemm for k in kinds] == [False, False, False, False, True]
    by_kind = overlap(list(colls.values()))
    assert by_kind["ragged-all-to-all"] == {"bytes": 64, "overlapped_bytes": 64, "share": 1.0, "gemm_bytes": 0,
                                            "gemm_share": 0.0}
    assert by_kind["collective-permute"]["gemm_share"] == 1.0
    assert by_kind["all-gather"]["share"] == 0.0 and by_kind["all-gather"]["bytes"] == 32 * 4 * 2
    assert expert_exchange_overlap(list(colls.values())) == 0.5  # 64 of the 128 exchanged bytes


def dropless_moe_program(devices, platform):
    c = default_config().moe
    c.n_routed_experts, c.top_k, c.d_ff_expert, c.n_shared_experts, c.dispatch = E, K, 16, 1, "dropless"
    graphdef, state = nnx.split(MoE(D, c, "einsum", rngs=nnx.Rngs(0), std=0.3))
    mesh = make_mesh(MESH, devices)
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(jnp.ones((BATCH, SEQ, D)), batch_sharding(mesh))
    # The dispatch picks its exchange from the mesh's device platform when traced (dropless.How): for the GPU
    # program on this CPU mesh, it is told the devices are GPUs, and the program is lowered for CUDA.
    as_gpu = mock.patch.object(dropless, "mesh_platform", lambda mesh: "gpu")
    with jax.set_mesh(mesh), as_gpu if platform == "cuda" else contextlib.nullcontext():
        traced = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0]).trace(state, x)
        if platform == "cuda":
            return traced.lower(lowering_platforms=("cuda",)).as_text(), c
        return traced.lower().compile().as_text(), c


def test_dropless_gpu_lowering_moves_only_routed_rows_within_the_window(devices):
    """Lowered for GPU (no GPU needed to lower), dropless moves each device's T*K routed rows with
    ragged_all_to_all into receive buffers of the window (1.25 x T*K here, not the worst case ep x T x
    min(K, E_local)): round 0's two, and the overflow rounds' two (a quarter window) inside their while loop. Every other
    collective carries int32 metadata (counts, offsets, the mesh-wide largest load)."""
    import re

    from moejax.parallel.dropless import overflow_window_rows, window_rows, worst_case_rows

    text, c = dropless_moe_program(devices, "cuda")
    tokens, ep = BATCH * SEQ // 8, MESH["expert"]
    routed_rows = tokens * K
    window = window_rows(tokens, K, ep, E // ep, c.dropless_window)
    assert window == 40 < worst_case_rows(tokens, K, ep, E // ep) == 128
    ragged = re.findall(r"custom_call @ragged_all_to_all\(.*?\) \{.*?\} : \((tensor<[^>]+>), (tensor<[^>]+>)", text)
    overflow = overflow_window_rows(window)
    assert overflow == 16  # a quarter window, rounded up to 8 rows

    def trip(rows):  # the rows' way there and back
        return [(f"tensor<{routed_rows}x{D}xf32>", f"tensor<{rows}x{D}xf32>"),
                (f"tensor<{rows}x{D}xf32>", f"tensor<{routed_rows}x{D}xf32>")]

    assert sorted(ragged) == sorted(trip(window) + trip(overflow))
    others = re.findall(r'"stablehlo.(?:all_to_all|all_reduce|all_gather)"\(%\w+\).*?: \((tensor<[^>]+>)\)', text)
    assert others and all(t.endswith("xi32>") or t == "tensor<i32>" for t in others), others


def test_dropless_cpu_emulation_moves_at_most_the_chosen_chunks(devices):
    """XLA:CPU runs the exchange as a dense all_to_all of per-pair chunks padded to one of a few static sizes
    (the smallest that holds the step's largest send): each row exchange moves ep x chunk rows, chunk from
    emulation_chunks, plus int32 metadata."""
    from moejax.parallel.dropless import emulation_chunks, overflow_window_rows, window_rows

    hlo, c = dropless_moe_program(devices, "cpu")
    tokens, ep = BATCH * SEQ // 8, MESH["expert"]
    window = window_rows(tokens, K, ep, E // ep, c.dropless_window)
    trips = [(tokens * K, rows) for rows in (window, overflow_window_rows(window))]  # round 0, overflow rounds
    allowed = {ep * chunk * D * 4 for trip in trips for n_rows, out_rows in (trip, trip[::-1])
               for chunk in emulation_chunks(n_rows, out_rows, ep)}
    row_moves = [cl for cl in collectives(hlo) if dict(cl.by_dtype).get("f32", 0) > 0]
    assert row_moves and all(cl.kind == "all-to-all" and cl.bytes in allowed for cl in row_moves), row_moves
    assert all(set(dict(cl.by_dtype)) == {"s32"} for cl in collectives(hlo) if cl not in row_moves)
