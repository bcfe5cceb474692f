"""The circular pipeline schedule (moejax/parallel/pipeline.py) on the emulated 8-device mesh: PP 2 and 4, with and
without virtual stages, more micro-batches than stages (outputs wait at stage 0), a batch axis inside every stage
with a nested shard_map: outputs, per-layer sums and every gradient equal the layers applied in order on one
device (f32, fresh random inputs)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from moejax.parallel.pipeline import (bubble_fraction, check_schedule, circular_pipeline, describe_split, from_chunks,
                                      layer_slots, merge_micro_batches, micro_batches, schedule_ticks, slot_is_layer,
                                      to_chunks)

D, F, B = 16, 32, 8  # width, hidden width, rows per micro-batch (split over `data` inside each stage)


def layer(w, x_BxD):
    """One residual layer; `centred` follows it with a batch-centring step that needs every row."""
    h_BxD = x_BxD + jnp.tanh(x_BxD @ w["w1"]) @ w["w2"]
    return h_BxD, jnp.sum(h_BxD * h_BxD, axis=0)  # the layer's output and a per-layer statistic [D]


def centred(h_BxD, nested: bool):
    """Inside a stage: a shard_map over the whole mesh (psum over `data`), as the MoE dispatch is; one device: jnp."""
    if not nested:
        return h_BxD - jnp.mean(h_BxD, axis=0)

    def body(h):
        return h - jax.lax.psum(jnp.sum(h, axis=0), "data") / B

    return jax.shard_map(body, in_specs=P("data"), out_specs=P("data"))(h_BxD)


def chunk_fn(nested: bool):
    def run(chunk, x_BxD, side_BxD):
        x_BxD = x_BxD + 0.1 * side_BxD  # a per-micro-batch input every chunk reads (as positions are)

        def one(x, w):
            h, stat = layer(w, x)
            return centred(h, nested), stat
        return jax.lax.scan(one, x_BxD, chunk)  # (y_BxD, stats [per_chunk, D])
    return run


def reference(params_L, x_MxBxD, side_MxBxD, per_chunk: int):
    n_layers = jax.tree.leaves(params_L)[0].shape[0]
    outs, stats = [], []
    for x, side in zip(x_MxBxD, side_MxBxD):
        stat_chunks = []
        for c in range(0, n_layers, per_chunk):
            x, s = chunk_fn(False)(jax.tree.map(lambda a: a[c:c + per_chunk], params_L), x, side)
            stat_chunks.append(s)
        outs.append(x)
        stats.append(jnp.concatenate(stat_chunks))
    return jnp.stack(outs), sum(stats)


def test_micro_batches_round_trip():
    x = jnp.arange(24).reshape(12, 2)
    m = micro_batches(x, 3)
    assert m.shape == (3, 4, 2) and m[1, 0, 0] == 2 and m[1, 1, 0] == 8  # rows 1, 4, 7, 10
    np.testing.assert_array_equal(merge_micro_batches(m), x)


def loss_terms(y_MxBxD, stats_LxD, probe_MxBxD, probe_LxD):
    return jnp.sum(y_MxBxD * probe_MxBxD) + jnp.sum(stats_LxD * probe_LxD) * 1e-2


# PP2 x VP1 runs in every suite; the other layouts (tens of seconds of CPU each) are CI-only (tests/budget.py:
# `make test SLOW=1`, `make test-pipeline`).
_LATER = (pytest.mark.pipeline_step,)


@pytest.mark.parametrize("stages,repeats,micro,per_chunk", [
    (2, 1, 2, 2),
    pytest.param(2, 2, 3, 1, marks=_LATER),
    pytest.param(4, 1, 4, 1, marks=_LATER),
    pytest.param(4, 2, 5, 1, marks=_LATER),
])
def test_pipeline_equals_the_layers_in_order(devices, stages, repeats, micro, per_chunk):
    mesh = Mesh(np.asarray(devices).reshape(stages, 8 // stages), ("stage", "data"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    n_layers = stages * repeats * per_chunk
    assert check_schedule(n_layers, stages, repeats, micro) == per_chunk
    rng = np.random.default_rng(1000 * stages + 10 * repeats + micro)
    params = {"w1": jnp.asarray(rng.normal(0, 0.3, (n_layers, D, F)), jnp.float32),
              "w2": jnp.asarray(rng.normal(0, 0.3, (n_layers, F, D)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(micro, B, D)), jnp.float32)
    side = jnp.asarray(rng.normal(size=(micro, B, D)), jnp.float32)
    probe_y = jnp.asarray(rng.normal(size=(micro, B, D)), jnp.float32)
    probe_s = jnp.asarray(rng.normal(size=(n_layers, D)), jnp.float32)

    def piped(params_L, x_MxBxD, side_MxBxD):
        chunks = to_chunks(params_L, stages, repeats)
        chunks = jax.lax.with_sharding_constraint(chunks, NamedSharding(mesh, P(None, "stage")))
        x_MxBxD = jax.lax.with_sharding_constraint(x_MxBxD, NamedSharding(mesh, P(None, "data")))
        y, stats_VxSxC = circular_pipeline(chunk_fn(True), chunks, x_MxBxD, mesh=mesh, axis="stage",
                                           n_repeats=repeats, side_MxB=side_MxBxD,
                                           aux_like=jnp.zeros((per_chunk, D), jnp.float32))
        # [V, S, M, per_chunk, D] -> summed over micro-batches, layer order
        return y, from_chunks(jnp.sum(stats_VxSxC, axis=2))

    with jax.set_mesh(mesh):
        y, stats = jax.jit(piped)(params, x, side)
        grads = jax.jit(jax.grad(lambda p, x, sd: loss_terms(*piped(p, x, sd), probe_y, probe_s),
                                 argnums=(0, 1, 2)))(params, x, side)
    y_ref, stats_ref = reference(params, x, side, per_chunk)
    grads_ref = jax.grad(lambda p, x, sd: loss_terms(*reference(p, x, sd, per_chunk), probe_y, probe_s),
                         argnums=(0, 1, 2))(params, x, side)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats, stats_ref, rtol=1e-5, atol=1e-4)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(grads[0]["w1"]))) > 1e-3  # the gradients are not trivially zero


def test_schedule_arithmetic_and_errors():
    assert schedule_ticks(4, 8, 2) == 19 and bubble_fraction(4, 8, 2) == 3 / 16
    assert bubble_fraction(2, 64, 8) == pytest.approx(1 / 512)  # the record's PP2 x VP8 at 64 micro-batches
    assert check_schedule(12, 4, 2, 8) == 2  # uneven: 8 chunks of 2 slots, 4 of them with one layer
    with pytest.raises(ValueError, match="are fewer than 4 stages x 2 virtual stages = 8 chunks"):
        check_schedule(7, 4, 2, 8)
    with pytest.raises(ValueError, match="needs train.micro_batches >= stages"):
        check_schedule(8, 4, 1, 2)


def test_uneven_split_fills_the_first_chunks_and_keeps_layer_order():
    # DeepSeek-V3's 58 MoE layers on the record's PP2 x VP8: 16 chunks of 4 slots, 10 chunks of 4 layers, 6 of 3
    slots = layer_slots(58, 2, 8)
    is_layer = slot_is_layer(58, 2, 8)
    assert is_layer.shape == (8, 2, 4) and is_layer.sum() == 58
    assert list(is_layer.reshape(16, 4).sum(axis=1)) == [4] * 10 + [3] * 6
    assert np.all(np.diff(slots) > 0) and is_layer.reshape(-1)[slots].all()  # layer order, one slot each
    assert not is_layer.reshape(16, 4)[10:, 3].any()  # a short chunk's identity slot is its last
    # each stage holds 29 layers (chunk k = r S + s is on stage s)
    assert list(is_layer.sum(axis=(0, 2))) == [29, 29]
    np.testing.assert_array_equal(layer_slots(8, 2, 2), np.arange(8))  # an even split is the identity
    assert "6 identity slots: MoE-layer compute x1.103" in describe_split(58, 2, 8, 64)
    assert "even split" in describe_split(8, 2, 2, 4)


def test_compiled_ring_moves_activations_only(devices):
    """PP4 x VP2, parameters laid out as chunks (stage dim split over `stage`): the compiled gradient step hands
    activations round the ring with collective-permutes of one micro-batch slice, moves the last stage's outputs
    once (one permute of the M slices), all-reduces no activations over the stages and gathers no parameters."""
    import re
    stages, repeats, micro = 4, 2, 5
    mesh = Mesh(np.asarray(devices).reshape(stages, 2), ("stage", "data"), axis_types=(AxisType.Auto, AxisType.Auto))
    chunks = to_chunks({"w1": jnp.ones((stages * repeats, D, F)), "w2": jnp.ones((stages * repeats, F, D))},
                       stages, repeats)

    def loss(chunks, x):
        y, _ = circular_pipeline(chunk_fn(True), chunks, x, mesh=mesh, axis="stage", n_repeats=repeats, side_MxB=x)
        return jnp.sum(y)

    with jax.set_mesh(mesh):
        chunks = jax.device_put(chunks, NamedSharding(mesh, P(None, "stage")))
        hlo = jax.jit(jax.grad(loss)).lower(chunks, jnp.ones((micro, B, D))).compile().as_text()
    shapes = {op: [m.group(1) for m in re.finditer(rf"= (\w+\[[\d,]*\])\S* {op}(?:-start)?\(", hlo)]
              for op in ("collective-permute", "all-gather", "all-reduce")}
    assert shapes["all-gather"] == [], shapes
    one, outputs = f"f32[1,{B // 2},{D}]", f"f32[1,{micro},{B // 2},{D}]"  # rows split over data
    assert one in shapes["collective-permute"], shapes  # one stage's slice
    assert all(s in (one, outputs) for s in shapes["collective-permute"]), shapes
    assert shapes["collective-permute"].count(outputs) <= 1, shapes
    assert not [s for s in shapes["all-reduce"] if s in (one, f"f32[{B // 2},{D}]")], shapes
