"""Transformer Engine's grouped GEMM path on CPU (TE itself runs on GPUs only: tests/test_te_compile.py reads its
compiled program): the emulation the planner traces and the layout tests run (kernels/te_gemm.py), and the stand-in
CUDA driver the deviceless compile loads (planner/te_deviceless.py)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import fp8, te_gemm

GROUPS = np.array([256, 0, 128, 384], np.int32)  # 128-aligned, one empty group; sums to the rows


def _operands(seed, k=256, n=192):
    rng = np.random.default_rng(seed)
    rows = int(GROUPS.sum())
    x = (rng.standard_normal((rows, k)) * np.exp(rng.standard_normal((rows, 1)))).astype(np.float32)
    w = (rng.standard_normal((len(GROUPS), k, n)) * 0.05).astype(np.float32)
    dy = rng.standard_normal((rows, n)).astype(np.float32)
    return x, w, dy


def _exact(x, w, dy):
    """f64 forward, input gradient and weight gradient of the grouped product."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    starts = np.concatenate([[0], np.cumsum(GROUPS)])
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    for g in range(len(GROUPS)):
        rows = slice(starts[g], starts[g + 1])
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
    return y, dx, dw


def _run(fmt, x, w, dy):
    with te_gemm.stand_in(), fp8.gemms_in(fmt):
        y, vjp = jax.vjp(lambda x, w: te_gemm.grouped_dense(x, w, jnp.asarray(GROUPS)), jnp.asarray(x), jnp.asarray(w))
        return (y, *vjp(jnp.asarray(dy)))


def test_bf16_emulation_is_the_grouped_product_forward_and_backward():
    x, w, dy = _operands(0)
    for got, want in zip(_run("none", x, w, dy), _exact(x, w, dy)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["mxfp8", "tensorwise"])
def test_fp8_emulation_quantises_every_gemm(fmt):
    """Forward, dgrad and wgrad each carry an FP8 error (not zero: the operands were quantised; bounded: the scales
    are right), and the residuals kept for the backward are the quantised copies, as TE keeps them."""
    x, w, dy = _operands(1)
    for name, got, want in zip(("y", "dx", "dw"), _run(fmt, x, w, dy), _exact(x, w, dy)):
        relative = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert 3e-3 < relative < (0.1 if fmt == "mxfp8" else 0.2), (name, relative)
    from jax._src.ad_checkpoint import saved_residuals

    def f(x, w):
        with te_gemm.stand_in(), fp8.gemms_in(fmt):
            return te_gemm.grouped_dense(x, w, jnp.asarray(GROUPS)).sum()

    kept = [aval for aval, source in saved_residuals(f, jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
            if aval.size > 64]  # x and w quantised, and their scales (E8M0 per 32 values for MXFP8)
    values = sorted(a.size for a in kept if a.dtype == jnp.float8_e4m3fn)
    scales = sorted(a.size for a in kept if a.dtype == jnp.float8_e8m0fnu)
    assert values == sorted([x.size, w.size]), kept
    assert scales == (sorted([x.size // 32, w.size // 32]) if fmt == "mxfp8" else []), kept
    assert len(kept) == len(values) + len(scales), kept


def test_rows_not_in_whole_groups_of_128_are_refused():
    with te_gemm.stand_in(), pytest.raises(ValueError, match="multiples of 128"):
        te_gemm.expert_ffn(jnp.zeros((200, 8)), *(jnp.zeros((2, 8, 8)),) * 3, jnp.array([100, 100], jnp.int32))


def test_stand_in_cuda_driver_builds_and_answers_no_device(tmp_path):
    """The deviceless compile's stand-in libcuda.so.1: built with the C compiler into the cache, named by its soname
    (so libraries linked against libcuda.so.1 bind to it), every entry point answering CUDA_ERROR_NO_DEVICE."""
    code = """
import ctypes, sys
from moejax.planner import te_deviceless
lib = te_deviceless.stub_driver_path()
assert lib.parent.parent.parent == __import__("pathlib").Path(sys.argv[1]), lib
cuda = ctypes.CDLL(str(lib))
assert all(getattr(cuda, name)() == 100 for name in te_deviceless.STUB_ENTRY_POINTS)
text = ctypes.c_char_p()
assert cuda.cuGetErrorString(100, ctypes.byref(text)) == 0 and b"no GPU" in text.value
print(open(lib, "rb").read().count(b"libcuda.so.1"))
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env={"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 1  # the soname is in the library
