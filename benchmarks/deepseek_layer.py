"""One DeepSeek-V3 layer slice, forward + backward, on one device: MLA at full width (hidden 7168, 128 heads,
q_lora 1536, kv_lora 512, YaRN) and an MoE block holding the 8 experts one GPU of an EP32 group holds (plus
the shared expert), on `--tokens` tokens in `--dtype`. Reports measured TFLOP/s (Megatron convention: 6 FLOPs
per multiply-add of every GEMM, causal half of core attention) and MFU against a bf16 matmul peak measured in
the same run. Prints a table and writes JSON.

    python benchmarks/deepseek_layer.py [--tokens 4096] [--seq 4096] [--dtype bfloat16] [--steps 10]
    python benchmarks/deepseek_layer.py --scale 0.125 --tokens 512 --seq 512 --dtype float32   # CPU smoke run

Kernels are the config's strategies (moejax/kernels/resolve.py): `--attention` and `--expert_gemm` (default
auto) are resolved against the platform of jax.devices()[0] (this is a one-device script) for `--dispatch`, as a
training run resolves them, and printed (`xla (auto)/tile_loop (auto)`); auto is xla with tile_loop for dropless
(einsum for capacity) on CPU, tokamax_mosaic with tokamax for dropless (einsum for capacity) on GPUs. A kernel the
platform, the head dims or the installed packages cannot run is refused with the ConfigError saying what to
change.

`--dispatch capacity` runs the capacity path (capacity factor 1.25, batched einsum GEMMs) instead of dropless;
`--fp8 blockwise|rowwise|mxfp8` runs the GEMMs in FP8 (model.fp8; the expert GEMM is then the einsum one). The JSON records
what the compiled program runs (custom-call targets, fusion kinds, the element types of every dot's operands), so a
GPU run says whether its GEMMs are FP8 cuBLASLt calls.

Expert routing inside the slice: every token picks `--top_k` (default 2) of the 8 local experts, which is an
EP32 GPU's average expert load (4096 tokens x top-8 / 32 ranks = 1024 = 4096 x 2 / 8 assignments per expert).
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
import numpy as np
from flax import nnx

from moejax.config import ATTENTION_KERNELS, EXPERT_GEMM_KERNELS, ConfigError, default_config
from moejax.config.schema import FP8_FORMATS
from moejax.kernels import fp8
from moejax.kernels.resolve import apply_kernels, devices_compute_capability, devices_platform, kernel_label
from moejax.model.accounting import FLOPS_PER_MAC_TRAIN, _attention_macs_per_token
from moejax.model.transformer import Block
from moejax.parallel.hlo_kernels import kernel_inventory
from moejax.training.metrics import measure_matmul_peak


def slice_config(scale: float, top_k: int, dtype: str, attention: str = "auto", expert_gemm: str = "auto",
                 dispatch: str = "dropless", fp8_format: str = "none"):
    c = default_config()
    m, e = c.model, c.moe
    s = lambda n: max(8, int(n * scale))  # noqa: E731
    m.d_model, m.n_heads = s(7168), max(1, int(128 * scale))
    m.attention, m.q_lora_rank, m.kv_lora_rank = "mla", s(1536), s(512)
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 128, 64, 128
    m.rope_interleave, m.rope_scaling = True, "yarn"
    m.yarn.factor, m.yarn.original_max_position, m.yarn.mscale, m.yarn.mscale_all_dim = 40.0, 4096, 1.0, 1.0
    m.dtype, m.param_dtype = dtype, "float32"
    e.n_routed_experts, e.n_shared_experts, e.top_k, e.d_ff_expert = 8, 1, top_k, s(2048)
    e.score_func, e.routed_scaling = "sigmoid", 2.5
    e.dispatch, e.capacity_factor = dispatch, (0.0 if dispatch == "dropless" else 1.25)
    m.fp8 = fp8_format
    c.kernels.attention, c.kernels.expert_gemm = attention, expert_gemm
    return c


def slice_flops(cfg, tokens: int, seq: int) -> float:
    m, e = cfg.model, cfg.moe
    moe = 3 * m.d_model * e.d_ff_expert * (e.top_k + e.n_shared_experts)
    return FLOPS_PER_MAC_TRAIN * tokens * (_attention_macs_per_token(m, seq) + moe)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="width multiplier (1.0 = DeepSeek-V3)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--matmul_n", type=int, default=0, help="peak matmul size; 0: 8192 (1024 on CPU)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_KERNELS, help="kernels.attention")
    p.add_argument("--expert_gemm", default="auto", choices=EXPERT_GEMM_KERNELS, help="kernels.expert_gemm")
    p.add_argument("--dispatch", default="dropless", choices=("dropless", "capacity"), help="moe.dispatch")
    p.add_argument("--fp8", default="none", choices=FP8_FORMATS, help="model.fp8")
    p.add_argument("--json", default="benchmarks/results/deepseek_layer.json")
    args = p.parse_args()

    cfg = slice_config(args.scale, args.top_k, args.dtype, args.attention, args.expert_gemm, args.dispatch, args.fp8)
    device = jax.devices()[:1]
    platform = devices_platform(device)
    try:
        print(apply_kernels(cfg, platform, devices_compute_capability(device)), flush=True)
    except ConfigError as err:
        sys.exit(f"deepseek_layer: {err}")
    dt = jnp.dtype(args.dtype)
    block = Block(cfg, moe=True, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    batch = args.tokens // args.seq
    x = jax.random.normal(jax.random.key(1), (batch, args.seq, cfg.model.d_model), dt)
    positions = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), (batch, args.seq))

    @jax.jit
    def fwd_bwd(params, rest, x):
        def loss(p, r, x):
            with fp8.gemms_in(args.fp8):  # what the Transformer's body does with model.fp8 set
                y, stats = nnx.merge(graphdef, p, r)(x, positions)
            return jnp.mean(y.astype(jnp.float32) ** 2) + jnp.sum(stats.aux_loss)

        return jax.grad(loss, argnums=(0, 1, 2))(params, rest, x)

    t0 = time.perf_counter()
    compiled = fwd_bwd.lower(params, rest, x).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        out = compiled(params, rest, x)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = compiled(params, rest, x)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / args.steps
    flops = slice_flops(cfg, args.tokens, args.seq)
    peak = measure_matmul_peak(dt, args.matmul_n or (1024 if platform == "cpu" else 8192))
    row = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "command": shlex.join(["python", *sys.argv]), "jax": jax.__version__, "platform": platform,
           "kernels": {k: cfg.kernels[k] for k in ("attention", "expert_gemm")},
           "dispatch": args.dispatch, "fp8": args.fp8, "compiled": kernel_inventory(compiled.as_text()),
           "device": jax.devices()[0].device_kind, "dtype": args.dtype, "tokens": args.tokens, "seq": args.seq,
           "scale": args.scale, "d_model": cfg.model.d_model, "experts": 8, "top_k": args.top_k,
           "compile_s": round(compile_s, 2), "step_ms": round(step_s * 1e3, 3),
           "model_tflop_per_step": flops / 1e12, "tflops": flops / step_s / 1e12,
           "matmul_peak_tflops": peak / 1e12, "mfu_vs_measured_peak": flops / step_s / peak}
    kernels = "/".join(kernel_label(cfg.kernels[k], getattr(args, k)) for k in ("attention", "expert_gemm"))
    kernels += f"/fp8 {args.fp8}" if args.fp8 != "none" else ""
    print(f"{'device':<24}{'dtype':<10}{'attn/gemm':<40}{'tokens':>8}{'step ms':>10}{'TFLOP/s':>10}"
          f"{'peak TFLOP/s':>14}{'MFU':>8}")
    print(f"{row['device']:<24}{row['dtype']:<10}{kernels:<40}{row['tokens']:>8}{row['step_ms']:>10.2f}"
          f"{row['tflops']:>10.2f}{row['matmul_peak_tflops']:>14.1f}{row['mfu_vs_measured_peak']:>8.1%}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
