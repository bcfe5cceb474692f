"""Why the 671B CPU dry run shows 2x the planner's all-to-all bytes: XLA:CPU moves bf16 collectives as f32.

A bf16 MoE layer with capacity dispatch, compiled on the emulated CPU mesh, exchanges f32 buffers (the
compiled HLO, read by parallel/hlo_collectives.py, has converts before its all-to-all: XLA:CPU's
float-normalization-bf16 pass), twice the bf16 closed form; lowered for GPU (StableHLO, which needs no GPU,
before any XLA pass: not the compiled GPU HLO) the same all_to_all keeps bf16 operands. The dry run reports
both columns by element type and says so."""

import re

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import default_config
from moejax.model.moe import MoE
from moejax.parallel.dispatch import capacity_per_expert
from moejax.parallel.hlo_collectives import bytes_by_dtype, bytes_per_step, collectives
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.state import state_shardings

D, E, K, BATCH, SEQ = 32, 8, 2, 16, 8
MESH = dict(data=2, fsdp=1, expert=4, tensor=1)


def _traced_moe_step(devices):
    """Forward and backward of one bf16 MoE layer (capacity dispatch) on data2 x expert4."""
    c = default_config().moe
    c.n_routed_experts, c.top_k, c.d_ff_expert, c.n_shared_experts = E, K, 16, 1
    c.dispatch, c.capacity_factor = "capacity", 1.5
    graphdef, state = nnx.split(MoE(D, c, "einsum", rngs=nnx.Rngs(0), std=0.3))
    mesh = make_mesh(MESH, devices)
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(jnp.ones((BATCH, SEQ, D), jnp.bfloat16), batch_sharding(mesh))

    def step(s, x):
        return jax.grad(lambda s, x: nnx.merge(graphdef, s)(x)[0].astype(jnp.float32).sum(), argnums=(0, 1))(s, x)

    with jax.set_mesh(mesh):
        return jax.jit(step).trace(state, x), c


def test_xla_cpu_widens_bf16_all_to_all_to_f32_and_gpu_lowering_keeps_bf16(devices):
    traced, c = _traced_moe_step(devices)
    capacity = capacity_per_expert(BATCH * SEQ // 8, K, E, c.capacity_factor)
    bf16_bytes = E * capacity * D * 2  # one [E, C, D] bf16 buffer: what the planner counts per exchange
    exchanges = 4  # dispatch and combine, forward and backward

    compiled = traced.lower().compile().as_text()
    colls = [x for x in collectives(compiled) if x.kind == "all-to-all"]
    assert len(colls) == exchanges
    assert bytes_by_dtype(colls) == {"all-to-all": {"f32": exchanges * 2 * bf16_bytes}}  # f32: 2x the bytes
    assert bytes_per_step(colls) == {"all-to-all": exchanges * 2 * bf16_bytes}
    # The widening is XLA:CPU's: converts feed every all-to-all's operands.
    for line in compiled.splitlines():
        if re.search(r"\) all-to-all\(|\} all-to-all\(", line):
            assert "f32[" in line and "bf16[" not in line.split("all-to-all(")[0], line
            assert "convert" in line.split("all-to-all(")[1], line

    # Lowered (StableHLO, before XLA's passes) for CPU and for GPU: the all_to_all moves bf16.
    for platforms in (None, ("cuda",)):
        lowered = traced.lower(lowering_platforms=platforms) if platforms else traced.lower()
        types = re.findall(r'"stablehlo.all_to_all"\(%\w+\).*?: \((tensor<[^>]+>)\)', lowered.as_text())
        assert len(types) == exchanges and all(t.endswith("xbf16>") for t in types), (platforms, types)


def test_dry_run_reports_collective_bytes_by_dtype(devices):
    from moejax.planner.dry_run import dry_run, format_report
    from test_plan_vs_xla import medium_config

    cfg = medium_config(2, 1, 4, 1)
    cfg.model.dtype = "bfloat16"
    r = dry_run(cfg, 8)
    xla, plan = r["xla"]["collective_bytes_by_dtype"], r["plan"]["collective_bytes_by_dtype"]
    assert set(xla["all-to-all"]) == {"f32"} and set(plan["all-to-all"]) == {"bf16"}
    assert xla["all-to-all"]["f32"] == 2 * plan["all-to-all"]["bf16"]  # the 671B dry run's 2x, exactly
    # Gradients reduce in f32; beside them only the int32 mesh-wide expert counts (a few hundred bytes).
    assert set(xla["all-reduce"]) <= {"f32", "s32"} and xla["all-reduce"].get("s32", 0) < 1024, xla["all-reduce"]
    assert set(plan["all-reduce"]) == {"f32"}
    text = format_report(r)
    assert "(XLA f32, planner bf16)" in text and "float-normalization-bf16" in text, text
    assert r["notes"] and "what a GPU moves" in r["notes"][0]


def test_hlo_bytes_split_by_element_type():
    hlo = "\n".join([
        "%a = (f32[1,16,32]{2,1,0}, bf16[1,16,32]{2,1,0}) all-to-all(%x, %y), channel_id=1",
        "%r = bf16[16,32]{1,0} reduce-scatter(%x), replica_groups=[2,4]<=[8], dimensions={0}",
        "%g = s32[64]{0} all-gather(%i), replica_groups={{0,1,2,3}}",
    ])
    colls = collectives(hlo)
    assert [c.by_dtype for c in colls] == [(("bf16", 1024), ("f32", 2048)), (("bf16", 4 * 1024),), (("s32", 256),)]
    assert bytes_by_dtype(colls) == {"all-to-all": {"f32": 2048, "bf16": 1024}, "reduce-scatter": {"bf16": 4096},
                                     "all-gather": {"s32": 256}}
    assert all(c.bytes == sum(n for _, n in c.by_dtype) for c in colls)
