"""FP8 GEMMs for training, quantised by qwix: every forward and backward GEMM of a projection reads e4m3 inputs.

Three formats (`model.fp8`):
  blockwise  DeepSeek-V3's recipe (arXiv 2412.19437, section 3.3): activations and gradients scaled per 1 x 128 tile
             along the GEMM's contraction, weights per 128 x 128 block, scale = amax / 448 in f32, f32
             accumulation. Hopper (compute capability >= 8.9) and later.
  rowwise    one scale per row of every operand along the GEMM's contraction (activations per token, weights per
             output column, gradients per row; each backward GEMM re-quantises along its own contraction), amax / 448
             in f32: the scales factor out of the sum, so each GEMM is one f8 x f8 GEMM with its scales applied after
             it (cuBLASLt FP8 on Hopper). Coarser than blockwise (one scale per up to d_ff elements instead of 128);
             on an H200 one 8192 x 7168 x 2048 GEMM fwd+bwd ran 2.17x bf16 where blockwise ran 0.35x (README, FP8).
  tensorwise one scale per tensor from its current amax (amax / the format's max, f32), e4m3 in the forward and
             e5m2 for the gradients (the "hybrid" format): Transformer Engine's current scaling, which its FP8 grouped
             GEMM runs on Hopper (kernels.expert_gemm='te', kernels/te_gemm.py). A batched operand [G, M, K] has one
             scale per g (each expert's weights, each expert's rows).
  mxfp8      OCP microscaling as NVIDIA trains with it on Blackwell (arXiv 2506.08027): every operand scaled per 1 x 32
             block along the contraction by a power of two (E8M0), rounded up (2^ceil(log2(amax / 448))) so no
             value saturates; each GEMM re-quantises its operands along its own contraction. On GPUs the GEMM is
             `jax.nn.scaled_matmul` (cuDNN's block-scaled FP8 GEMM); elsewhere qwix's dequantise-then-dot.

qwix does the quantisation (`qwix.quantize`: calibration, scale, cast) and the quantised dot (`qwix.dot_general`:
f8 x f8 dots per contraction tile, scaled and summed in f32: for blockwise that is one GEMM of depth 128 per tile
whose f32 partials all reach memory, which is why it runs below bf16 on GPUs without a fused-promotion kernel);
this module only says which axes each operand of
each GEMM is tiled along (the recipe) and wires forward and backward into one custom VJP.

Every GEMM is brought to a canonical batched form first: x [G, M, K] times w [G, K, N] (G: the einsum's batch
letters, e.g. the experts; M: x's own letters, the tokens; K: the contracted letters flattened, as DeepSeek's 2-D
weights flatten heads x head_dim). A tiled axis longer than the tile and not a multiple of it is zero-padded to one
(a zero changes no tile's amax, so the result equals tiles that end early); an axis not longer than a blockwise
tile is one tile. Master weights, optimizer state and the weight gradients stay f32; the backward saves the
unquantised inputs and re-quantises them (the 128 x 128 weight blocks give the same e4m3 values either way).

What stays in higher precision is decided by the callers: only `layers.project` and the expert grouped GEMM ask
for FP8 and only while the model's body runs (`gemms_in`), so the router, norms, attention's softmax GEMMs, the
embedding and the LM head never do.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import qwix

from moejax.kernels.varying import cotangent, mark_varying, varying

FORMATS = ("none", "blockwise", "rowwise", "tensorwise", "mxfp8")
E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2  # tensorwise gradients
E4M3_MAX = 448.0
BLOCKWISE_TILE = 128  # DeepSeek-V3: 1 x 128 activation tiles, 128 x 128 weight blocks
MXFP8_BLOCK = 32  # OCP MX: 32 elements share one E8M0 scale

_ACTIVE = contextvars.ContextVar("moejax_fp8_format", default="none")


@contextlib.contextmanager
def gemms_in(fmt: str):
    """Projections and expert GEMMs traced inside this block run in `fmt` ('none': the compute dtype)."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format {fmt!r} is not one of {FORMATS}")
    token = _ACTIVE.set(fmt)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> str:
    return _ACTIVE.get()


def einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w), with FP8 inputs inside `gemms_in` (the model's body with model.fp8 set)."""
    fmt = active()
    return jnp.einsum(spec, x, w) if fmt == "none" else fp8_einsum(spec, x, w, fmt)


def _tile(length: int, fmt: str) -> tuple[int, int]:
    """(tile, padded length) for an axis of `length` quantised in `fmt`."""
    if fmt == "mxfp8":
        return MXFP8_BLOCK, -(-length // MXFP8_BLOCK) * MXFP8_BLOCK
    if length <= BLOCKWISE_TILE:
        return length, length
    return BLOCKWISE_TILE, -(-length // BLOCKWISE_TILE) * BLOCKWISE_TILE


def _pad(a, axis: int, length: int):
    extra = length - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def quantize_rows(a_GxRxK, fmt: str, *, gradient: bool = False) -> qwix.QArray:
    """Each row's 1 x tile blocks along the last (contraction) axis, zero-padded to whole tiles; scales f32.
    rowwise: the whole row is the one block; tensorwise: each [R, K] matrix is (e5m2 for a gradient)."""
    if fmt == "rowwise":
        return qwix.quantize(a_GxRxK.astype(jnp.float32), E4M3, channelwise_axes=(0, 1))
    if fmt == "tensorwise":
        return qwix.quantize(a_GxRxK.astype(jnp.float32), E5M2 if gradient else E4M3, channelwise_axes=(0,))
    tile, padded = _tile(a_GxRxK.shape[2], fmt)
    qtype = "mxfp8" if fmt == "mxfp8" else E4M3
    return qwix.quantize(_pad(a_GxRxK.astype(jnp.float32), 2, padded), qtype, channelwise_axes=(0, 1),
                         tiled_axes={2: tile})


def quantize_weight_blocks(w_GxCxK) -> qwix.QArray:
    """128 x 128 blocks over (C, K) (DeepSeek-V3's weights), returned with each block's scale repeated over its
    C rows: the same values and scales, laid out as the per-row tiles along K that qwix's dot contracts."""
    rows = w_GxCxK.shape[1]
    row_tile, padded_rows = _tile(rows, "blockwise")
    tile, padded = _tile(w_GxCxK.shape[2], "blockwise")
    w = _pad(_pad(w_GxCxK.astype(jnp.float32), 1, padded_rows), 2, padded)
    q = qwix.quantize(w, E4M3, channelwise_axes=(0,), tiled_axes={1: row_tile, 2: tile})
    scale_GxCxT = jnp.repeat(q.scale, row_tile, axis=1)[:, :rows]
    return qwix.QArray(q.qvalue[:, :rows], scale_GxCxT, None, q.qtype)


def _mxfp8_scaled_matmul(a_q, b_q):
    """cuDNN's block-scaled GEMM: e4m3 values, E8M0 scales, f32 out."""
    e8m0 = jnp.float8_e8m0fnu
    y = jax.nn.scaled_matmul(a_q.qvalue, b_q.qvalue, a_q.scale.astype(e8m0), b_q.scale.astype(e8m0),
                             preferred_element_type=jnp.float32)
    # Inside shard_map its result is typed varying over no axis although each device computed its own.
    return mark_varying(y, varying(a_q.qvalue) | varying(b_q.qvalue))


def _qdot(a_q, b_q):
    """[G, R, K] . [G, C, K] -> [G, R, C] in f32, contracting the last axes of both."""
    dims = (((2,), (2,)), ((0,), (0,)))
    return qwix.dot_general(a_q, b_q, dims, preferred_element_type=jnp.float32)


def quantized_gemm(a_GxRxK, b_GxCxK, fmt: str, *, b_is_weight: bool, a_is_grad: bool = False,
                   b_is_grad: bool = False):
    """a . b^T over the last axis with both operands in FP8 (f32 result): the one GEMM every forward and
    backward product below reduces to. b_is_weight selects the blockwise recipe's 128 x 128 weight blocks; the
    *_is_grad flags the tensorwise recipe's e5m2 gradients."""
    a_q = quantize_rows(a_GxRxK, fmt, gradient=a_is_grad)
    if fmt == "blockwise" and b_is_weight:
        b_q = quantize_weight_blocks(b_GxCxK)
    else:
        b_q = quantize_rows(b_GxCxK, fmt, gradient=b_is_grad)
    if fmt == "mxfp8":
        # XLA:CPU (jax 0.10) has no lowering for scaled_matmul: pick by the platform being compiled for.
        return jax.lax.platform_dependent(a_q, b_q, cuda=lambda a, b: _mxfp8_scaled_matmul(a, b),
                                          default=lambda a, b: _qdot(a, b))
    return _qdot(a_q, b_q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_matmul(x_GxMxK, w_GxKxN, fmt: str):
    """x @ w per batch g with FP8 inputs in forward and backward; output in x's dtype, weight gradient in w's."""
    return _forward(x_GxMxK, w_GxKxN, fmt)


def _forward(x_GxMxK, w_GxKxN, fmt):
    y = quantized_gemm(x_GxMxK, jnp.swapaxes(w_GxKxN, 1, 2), fmt, b_is_weight=True).astype(x_GxMxK.dtype)
    return mark_varying(y, varying(x_GxMxK) | varying(w_GxKxN))


def _fp8_matmul_fwd(x_GxMxK, w_GxKxN, fmt):
    return _forward(x_GxMxK, w_GxKxN, fmt), (x_GxMxK, w_GxKxN)


def _fp8_matmul_bwd(fmt, residuals, dy_GxMxN):
    x_GxMxK, w_GxKxN = residuals
    # dgrad: dy (1 x tile along N) . w's blocks (the same 128 x 128 blocks, now contracted along N)
    dx = quantized_gemm(dy_GxMxN, w_GxKxN, fmt, b_is_weight=True, a_is_grad=True)
    # wgrad: contraction over the tokens, so x and dy are tiled along M (DeepSeek's 128 x 1 tiles)
    dw = quantized_gemm(jnp.swapaxes(x_GxMxK, 1, 2), jnp.swapaxes(dy_GxMxN, 1, 2), fmt, b_is_weight=False,
                        b_is_grad=True)
    # Inside shard_map: each cotangent summed over the mesh axes its primal is invariant on (e.g. tensor).
    return (cotangent(dx.astype(x_GxMxK.dtype), varying(dy_GxMxN) | varying(w_GxKxN), x_GxMxK),
            cotangent(dw.astype(w_GxKxN.dtype), varying(x_GxMxK) | varying(dy_GxMxN), w_GxKxN))


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _canonical(spec: str):
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    batch = [c for c in xs if c in ws and c in out]
    contract = [c for c in xs if c in ws and c not in out]
    x_only = [c for c in xs if c not in ws]
    w_only = [c for c in ws if c not in xs]
    if sorted(batch + contract + x_only) != sorted(xs) or sorted(batch + x_only + w_only) != sorted(out):
        raise ValueError(f"fp8_einsum takes a plain two-operand GEMM spec, got {spec!r}")
    return xs, ws, out, batch, contract, x_only, w_only


def fp8_einsum(spec: str, x, w, fmt: str):
    """jnp.einsum(spec, x, w) with FP8 inputs (`fmt`), as [G, M, K] x [G, K, N] (module docstring)."""
    xs, ws, out, batch, contract, x_only, w_only = _canonical(spec)
    size = {c: d for c, d in zip(xs, x.shape)} | {c: d for c, d in zip(ws, w.shape)}
    prod = lambda letters: math.prod(size[c] for c in letters)  # noqa: E731
    g, m, k, n = prod(batch), prod(x_only), prod(contract), prod(w_only)
    x_GxMxK = jnp.transpose(x, [xs.index(c) for c in batch + x_only + contract]).reshape(g, m, k)
    w_GxKxN = jnp.transpose(w, [ws.index(c) for c in batch + contract + w_only]).reshape(g, k, n)
    y = fp8_matmul(x_GxMxK, w_GxKxN, fmt).reshape([size[c] for c in batch + x_only + w_only])
    order = batch + x_only + w_only
    return jnp.transpose(y, [order.index(c) for c in out])
