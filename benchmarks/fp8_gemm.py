"""One GEMM, forward + backward (y = x @ w, then dx and dw), in bf16 and in FP8 recipes, on one device: what an
FP8 recipe buys or costs per GEMM before anything else in the step. Prints a table and writes JSON.

    python benchmarks/fp8_gemm.py [--m 8192] [--k 7168] [--n 2048] [--formats none,blockwise,rowwise] [--steps 20]

Formats:
  none       bf16 operands, f32 accumulation inside the GEMM, bf16 out (jnp.dot); the backward GEMMs in bf16.
  blockwise  moejax's model.fp8='blockwise' GEMM (kernels/fp8.py: DeepSeek-V3's 1 x 128 / 128 x 128 tiles via qwix):
             qwix contracts each 128-wide K tile as its own f8 GEMM and sums the scaled f32 partials, so every
             K tile writes an M x N f32 partial: on a GPU without a fused-promotion kernel this is memory-bound.
  rowwise    model.fp8='rowwise': one scale per row of each operand along the contraction (activations per token,
             weights per output column; the backward re-quantises along its own contraction), so each GEMM is one
             f8 GEMM whose scales apply after it.
  mxfp8      moejax's model.fp8='mxfp8' (cuDNN block-scaled GEMM; Blackwell).

TFLOP/s count 2 FLOPs per multiply-add, three GEMMs (fwd, dgrad, wgrad). The JSON records each compiled program's
GEMM custom calls (e.g. `__cublas$lt$matmul$f8`: cuBLASLt FP8).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from moejax.kernels import fp8
from moejax.parallel.hlo_kernels import gemm_custom_calls, kernel_inventory


def matmul_for(fmt: str):
    """The GEMM of `fmt`. The bf16 baseline is a plain bf16 dot (f32 accumulation inside the GEMM, bf16 out), as
    the model's projections run: asking for an f32 result (preferred_element_type) would make autodiff's
    cotangent f32, and the two backward GEMMs would run f32 x bf16, i.e. in f32 (the 2026-12-04 H200 baseline's
    error: 345 TFLOP/s against 680 for benchmarks/kernels.py's bf16 GEMM)."""
    if fmt == "none":
        return lambda x, w: jnp.dot(x, w)
    return lambda x, w: fp8.fp8_matmul(x[None], w[None], fmt)[0]


def fwd_bwd_for(fmt: str):
    """jit of (x, w, cotangent) -> (y, dx, dw). The cotangent is an input (random, like a real gradient): a
    constant one would let XLA simplify the backward GEMMs into reductions."""
    mm = matmul_for(fmt)

    @jax.jit
    def fwd_bwd(x, w, ct):
        y, vjp = jax.vjp(mm, x, w)
        dx, dw = vjp(ct.astype(y.dtype))
        return y, dx, dw

    return fwd_bwd


def measure(fmt: str, x, w, steps: int) -> dict:
    ct = jax.random.normal(jax.random.key(2), (x.shape[0], w.shape[1]), x.dtype)
    compiled = fwd_bwd_for(fmt).lower(x, w, ct).compile()
    for _ in range(3):
        out = compiled(x, w, ct)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = compiled(x, w, ct)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / steps
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    rel_err = float(jnp.linalg.norm(out[0].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    inv = kernel_inventory(compiled.as_text())
    return {"format": fmt, "step_ms": step_s * 1e3, "rel_err_fwd": rel_err, "gemm_custom_calls": gemm_custom_calls(inv),
            "fusions": inv["fusions"], "dots": inv["dots"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=8192, help="rows (tokens)")
    p.add_argument("--k", type=int, default=7168, help="contraction (d_model)")
    p.add_argument("--n", type=int, default=2048, help="columns (an expert's d_ff)")
    p.add_argument("--formats", default="none,blockwise,rowwise")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default="benchmarks/results/fp8_gemm.json")
    args = p.parse_args()
    dt = jnp.dtype(args.dtype)
    x = jax.random.normal(jax.random.key(0), (args.m, args.k), dt)
    w = (jax.random.normal(jax.random.key(1), (args.k, args.n), jnp.float32) / args.k**0.5).astype(dt)
    flops = 3 * 2 * args.m * args.k * args.n
    dev = jax.devices()[0]
    print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}: x [{args.m}, {args.k}] @ w [{args.k}, "
          f"{args.n}] fwd+bwd, {args.dtype} in/out")
    print(f"  {'format':<11}{'step ms':>9}{'TFLOP/s':>9}{'vs none':>9}{'rel err':>9}  GEMM custom calls")
    rows = []
    for fmt in args.formats.split(","):
        try:
            r = measure(fmt, x, w, args.steps)
        except Exception as err:  # a format this platform cannot run is a row that says why, not the end
            r = {"format": fmt, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            print(f"  {fmt:<11}failed: {r['error']}")
            rows.append(r)
            continue
        r["tflops"] = flops / r["step_ms"] * 1e-9
        base = next((q for q in rows if q["format"] == "none" and "step_ms" in q), None)
        r["speed_vs_none"] = base["step_ms"] / r["step_ms"] if base else None
        vs = f"{r['speed_vs_none']:.2f}x" if base else "-"
        print(f"  {fmt:<11}{r['step_ms']:>9.3f}{r['tflops']:>9.1f}{vs:>9}{r['rel_err_fwd']:>9.1e}  "
              f"{r['gemm_custom_calls']}")
        rows.append(r)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "command": shlex.join(["python", *sys.argv]), "jax": jax.__version__, "device": dev.device_kind,
           "fp8_gemm": {"shape": {"m": args.m, "k": args.k, "n": args.n, "dtype": args.dtype}, "formats": rows}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
