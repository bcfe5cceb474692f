"""FP8 training GEMMs (model.fp8; moejax/kernels/fp8.py): quantisation equal to references written from the papers'
definitions, every GEMM's error inside the bound its scaling implies, the model on a mesh equal to one device, and
the platform / combination errors."""

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax.config import ConfigError, default_config, validate
from moejax.kernels import fp8
from moejax.kernels.resolve import resolve_kernels

ROOT = Path(__file__).resolve().parents[1]

E4M3_UNIT_ROUNDOFF = 2.0 ** -4  # 3 mantissa bits: a normal value rounds within half an ulp, 2^-4 relative
E4M3_SUBNORMAL_HALF_SPACING = 2.0 ** -10  # subnormals are spaced 2^-9 (in units of the scale)
TINY_SCALE = np.sqrt(np.finfo(np.float32).tiny)  # an all-zero tile keeps scale 1 (qwix)
INV_448 = np.float32(1.0) / np.float32(448.0)
# How amax / 448 (qwix divides) may be rounded: XLA:CPU of jax 0.10.2 strength-reduces the division by the constant
# into a multiplication by the f32 reciprocal INV_448 (at most one ulp from the quotient); jax 0.12.1's divides. The
# references below are computed both ways and the quantiser must equal one of them exactly, values and scales (the
# values are divided by the scale the quantiser chose, exactly as the reference divides by its own).
ROUNDINGS = ("divide", "reciprocal")


def _over_448(amax, rounding):
    amax = amax.astype(np.float32)
    return (amax / np.float32(448.0) if rounding == "divide" else amax * INV_448).astype(np.float32)


def assert_equals_a_reference(got, reference, *args):
    """`got` = (values, scale) equals reference(*args, rounding) exactly for one of ROUNDINGS."""
    misses = []
    for rounding in ROUNDINGS:
        want = reference(*args, rounding=rounding)
        if all(np.array_equal(g, w) for g, w in zip(got, want)):
            return
        misses.append((rounding, [int(np.sum(g != w)) for g, w in zip(got, want)]))
    raise AssertionError(f"equal to no reference (rounding, [values, scales] differing): {misses}")


