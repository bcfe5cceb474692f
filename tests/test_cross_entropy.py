"""The fused LM head + cross-entropy (moejax/kernels/cross_entropy.py): the chunked kernel gives the dense
kernel's nll and gradients (any chunk, L not a multiple of it), accumulates bf16 logits in f32, matches on a
sharded mesh, compiles without a [B, L, V] buffer, and lm_loss gives the same loss parts and parameter
gradients with either kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import default_config
from moejax.kernels.cross_entropy import chunked_cross_entropy, dense_cross_entropy
from moejax.model.loss import head_cross_entropy, lm_loss
from moejax.model.transformer import Transformer
from moejax.parallel.mesh import logical_to_spec, make_mesh


def inputs(seed, b, seq, d, v, dtype=jnp.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(b, seq, d)) * scale, dtype)
    w = jnp.asarray(rng.normal(size=(d, v)) * scale, dtype)
    targets = jnp.asarray(rng.integers(0, v, size=(b, seq)), jnp.int32)
    mask = jnp.asarray(rng.random((b, seq)) < 0.7, jnp.float32)
    return h, w, targets, mask


def masked_loss(kernel):
    def loss(h, w, targets, mask):
        return jnp.sum(kernel(h, w, targets) * mask) / jnp.sum(mask)

    return loss


def chunked(chunk):
    return lambda h, w, t: chunked_cross_entropy(h, w, t, chunk=chunk)


@pytest.mark.parametrize("seq, chunk", [(13, 4), (13, 20), (13, 1), (12, 4)],
                         ids=["L_not_multiple", "chunk_gt_L", "chunk_1", "L_multiple"])
def test_chunked_equals_dense_f32(seq, chunk):
    h, w, targets, mask = inputs(seq * 100 + chunk, 3, seq, 16, 97)
    np.testing.assert_allclose(chunked(chunk)(h, w, targets), dense_cross_entropy(h, w, targets),
                               rtol=1e-5, atol=1e-6)
    grad = lambda kernel: jax.value_and_grad(masked_loss(kernel), argnums=(0, 1))(h, w, targets, mask)  # noqa: E731
    (loss_c, (dh_c, dw_c)), (loss_d, (dh_d, dw_d)) = grad(chunked(chunk)), grad(dense_cross_entropy)
    np.testing.assert_allclose(loss_c, loss_d, rtol=1e-6)
    np.testing.assert_allclose(dh_c, dh_d, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw_c, dw_d, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(dh_d)).max() > 1e-3 and np.abs(np.asarray(dw_d)).max() > 1e-3
    # Masked-out positions get no gradient.
    assert np.all(np.asarray(dh_c)[np.asarray(mask) == 0] == 0)


def test_chunked_bf16_accumulates_logits_in_f32():
    b, seq, d, v = 2, 24, 64, 300
    h, w, targets, mask = inputs(7, b, seq, d, v, jnp.bfloat16, scale=0.6)  # logits of magnitude ~ 3..15
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)  # the exact bf16 values

    def nll64(logits):
        lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
        return lse - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]

    logits64 = np.einsum("bld,dv->blv", h64, w64)
    ref = nll64(logits64)
    rounded = nll64(np.asarray(jnp.asarray(logits64, jnp.bfloat16), np.float64))  # logits rounded to bf16
    got = np.asarray(chunked_cross_entropy(h, w, targets, chunk=7), np.float64)
    err, err_rounded = np.abs(got - ref).max(), np.abs(rounded - ref).max()
    assert err_rounded > 1e-3, err_rounded
    assert err < err_rounded / 10, (err, err_rounded)
    np.testing.assert_allclose(got, np.asarray(dense_cross_entropy(h, w, targets)), rtol=1e-5, atol=1e-5)

    # Gradients come back in the inputs' dtypes; w may also come in f32 (the parameter, not its cast).
    dh, dw = jax.grad(masked_loss(chunked(7)), argnums=(0, 1))(h, w, targets, mask)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    dh_d, dw_d = jax.grad(masked_loss(dense_cross_entropy), argnums=(0, 1))(h, w, targets, mask)
    scale_h, scale_w = np.abs(np.asarray(dh_d, np.float32)).max(), np.abs(np.asarray(dw_d, np.float32)).max()
    np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(dh_d, np.float32), atol=2e-2 * scale_h)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(dw_d, np.float32), atol=2e-2 * scale_w)
    dh32, dw32 = jax.grad(masked_loss(chunked(7)), argnums=(0, 1))(h, w.astype(jnp.float32), targets, mask)
    assert dh32.dtype == jnp.bfloat16 and dw32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dw32), np.asarray(dw, np.float32), atol=2e-2 * scale_w)


def test_sharded_chunked_equals_single_device_dense(devices):
    b, seq, d, v = 8, 20, 16, 64
    h, w, targets, mask = inputs(3, b, seq, d, v)
    ref = jax.value_and_grad(masked_loss(dense_cross_entropy), argnums=(0, 1))(h, w, targets, mask)

    mesh = make_mesh({"data": 2, "fsdp": 1, "expert": 2, "tensor": 2}, devices)
    batch = jax.NamedSharding(mesh, logical_to_spec(("batch", None)))
    kernel = lambda h, w, t: head_cross_entropy("chunked", h, w, t, chunk=6)  # noqa: E731  (as lm_loss calls it)
    with jax.set_mesh(mesh):
        h_s = jax.device_put(h, jax.NamedSharding(mesh, logical_to_spec(("batch", None, None))))
        w_s = jax.device_put(w, jax.NamedSharding(mesh, logical_to_spec(("embed", "vocab"))))
        assert w_s.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
        got = jax.jit(jax.value_and_grad(masked_loss(kernel), argnums=(0, 1)))(
            h_s, w_s, jax.device_put(targets, batch), jax.device_put(mask, batch))
    (loss, (dh, dw)), (loss_ref, (dh_ref, dw_ref)) = jax.device_get(got), ref
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    np.testing.assert_allclose(dh, dh_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-6)


def test_sharded_chunked_sums_the_head_gradient_once_not_per_chunk(devices):
    """Rows split over data x fsdp x expert, 4 chunks: the compiled backward sums w's gradient over the row devices
    once (the per-device partial sums, row_parts), where a [D, V] carry is all-reduced in the loop, once per chunk."""
    from moejax.parallel.hlo_collectives import collectives

    b, seq, d, v, chunk = 8, 24, 16, 64, 6
    mesh = make_mesh({"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}, devices)
    kernel = lambda h, w, t: jnp.mean(head_cross_entropy("chunked", h, w, t, chunk=chunk))  # noqa: E731
    with jax.set_mesh(mesh):
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, logical_to_spec(names)))
                for shape, dtype, names in (((b, seq, d), jnp.float32, ("batch", None, None)),
                                            ((d, v), jnp.float32, ("embed", "vocab")),
                                            ((b, seq), jnp.int32, ("batch", None)))]
        hlo = jax.jit(jax.grad(kernel, argnums=(0, 1))).lower(*args).compile().as_text()
    sums = [c for c in collectives(hlo) if c.kind in ("all-reduce", "reduce-scatter")]
    assert sum(c.count for c in sums) == 1, [(c.kind, c.bytes, c.count) for c in sums]
    assert sums[0].bytes >= d * v * 4 // 2  # w's gradient (f32; reduce-scatter over fsdp: its whole input)


def test_chunked_compiles_without_a_BxLxV_buffer():
    b, seq, d, v, chunk = 2, 512, 64, 32768, 64
    blv_f32 = b * seq * v * 4  # 128 MiB: one [B, L, V] f32 buffer
    args = (jax.ShapeDtypeStruct((b, seq, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((b, seq), jnp.int32))

    def temp_bytes(kernel):
        grad = jax.jit(jax.grad(lambda h, w, t: jnp.mean(kernel(h, w, t)), argnums=(0, 1)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    dense, chunk_temp = temp_bytes(dense_cross_entropy), temp_bytes(chunked(chunk))
    # Dense holds [B, L, V] f32 logits / log-softmax / cotangents (measured 4x blv_f32). Chunked holds a scan
    # step's [B, chunk, V] f32 blocks (the backward's logits and softmax - onehot: 2 x 16 MiB, measured 32.5
    # MiB): under half of one [B, L, V] f32 buffer, so no such buffer exists.
    assert dense > blv_f32, dense
    assert chunk_temp < blv_f32 // 2, (chunk_temp, blv_f32)


def small_mtp_config(kernel: str):
    c = default_config()
    m, e = c.model, c.moe
    m.d_model, m.n_layers, m.first_k_dense, m.d_ff, m.n_heads, m.head_dim = 32, 2, 1, 64, 2, 16
    m.mtp_depth, m.mtp_loss_weight = 1, 0.3
    m.init_std, m.remat = 0.1, "none"
    e.n_routed_experts, e.top_k, e.d_ff_expert = 8, 2, 16
    e.capacity_factor, e.seq_aux_loss_coef, e.batch_aux_loss_coef = 0.0, 1e-2, 1e-2
    c.kernels.loss, c.kernels.loss_chunk = kernel, 5  # 16 positions: chunks of 5, 5, 5, 1 (padded)
    return c


def test_lm_loss_chunked_equals_dense():
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 259, size=(4, 17), dtype=np.int32))
    cuts = rng.integers(3, 14, size=4)
    segments = jnp.asarray((np.arange(17)[None, :] >= cuts[:, None]).astype(np.int32))  # two documents per row

    def loss_and_grads(kernel):
        cfg = small_mtp_config(kernel)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        assert model.loss_kernel == kernel
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def f(params, rest):
            def loss(p, s):
                return lm_loss(nnx.merge(graphdef, p, s), tokens, segments, mtp_weight=cfg.model.mtp_loss_weight)

            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, rest)

        (total, parts), (grads, _) = jax.device_get(f(params, rest))
        return total, parts, nnx.to_pure_dict(grads)

    total_c, parts_c, grads_c = loss_and_grads("chunked")
    total_d, parts_d, grads_d = loss_and_grads("dense")
    assert parts_c.mtp_ce_D.shape == (1,) and parts_c.stats is not None
    np.testing.assert_allclose(total_c, total_d, rtol=1e-6)
    for name in ("ce", "mtp_ce_D", "aux"):
        np.testing.assert_allclose(getattr(parts_c, name), getattr(parts_d, name), rtol=1e-6, err_msg=name)
    for path, g in jax.tree_util.tree_leaves_with_path(parts_c.stats):
        np.testing.assert_allclose(g, dict(jax.tree_util.tree_leaves_with_path(parts_d.stats))[path], rtol=1e-6)
    flat_d = dict(jax.tree_util.tree_leaves_with_path(grads_d))
    assert flat_d.keys() == dict(jax.tree_util.tree_leaves_with_path(grads_c)).keys()
    for path, g in jax.tree_util.tree_leaves_with_path(grads_c):
        np.testing.assert_allclose(g, flat_d[path], rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    assert np.abs(grads_d["head_DxV"]).max() > 0
