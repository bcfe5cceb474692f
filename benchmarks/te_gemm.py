"""Transformer Engine's grouped GEMM (kernels.expert_gemm='te'), forward + backward, at DeepSeek-V3's routed-expert
shapes on one device: G local experts (8: EP32 over 256 experts), x [R, K=d_model 7168] in ragged groups times
w [G, K, N=expert d_ff 2048]. Per FP8 format: speed, and the numerics of y, dx and dw against an f32 reference.
Prints a table and writes JSON.

    python benchmarks/te_gemm.py [--g 8] [--rows 8192] [--k 7168] [--n 2048] [--formats none,tensorwise] [--steps 20]
    python benchmarks/te_gemm.py --g 4 --rows 1024 --k 256 --n 128 --steps 1 --allow_emulation   # CPU smoke run

Formats (moejax/kernels/te_gemm.py):
  none        bf16 operands (cuBLAS grouped GEMM)
  tensorwise  TE's current scaling: one scale per tensor, e4m3 forward, e5m2 gradients (Hopper)
  mxfp8       TE's MXFP8: an E8M0 scale per 32 elements along each contraction, e4m3 throughout (Blackwell)
Default: none,tensorwise on compute capability 9.x, none,tensorwise,mxfp8 on 10.x and later and on a CPU.

The group sizes are a fixed seeded ragged split, each a multiple of 128 rows (TE's layout) summing to R, with one
empty group (an expert no token picked) when G >= 4. TFLOP/s count 3 GEMMs (fwd, dgrad, wgrad) x 2 x R x K x N.
Relative errors are Frobenius norms against f32 GEMMs of the same (bf16) inputs, group by group. The JSON records
the compiled program's TE calls: by kind (forward, dgrad, wgrad), by operand types (lhs / lhs scales / rhs / rhs
scales) and how many took TE's V2 path (no host sync of the group sizes).

TE runs on a GPU with TE installed. Elsewhere --allow_emulation runs te_gemm's XLA emulation of it (same
quantisation recipe, rows marked 'emulated (XLA)'); without it the JSON gets one row saying why TE did not run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import fp8, te_gemm
from moejax.kernels.resolve import TE_ALIGN, devices_compute_capability, devices_platform, te_available
from moejax.parallel.hlo_kernels import te_grouped_gemms

EMULATED = "emulated (XLA)"


def group_sizes(rows: int, groups: int, seed: int = 0) -> np.ndarray:
    """Ragged sizes, multiples of TE_ALIGN summing to `rows`: the rows' TE_ALIGN-row blocks drawn multinomially over
    Dirichlet(8) shares; group 1 gets none when groups >= 4, so that TE meets an empty group."""
    rng = np.random.default_rng(seed)
    shares_G = rng.dirichlet(np.full(groups, 8.0))
    if groups >= 4:
        shares_G[1] = 0.0
        shares_G /= shares_G.sum()
    return rng.multinomial(rows // TE_ALIGN, shares_G).astype(np.int32) * TE_ALIGN


@functools.partial(jax.jit, static_argnums=3)
def reference(x_RxK, w_GxKxN, ct_RxN, sizes: tuple[int, ...]):
    """(y, dx, dw) in f32, one plain GEMM per group (HIGHEST: no TF32 on a GPU)."""
    f32, dot = jnp.float32, functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    x_RxK, w_GxKxN, ct_RxN = x_RxK.astype(f32), w_GxKxN.astype(f32), ct_RxN.astype(f32)
    ys, dxs, dws, start = [], [], [], 0
    for g, size in enumerate(sizes):
        x_SxK, ct_SxN = x_RxK[start:start + size], ct_RxN[start:start + size]
        ys.append(dot(x_SxK, w_GxKxN[g]))
        dxs.append(dot(ct_SxN, w_GxKxN[g].T))
        dws.append(dot(x_SxK.T, ct_SxN))
        start += size
    return jnp.concatenate(ys), jnp.concatenate(dxs), jnp.stack(dws)


def fwd_bwd_for(fmt: str):
    """jit of (x, w, sizes, cotangent) -> (y, dx, dw). The cotangent is an input (random, like a real gradient): a
    constant one would let XLA simplify the backward GEMMs."""

    def gemm(x_RxK, w_GxKxN, sizes_G):
        with fp8.gemms_in(fmt):
            return te_gemm.grouped_dense(x_RxK, w_GxKxN, sizes_G)

    @jax.jit
    def fwd_bwd(x_RxK, w_GxKxN, sizes_G, ct_RxN):
        y_RxN, vjp = jax.vjp(lambda x, w: gemm(x, w, sizes_G), x_RxK, w_GxKxN)
        dx_RxK, dw_GxKxN = vjp(ct_RxN.astype(y_RxN.dtype))
        return y_RxN, dx_RxK, dw_GxKxN

    return fwd_bwd


def te_calls(hlo_text: str) -> dict:
    """The compiled program's TE grouped GEMMs counted by kind and by operand types; 'v2' of 'total' took the V2
    path (none on a CPU: the emulation has no TE call)."""
    gemms = te_grouped_gemms(hlo_text)
    return {"by_kind": dict(Counter(g["kind"] for g in gemms)),
            "by_operands": dict(Counter("/".join(g["operands"]) for g in gemms)),
            "v2": sum(g["v2"] for g in gemms), "total": len(gemms)}


def calls_text(c: dict) -> str:
    if not c["total"]:
        return "none"
    return "; ".join([", ".join(f"{k} x{n}" for k, n in c["by_kind"].items()),
                      ", ".join(f"{ops} x{n}" for ops, n in c["by_operands"].items()), f"V2 {c['v2']} of {c['total']}"])


def measure(fmt: str, args_in, refs, steps: int) -> dict:
    compiled = fwd_bwd_for(fmt).lower(*args_in).compile()
    for _ in range(3):
        out = compiled(*args_in)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = compiled(*args_in)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / steps
    errs = {f"rel_err_{name}": float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            for name, got, ref in zip(("y", "dx", "dw"), out, refs)}
    return {"format": fmt, "step_ms": step_s * 1e3, **errs, "te_calls": te_calls(compiled.as_text())}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--g", type=int, default=8, help="local experts (groups)")
    p.add_argument("--rows", type=int, default=8192, help=f"rows (token-expert pairs), a multiple of {TE_ALIGN}")
    p.add_argument("--k", type=int, default=7168, help="contraction (d_model)")
    p.add_argument("--n", type=int, default=2048, help="columns (an expert's d_ff)")
    p.add_argument("--formats", default=None, help="comma-separated; default by compute capability (module doc)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--allow_emulation", action="store_true",
                   help="without a GPU or without TE: time te_gemm's XLA emulation instead (CPU smoke runs)")
    p.add_argument("--json", default="benchmarks/results/te_gemm.json")
    args = p.parse_args()
    if args.rows % TE_ALIGN:
        p.error(f"--rows must be a multiple of {TE_ALIGN} (TE's group layout), got {args.rows}")

    devices = jax.devices()
    dev, platform, cc = devices[0], devices_platform(devices), devices_compute_capability(devices)
    hopper_or_older = cc is not None and cc < 10  # MXFP8 needs Blackwell; a CPU runs all three emulated
    formats = (args.formats or ("none,tensorwise" if hopper_or_older else "none,tensorwise,mxfp8")).split(",")
    why_not_te = ("Transformer Engine's grouped GEMM needs an NVIDIA GPU" if platform != "gpu" else
                  "Transformer Engine is not installed (make install-te; NVIDIA's JAX containers ship it)"
                  if not te_available() else None)
    impl = EMULATED if why_not_te and args.allow_emulation else "te"
    sizes_G = group_sizes(args.rows, args.g)
    shape = {"g": args.g, "rows": args.rows, "k": args.k, "n": args.n, "dtype": args.dtype,
             "group_sizes": sizes_G.tolist()}
    rows = []

    def write():  # after each format: a run cut short keeps what it measured
        out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               "command": shlex.join(["python", *sys.argv]), "jax": jax.__version__, "device": dev.device_kind,
               "te_gemm": {"shape": shape, "implementation": impl, "formats": rows}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))

    print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}: x [{args.rows}, {args.k}] in {args.g} groups "
          f"{sizes_G.tolist()} @ w [{args.g}, {args.k}, {args.n}] fwd+bwd, {args.dtype} in/out")
    if why_not_te and not args.allow_emulation:  # a row that says so, not a crash: the other runs go on
        print(f"{why_not_te}: nothing measured (--allow_emulation times te_gemm's XLA emulation instead)")
        rows.append({"format": ",".join(formats), "implementation": impl, "error": why_not_te})
        write()
        print(f"wrote {args.json}")
        return
    print(f"{why_not_te}: timing te_gemm's XLA emulation, rows marked {EMULATED!r}" if why_not_te else
          "implementation: Transformer Engine (transformer_engine.jax.dense.grouped_dense)")

    dt = jnp.dtype(args.dtype)
    ks = jax.random.split(jax.random.key(0), 3)
    x_RxK = jax.random.normal(ks[0], (args.rows, args.k), dt)
    w_GxKxN = (jax.random.normal(ks[1], (args.g, args.k, args.n), jnp.float32) / args.k**0.5).astype(dt)
    ct_RxN = jax.random.normal(ks[2], (args.rows, args.n), dt)
    args_in = (x_RxK, w_GxKxN, jnp.asarray(sizes_G), ct_RxN)
    refs = reference(x_RxK, w_GxKxN, ct_RxN, tuple(sizes_G.tolist()))
    flops = 3 * 2 * args.rows * args.k * args.n
    print(f"  {'format':<11}{'step ms':>9}{'TFLOP/s':>9}{'vs none':>9}{'err y':>9}{'err dx':>9}{'err dw':>9}"
          f"  TE calls")
    with te_gemm.stand_in() if impl == EMULATED else contextlib.nullcontext():
        for fmt in formats:
            try:
                r = {"implementation": impl, **measure(fmt, args_in, refs, args.steps)}
            except Exception as err:  # a format this GPU or TE cannot run is a row that says why, not the end
                r = {"format": fmt, "implementation": impl,
                     "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                print(f"  {fmt:<11}failed: {r['error']}")
                rows.append(r)
                write()
                continue
            r["tflops"] = flops / r["step_ms"] * 1e-9
            base = next((q for q in rows if q["format"] == "none" and "step_ms" in q), None)
            r["speed_vs_none"] = base["step_ms"] / r["step_ms"] if base else None
            vs = f"{r['speed_vs_none']:.2f}x" if base else "-"
            print(f"  {fmt:<11}{r['step_ms']:>9.3f}{r['tflops']:>9.3g}{vs:>9}{r['rel_err_y']:>9.1e}"
                  f"{r['rel_err_dx']:>9.1e}{r['rel_err_dw']:>9.1e}  {calls_text(r['te_calls'])}")
            rows.append(r)
            write()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