def _tiles(a_RxK, tile):
    """[R, K] -> [R, T, tile], zero-padded to whole tiles."""
    rows, k = a_RxK.shape
    padded = -(-k // tile) * tile
    return np.pad(a_RxK, ((0, 0), (0, padded - k))).reshape(rows, padded // tile, tile)


def reference_blockwise_rows(a_RxK, rounding="divide"):
    """DeepSeek-V3 (arXiv 2412.19437, 3.3.1): per 1 x 128 tile (the whole row when K <= 128), scale = amax / 448,
    value = e4m3(x / scale). Returns (values, per-element scale), both [R, K] float32."""
    tile = min(128, a_RxK.shape[1])
    t = _tiles(a_RxK.astype(np.float32), tile)
    scale = _over_448(np.max(np.abs(t), axis=2, keepdims=True), rounding)
    scale = np.where(scale < TINY_SCALE, np.float32(1.0), scale).astype(np.float32)
    q = (t / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = lambda v: np.broadcast_to(v, t.shape).reshape(t.shape[0], -1)[:, : a_RxK.shape[1]]  # noqa: E731
    return full(q), full(scale)


def reference_blockwise_weight(w_CxK, rounding="divide"):
    """DeepSeek-V3 weights: one scale per 128 x 128 block, amax / 448."""
    c, k = w_CxK.shape
    tc, tk = min(128, c), min(128, k)
    pc, pk = -(-c // tc) * tc, -(-k // tk) * tk
    b = np.pad(w_CxK.astype(np.float32), ((0, pc - c), (0, pk - k))).reshape(pc // tc, tc, pk // tk, tk)
    scale = _over_448(np.max(np.abs(b), axis=(1, 3), keepdims=True), rounding)
    scale = np.where(scale < TINY_SCALE, np.float32(1.0), scale).astype(np.float32)
    q = (b / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = lambda v: np.broadcast_to(v, b.shape).reshape(pc, pk)[:c, :k]  # noqa: E731
    return full(q), full(scale)


def reference_mxfp8_rows(a_RxK, rounding="divide"):
    """MXFP8 as NVIDIA trains with it (arXiv 2506.08027, OCP MX blocks of 32): scale = 2^ceil(log2(amax / 448)),
    an E8M0 power of two rounded up so no value saturates; value = e4m3(x / scale). The exponent is taken exactly
    with frexp (amax / 448 = m 2^e, m in [0.5, 1): ceil(log2) = e - 1 when m == 0.5, else e)."""
    t = _tiles(a_RxK.astype(np.float32), 32)
    ratio = _over_448(np.max(np.abs(t), axis=2, keepdims=True), rounding)
    ratio = np.where(ratio < TINY_SCALE, np.float32(1.0), ratio).astype(np.float32)
    mantissa, exponent = np.frexp(ratio)
    scale = np.ldexp(np.float32(1.0), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)
    q = (t / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = lambda v: np.broadcast_to(v, t.shape).reshape(t.shape[0], -1)[:, : a_RxK.shape[1]]  # noqa: E731
    return full(q), full(scale)


E5M2_UNIT_ROUNDOFF = 2.0 ** -3  # 2 mantissa bits
E5M2_SUBNORMAL_HALF_SPACING = 2.0 ** -17  # subnormals are spaced 2^-16


def reference_tensorwise(a_RxK, rounding="divide", dtype=ml_dtypes.float8_e4m3fn):
    """Per-tensor current scaling (Transformer Engine's): one scale amax(tensor) / max(format) (1 for an all-zero
    tensor), value = format(x / scale); e4m3 (448) forward, e5m2 (57344) for gradients."""
    a = a_RxK.astype(np.float32)
    top = np.float32(float(ml_dtypes.finfo(dtype).max))
    amax = np.max(np.abs(a)).astype(np.float32)
    scale = np.float32(amax / top if rounding == "divide" else amax * (np.float32(1.0) / top))
    scale = np.float32(1.0) if scale < TINY_SCALE else scale
    q = (a / scale).astype(dtype).astype(np.float32)
    return q, np.full(a.shape, scale, np.float32)


def reference_rowwise_rows(a_RxK, rounding="divide"):
    """One scale per row along the contraction: amax(row) / 448 (1 for an all-zero row), value = e4m3(x / scale)."""
    a = a_RxK.astype(np.float32)
    scale = _over_448(np.max(np.abs(a), axis=1, keepdims=True), rounding)
    scale = np.where(scale < TINY_SCALE, np.float32(1.0), scale).astype(np.float32)
    q = (a / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q, np.broadcast_to(scale, a.shape)


def _hard_rows(rng, rows, k):
    """Normal rows with a spread of magnitudes, an all-zero row, and a row whose amax / 448 is a power of two."""
    a = rng.standard_normal((rows, k)).astype(np.float32) * np.float32(2.0) ** rng.integers(-12, 6, (rows, 1))
    a[1] = 0.0
    a[2, 0] = 56.0  # 56 / 448 = 2^-3
    a[2, 1:] = np.clip(a[2, 1:], -50, 50)
    return a.astype(np.float32)


@pytest.mark.parametrize("k", [96, 256, 200])  # one short tile; whole tiles; a zero-padded last tile
def test_blockwise_activation_tiles_equal_the_reference(k):
    a = _hard_rows(np.random.default_rng(k), 6, k)
    q = fp8.quantize_rows(jnp.asarray(a)[None], "blockwise")
    got_values = np.asarray(q.qvalue[0].astype(jnp.float32))[:, :k]
    got_scale = np.repeat(np.asarray(q.scale[0]), min(128, k), axis=1)[:, :k]
    assert q.qvalue.dtype == jnp.float8_e4m3fn
    assert_equals_a_reference((got_values, got_scale), reference_blockwise_rows, a)


@pytest.mark.parametrize("shape", [(256, 384), (200, 72), (64, 300)])
def test_blockwise_weight_blocks_equal_the_reference(shape):
    w = _hard_rows(np.random.default_rng(sum(shape)), *shape) * np.float32(0.01)
    q = fp8.quantize_weight_blocks(jnp.asarray(w)[None])
    k = shape[1]
    got_values = np.asarray(q.qvalue[0].astype(jnp.float32))[:, :k]
    got_scale = np.repeat(np.asarray(q.scale[0]), min(128, k), axis=1)[:, :k]
    assert_equals_a_reference((got_values, got_scale), reference_blockwise_weight, w)
    assert len(np.unique(got_scale)) <= -(-shape[0] // 128) * -(-k // 128) + 1  # one scale per block (+ zero blocks)


@pytest.mark.parametrize("k", [64, 96, 100])
def test_mxfp8_blocks_equal_the_reference(k):
    a = _hard_rows(np.random.default_rng(k + 1), 6, k)
    q = fp8.quantize_rows(jnp.asarray(a)[None], "mxfp8")
    got_scale = np.repeat(np.asarray(q.scale[0]), 32, axis=1)[:, :k]
    got_values = np.asarray(q.qvalue[0].astype(jnp.float32))[:, :k]
    assert_equals_a_reference((got_values, got_scale), reference_mxfp8_rows, a)
    assert np.all(np.log2(got_scale) == np.round(np.log2(got_scale)))  # E8M0: powers of two
    assert np.max(np.abs(got_values)) <= 448.0


@pytest.mark.parametrize("k", [96, 300])
def test_rowwise_rows_equal_the_reference(k):
    a = _hard_rows(np.random.default_rng(k + 2), 6, k)
    q = fp8.quantize_rows(jnp.asarray(a)[None], "rowwise")
    assert q.qvalue.dtype == jnp.float8_e4m3fn and q.scale.shape == (1, 6, 1)  # one scale per row
    got = (np.asarray(q.qvalue[0].astype(jnp.float32)), np.broadcast_to(np.asarray(q.scale[0]), a.shape))
    assert_equals_a_reference(got, reference_rowwise_rows, a)


@pytest.mark.parametrize("gradient", [False, True], ids=["e4m3", "e5m2"])
def test_tensorwise_equals_the_reference(gradient):
    a = _hard_rows(np.random.default_rng(5), 6, 200)
    q = fp8.quantize_rows(jnp.asarray(a)[None], "tensorwise", gradient=gradient)
    dtype = ml_dtypes.float8_e5m2 if gradient else ml_dtypes.float8_e4m3fn
    assert q.qvalue.dtype == dtype and q.scale.size == 1  # one scale for the tensor
    got = (np.asarray(q.qvalue[0].astype(jnp.float32)), np.broadcast_to(np.asarray(q.scale[0]), a.shape))
    assert_equals_a_reference(got, lambda a, rounding: reference_tensorwise(a, rounding, dtype), a)


def _lowered_dots(fmt, m=256, k=384, n=320):
    """(operand element types, contraction length) of every dot in the lowered fwd+bwd of x [m, k] @ w [k, n]."""
    import re

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda x, w: fp8.fp8_matmul(x[None], w[None], fmt)[0], x, w)
        return y, vjp(jnp.ones_like(y))

    text = jax.jit(fwd_bwd).lower(jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)).as_text()
    dots = []
    for d in re.finditer(r"stablehlo\.dot_general .*?contracting_dims = \[(\d+)\] x .*?: \(tensor<([0-9x]+)x(\w+)>, "
                         r"tensor<[0-9x]+x(\w+)>\)", text):
        dots.append((f"{d[3]} x {d[4]}", int(d[2].split("x")[int(d[1])])))
    return dots


def test_rowwise_gemms_are_one_fp8_dot_each_and_blockwise_ones_are_per_tile():
    """What makes rowwise fast on GPUs and blockwise slow without a fused-promotion kernel, read from the lowered
    program: rowwise runs each of the three GEMMs (forward, dgrad, wgrad) as one e4m3 dot over the whole
    contraction; blockwise runs them as dots of depth 128, one per tile, whose f32 partials are summed after."""
    f8 = "f8E4M3FN x f8E4M3FN"
    assert sorted(_lowered_dots("rowwise")) == [(f8, 256), (f8, 320), (f8, 384)]
    assert sorted(_lowered_dots("blockwise")) == [(f8, 128)] * 3
    # tensorwise: one dot per GEMM, the gradient in e5m2 (dgrad dy . w^T over n, wgrad dy^T . x over m)
    assert sorted(_lowered_dots("tensorwise")) == sorted([(f8, 384), ("f8E5M2 x f8E4M3FN", 320),
                                                          ("f8E4M3FN x f8E5M2", 256)])


E4M3 = (E4M3_UNIT_ROUNDOFF, E4M3_SUBNORMAL_HALF_SPACING)
E5M2 = (E5M2_UNIT_ROUNDOFF, E5M2_SUBNORMAL_HALF_SPACING)


def _error_bound(a_RxK, b_CxK, quant_a, quant_b, format_a=E4M3, format_b=E4M3):
    """|fp8 a.b^T - a.b^T| <= sum_k |a||eb| + |b||ea| + |ea||eb|, with each quantised element within
    u |x| + s h of x (e4m3: u = 2^-4, normal rounding; h = 2^-10, half the subnormal spacing; e5m2: 2^-3, 2^-17),
    plus f32 slack."""
    _, sa = quant_a(a_RxK)
    _, sb = quant_b(b_CxK)
    ea = format_a[0] * np.abs(a_RxK) + sa * format_a[1]
    eb = format_b[0] * np.abs(b_CxK) + sb * format_b[1]
    a64, b64, ea, eb = (np.asarray(v, np.float64) for v in (a_RxK, b_CxK, ea, eb))
    slack = 1e-5 * np.abs(a64) @ np.abs(b64).T
    return np.abs(a64) @ eb.T + ea @ np.abs(b64).T + ea @ eb.T + slack


@pytest.mark.parametrize("fmt", ["blockwise", "rowwise", "tensorwise", "mxfp8"])
def test_every_fp8_gemm_stays_inside_its_scaling_bound(fmt):
    """Forward, activation gradient and weight gradient of x @ w, each against f64 and the bound its operands'
    scaling implies; and the error is that of FP8 (not zero), so the GEMMs did run quantised."""
    rng = np.random.default_rng(7)
    m, k, n = 160, 256, 192
    x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum("mk,kn->mn", x, w, fmt), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    rows = {"blockwise": reference_blockwise_rows, "rowwise": reference_rowwise_rows, "mxfp8": reference_mxfp8_rows,
            "tensorwise": reference_tensorwise}[fmt]
    weight = {"blockwise": reference_blockwise_weight}.get(fmt, rows)  # rowwise: per output column
    grads, grad_format = rows, E4M3
    if fmt == "tensorwise":  # gradients in e5m2
        def grads(a, rounding="divide"):
            return reference_tensorwise(a, rounding, ml_dtypes.float8_e5m2)

        grad_format = E5M2
    products = {  # name: (fp8 result, a [R, K], b [C, K], how a and b are quantised, their formats)
        "y": (y, x, w.T, rows, weight, E4M3, E4M3),
        "dx": (dx, dy, w, grads, weight, grad_format, E4M3),
        # dw^T = dy^T x: contraction over the tokens, both tiled along them
        "dw": (dw.T, dy.T, x.T, grads, rows, grad_format, E4M3),
    }
    for name, (got, a, b, qa, qb, fa, fb) in products.items():
        exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
        err = np.abs(np.asarray(got, np.float64) - exact)
        assert np.all(err <= _error_bound(a, b, qa, qb, fa, fb)), name
        relative = np.linalg.norm(err) / np.linalg.norm(exact)
        assert 3e-3 < relative < 0.1, (name, relative)


def _fp8_config(fmt="blockwise"):
    c = default_config()
    c.model.fp8 = fmt
    c.kernels.attention = "xla"  # resolvable without the gpu extra (this file runs in the CPU suites)
    return c


def test_fp8_config_errors_before_compile():
    with pytest.raises(ConfigError, match="model.fp8='fp4'"):
        validate(_fp8_config("fp4"), 8)
    c = _fp8_config()
    c.model.grad_reduce_dtype = "float16"
    with pytest.raises(ConfigError):
        validate(c, 8)
    with pytest.raises(ConfigError, match="compute capability >= 10.0"):
        resolve_kernels(_fp8_config("mxfp8"), "gpu", 9.0)
    with pytest.raises(ConfigError, match="compute capability >= 8.9"):
        resolve_kernels(_fp8_config("blockwise"), "gpu", 8.0)
    with pytest.raises(ConfigError, match="compute capability >= 8.9"):
        resolve_kernels(_fp8_config("rowwise"), "gpu", 8.0)
    with pytest.raises(ConfigError, match="use model.fp8='rowwise', 'blockwise' or model.fp8='none'"):
        resolve_kernels(_fp8_config("mxfp8"), "gpu", 9.0)
    c = _fp8_config()
    c.moe.dispatch, c.kernels.expert_gemm = "dropless", "tokamax"
    with pytest.raises(ConfigError, match="FP8 expert GEMM"):
        resolve_kernels(c, "gpu", 9.0)
    c.kernels.expert_gemm = "tile_loop"
    with pytest.raises(ConfigError, match="FP8 expert GEMM"):
        resolve_kernels(c, "cpu")
    c.kernels.expert_gemm = "auto"
    assert resolve_kernels(c, "gpu", 9.0)["expert_gemm"] == "einsum"  # auto: the FP8 (qwix einsum) expert GEMM
    assert resolve_kernels(c, "cpu")["expert_gemm"] == "einsum"  # not the tile loop, which has no FP8 path

def test_fp8_expert_gemm_auto_picks_transformer_engine_only_where_installed_on_gpu(monkeypatch):
    from moejax.kernels import resolve

    c = _fp8_config("mxfp8")
    c.model.d_model, c.moe.d_ff_expert = 256, 128
    monkeypatch.setattr(resolve, "te_available", lambda: False)
    assert resolve_kernels(c, "gpu", 10.3)["expert_gemm"] == "einsum"  # qwix's einsum
    monkeypatch.setattr(resolve, "te_available", lambda: True)
    assert resolve_kernels(c, "gpu", 10.3)["expert_gemm"] == "te"
    c.moe.d_ff_expert = 96  # dims TE's layouts do not take: auto keeps qwix's einsum (asked for by name: an error)
    assert resolve_kernels(c, "gpu", 10.3)["expert_gemm"] == "einsum"
    c.moe.d_ff_expert = 128
    assert resolve_kernels(_fp8_config("tensorwise"), "cpu")["expert_gemm"] == "einsum"  # TE runs on GPUs only
    c.model.fp8 = "blockwise"  # a recipe TE's JAX side does not have: auto keeps qwix's
    assert resolve_kernels(c, "gpu", 9.0)["expert_gemm"] == "einsum"
    c.model.fp8 = "none"  # bf16 through TE only when asked for
    assert resolve_kernels(c, "gpu", 9.0)["expert_gemm"] == "einsum"


def test_transformer_engine_requests_that_cannot_run_are_one_error(monkeypatch):
    from moejax.kernels import resolve

    c = _fp8_config("blockwise")
    c.model.d_model, c.moe.d_ff_expert, c.kernels.expert_gemm = 256, 128, "te"
    monkeypatch.setattr(resolve, "te_available", lambda: False)
    with pytest.raises(ConfigError, match="needs NVIDIA Transformer Engine .* not installed: `make install-te`"):
        resolve_kernels(c, "gpu", 9.0)
    monkeypatch.setattr(resolve, "te_available", lambda: True)
    with pytest.raises(ConfigError, match="runs on NVIDIA GPUs only"):
        resolve_kernels(c, "cpu")
    with pytest.raises(ConfigError, match="no blockwise or rowwise scaling; use model.fp8='mxfp8'"):
        resolve_kernels(c, "gpu", 9.0)
    c.model.fp8, c.moe.d_ff_expert = "tensorwise", 96
    with pytest.raises(ConfigError, match=r"moe.d_ff_expert \(96 per tensor shard\) must be a multiple of 128"):
        resolve_kernels(c, "gpu", 9.0)
    c.moe.d_ff_expert, c.mesh.tensor = 256, 2  # 128 per tensor shard
    assert resolve_kernels(c, "gpu", 9.0)["expert_gemm"] == "te"
    with pytest.raises(ConfigError, match="compute capability >= 8.9"):
        resolve_kernels(c, "gpu", 8.0)





def _dot_operands(jaxpr, out):
    """(lhs aval, rhs aval) of every dot_general in a jaxpr and all its sub-jaxprs (loops, conds, custom VJPs)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(v.aval for v in eqn.invars))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _dot_operands(sub.jaxpr, out)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _dot_operands(sub, out)
    return out


def test_dropless_overflow_rounds_run_their_expert_gemms_in_fp8_forward_and_backward(devices):
    """The overflow rounds' backward re-traces each round outside the model's `fp8.gemms_in`: every expert GEMM of
    the dropless block (round 0, overflow rounds, forward and both backward GEMMs) must still read e4m3."""
    from flax import nnx

    from tests.test_moe_parallel import ADVERSARIAL, inputs, make_moe, moe_cfg
    from moejax.parallel.mesh import batch_sharding, make_mesh
    from moejax.program.state import state_shardings
    cfg = moe_cfg(mode="dropless", window=0.5)
    cfg.d_ff_expert = 24  # a width no other array here has
    moe = make_moe(cfg, 3)
    moe.router.bias_E[...] = jnp.asarray(ADVERSARIAL["all-to-one-expert"][0], jnp.float32)  # overflow rounds
    x, cot = inputs(3)
    graphdef, state = nnx.split(moe)
    mesh = make_mesh({"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}, devices)
    state = jax.device_put(state, state_shardings(state, mesh))
    x = jax.device_put(x, batch_sharding(mesh))

    def loss(state, x, cot):
        with fp8.gemms_in("blockwise"):  # the forward only, as Transformer.hidden does: autodiff traces after
            y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * cot)

    with jax.set_mesh(mesh):
        traced = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(state, x, cot)
    d_ff = cfg.d_ff_expert
    # the expert GEMMs: batched (both operands [tiles or experts, rows, dim]) with the expert FFN width in them
    expert_gemms = [ops for ops in _dot_operands(traced.jaxpr, [])
                    if all(a.ndim == 3 for a in ops) and any(d_ff in a.shape for a in ops)]
    # round 0 and the overflow rounds' forward, the overflow rounds' re-traced forward and both backwards:
    # 3 GEMMs x (1 + 1) forward + 3 x (1 + 2) in the overflow backward + 3 x 2 in round 0's backward
    assert len(expert_gemms) >= 3 * 2 + 3 * 3 + 3 * 2, len(expert_gemms)
    not_fp8 = [ops for ops in expert_gemms if any(a.dtype != jnp.float8_e4m3fn for a in ops)]
    assert not not_fp8, not_fp8


def test_deepseek_fp8_checkpoint_export_and_import(tmp_path):
    """A DeepSeek-V3 model exported in DeepSeek's FP8 layout (e4m3 projections + f32 weight_scale_inv per 128 x 128
    block, the rest bf16) imports back as the dequantised weights: equal to the blocks the reference quantiser
    gives, within e4m3 precision of the trained weights; a non-projection weight round-trips through bf16."""
    import json as _json
    import runpy

    from flax import nnx

    from moejax.interop import load_hf, save_hf
    from moejax.interop.safetensors_io import SafetensorsDir
    from moejax.model.transformer import Transformer
    cfg = runpy.run_path("configs/deepseek_v3_small.py")["get_config"]()
    cfg.model.n_layers, cfg.model.vocab_size, cfg.model.d_model = 2, 384, 256  # d_model: two 128-blocks
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    out = save_hf(model, cfg, tmp_path / "fp8", dtype="float8_e4m3fn")
    files = SafetensorsDir(out)
    hf_config = _json.loads((out / "config.json").read_text())
    assert hf_config["quantization_config"]["weight_block_size"] == [128, 128]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [d_model, d_ff_expert] = [256, 64]
    raw, scale_inv = files._raw(name), files._raw(name.replace(".weight", ".weight_scale_inv"))
    assert raw.dtype == ml_dtypes.float8_e4m3fn and scale_inv.dtype == np.float32 and scale_inv.shape == (2, 1)
    assert files._raw("model.embed_tokens.weight").dtype == ml_dtypes.bfloat16
    assert files._raw("model.layers.1.mlp.gate.weight").dtype == ml_dtypes.bfloat16  # the router stays bf16
    fp8_names = {n for n in files.names() if files._raw(n).dtype == ml_dtypes.float8_e4m3fn}
    assert {n.split(".")[-2] for n in fp8_names} == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                      "o_proj", "gate_proj", "up_proj", "down_proj"}

    original = np.asarray(model.moe_layers.ffn.w_down_ExFxD[...][0, 3], np.float32).T  # HF layout [out, in]
    exported = (raw.astype(np.float32), np.repeat(np.repeat(scale_inv, 128, axis=0), 64, axis=1))  # 128 x 128 blocks
    assert_equals_a_reference(exported, reference_blockwise_weight, original)
    scale = exported[1]
    imported, _ = load_hf(out, base_config=cfg)
    got = np.asarray(imported.moe_layers.ffn.w_down_ExFxD[...][0, 3], np.float32).T
    np.testing.assert_array_equal(got, exported[0] * scale)  # dequantised exactly as the blocks say
    err = np.abs(got - original)
    assert np.all(err <= E4M3_UNIT_ROUNDOFF * np.abs(original) + scale * E4M3_SUBNORMAL_HALF_SPACING)
    assert np.max(err) > 0
    table = np.asarray(model.embed.table_VxD[...], np.float32)
    np.testing.assert_array_equal(np.asarray(imported.embed.table_VxD[...]),
                                  table.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_gemm_benchmark_baseline_runs_its_backward_in_bf16():
    """benchmarks/fp8_gemm.py's bf16 row is the baseline every FP8 ratio is quoted against: its forward and both
    backward GEMMs take bf16 operands (an f32 cotangent would make them f32 GEMMs, half the speed or less)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_gemm", ROOT / "benchmarks" / "fp8_gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(bench.fwd_bwd_for("none"))(x, w, jnp.ones((16, 8), jnp.bfloat16))
    dots = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), [str(e) for e in dots]
