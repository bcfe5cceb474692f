"""moejax's wiring of tokamax's kernels, checked on CPU through tokamax's XLA implementations (the Mosaic GPU
kernels take the same arguments): attention with packed documents (each query's first key) and with key ranges
(context parallelism), and the grouped GEMM inside shard_map, in values and gradients against moejax's references.
Needs the `gpu` extra (`make test-gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_extra import require_gpu_extra

require_gpu_extra()


def _same_values_and_gradients(loss_of_kernel, q, k, v):
    """loss_of_kernel(kernel) -> loss(q, k, v): tokamax's XLA implementation equals moejax's XLA reference."""
    ref, ref_g = jax.value_and_grad(loss_of_kernel("xla"), argnums=(0, 1, 2))(q, k, v)
    out, out_g = jax.value_and_grad(loss_of_kernel("tokamax_xla"), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for a, b in zip(out_g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_tokamax_attention_masks_documents_like_the_reference():
    """tokamax's kernels get documents as each query's first key (k_start)."""
    from moejax.kernels.attention import attention

    kq, kk, kv, kc = jax.random.split(jax.random.key(3), 4)
    q, k = jax.random.normal(kq, (2, 32, 4, 24)), jax.random.normal(kk, (2, 32, 4, 24))
    v, cot = jax.random.normal(kv, (2, 32, 4, 16)), jax.random.normal(kc, (2, 32, 4, 16))
    seg = jnp.asarray(np.cumsum(np.random.default_rng(1).random((2, 32)) < 0.2, axis=1), jnp.int32)
    _same_values_and_gradients(
        lambda kernel: lambda q, k, v: jnp.sum(attention(q, k, v, seg, 0.2, kernel=kernel) * cot), q, k, v)


def test_tokamax_attention_in_key_ranges_like_the_reference():
    """Context parallelism's attention: queries that are not the keys' own positions, each with a key range
    [k_start, k_end) (tokamax's Mask(k_start, k_end))."""
    from moejax.kernels.attention import attention_in_ranges

    kq, kk, kv, kc = jax.random.split(jax.random.key(5), 4)
    q, k = jax.random.normal(kq, (2, 16, 4, 24)), jax.random.normal(kk, (2, 32, 4, 24))
    v, cot = jax.random.normal(kv, (2, 32, 4, 16)), jax.random.normal(kc, (2, 16, 4, 16))
    index = jnp.asarray(np.concatenate([np.arange(8), np.arange(24, 32)]))[None].repeat(2, 0)  # a front, a back piece
    start = jnp.minimum(index, jnp.asarray([[0], [5]]))  # row 1: a document starting at 5
    _same_values_and_gradients(
        lambda kernel: lambda q, k, v: jnp.sum(attention_in_ranges(q, k, v, start, index + 1, 0.2, kernel=kernel)
                                               * cot), q, k, v)


@pytest.mark.parametrize("weights", ["replicated", "per_device"])
def test_tokamax_grouped_gemm_inside_shard_map_equals_lax_ragged_dot(weights, monkeypatch):
    """moejax's wrapper around tokamax's grouped GEMM (custom VJP that restores shard_map's varying types, which
    tokamax's kernels drop) gives lax.ragged_dot's values and gradients inside shard_map, with weights used
    replicated (their gradient summed over devices) or per device. tokamax's XLA implementation runs here."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from moejax.kernels import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "TOKAMAX_IMPLEMENTATION", "xla")
    n, rows, d, f, e = 4, 24, 16, 8, 3
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    kx, kw, kc = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (n * rows, d))
    w = jax.random.normal(kw, ((n if weights == "per_device" else 1) * e, d, f))
    cot = jax.random.normal(kc, (n * rows, f))
    sizes = jnp.tile(jnp.asarray([10, 0, 9], jnp.int32), n)  # 19 of 24 rows in groups, one empty group
    w_spec = P("x") if weights == "per_device" else P()

    def loss(dot):
        def per_device(x, w, sizes, cot):
            return jax.lax.psum(jnp.sum(dot(x, w, sizes) * cot), "x")
        return jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), w_spec, P("x"), P("x")), out_specs=P())

    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P("x")), (w, w_spec), (sizes, P("x")),
                                                                   (cot, P("x")))]
    with jax.set_mesh(mesh):
        ref, ref_g = jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(*args)
        out, out_g = jax.value_and_grad(loss(grouped_gemm._tokamax_ragged_dot), argnums=(0, 1))(*args)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for a, b in zip(out_g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
