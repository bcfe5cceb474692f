"""Routed-expert layer speed: forward+backward of every dispatch mode x grouped-matmul backend, beside the
same useful FLOPs as one dense SwiGLU ("ideal": every token's K expert rows through one expert-sized FFN,
no routing), all measured in one run on the same mesh. Prints a table of ratios, writes JSON.

    python benchmarks/moe_layer.py [--experts 16 --top_k 4] [--tokens 4096 --d_model 256 --d_ff 256]
        [--modes capacity,allgather,dropless] [--backends auto] [--exchange_chunks 0]
    python benchmarks/moe_layer.py --backends auto,einsum,ragged_dot       # the alternatives beside the default

`--backends` takes kernels.expert_gemm values, comma-separated (default `auto`); each is resolved per dispatch
mode by moejax/kernels/resolve.py against the platform of the mesh's devices, as a training run with that
moe.dispatch resolves it, and the table prints what ran: `auto` is einsum for capacity and allgather, and for
dropless tile_loop on CPU, tokamax on GPUs (printed `tile_loop (auto)`). A backend the platform or the shapes
cannot run is listed as refused, with the ConfigError. `--exchange_chunks 0` is moe.exchange_chunks' auto, per
mode as a training run resolves it (2 for dropless on GPUs, else 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from moejax.config import ConfigError, default_config  # noqa: E402
from moejax.kernels.resolve import (devices_compute_capability, devices_platform, kernel_label,  # noqa: E402
                                    resolve_exchange_chunks, resolve_kernel)
from moejax.parallel.dispatch import routed_experts  # noqa: E402
from moejax.parallel.hlo_collectives import collective_bytes  # noqa: E402
from moejax.parallel.mesh import BATCH_AXES, EXPERT_AXIS, make_mesh  # noqa: E402


def timed(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def layer_gemm(asked: str, mode: str, a, platform: str, compute_capability: float | None) -> str:
    """The grouped GEMM kernels.expert_gemm=`asked` runs for moe.dispatch=`mode` at these shapes on `platform`, as a
    training run resolves it (ConfigError where it cannot run)."""
    cfg = default_config()
    cfg.model.d_model, cfg.moe.d_ff_expert, cfg.moe.dispatch = a.d_model, a.d_ff, mode
    cfg.kernels.expert_gemm = asked
    return resolve_kernel(cfg, "expert_gemm", platform, compute_capability)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top_k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="global tokens per step")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--d_ff", type=int, default=256)
    ap.add_argument("--expert_parallel", type=int, default=8)
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--dropless_window", type=float, default=1.25,
                    help="dropless rows received per round x the balanced load (moe.dropless_window)")
    ap.add_argument("--modes", default="capacity,allgather,dropless")
    ap.add_argument("--backends", default="auto",
                    help="comma-separated kernels.expert_gemm values, auto resolved per mode for the platform "
                         "(on CPU ragged_dot is a masked dense matmul: E_local x the work)")
    ap.add_argument("--exchange_chunks", type=int, default=0,
                    help="moe.exchange_chunks (0: auto per mode, as a training run resolves it)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n_dev = jax.device_count()
    mesh = make_mesh(dict(data=n_dev // a.expert_parallel, fsdp=1, expert=a.expert_parallel, tensor=1))
    platform, cc = devices_platform(mesh.devices.flat), devices_compute_capability(mesh.devices.flat)
    dt = jnp.dtype(a.dtype)
    keys = jax.random.split(jax.random.key(0), 5)
    tok = NamedSharding(mesh, P(BATCH_AXES, None))
    exp = NamedSharding(mesh, P(EXPERT_AXIS, None, None))
    x = jax.device_put(jax.random.normal(keys[0], (a.tokens, a.d_model), dt), tok)
    logits = jax.random.normal(keys[1], (a.tokens, a.experts))
    w_TxK, idx_TxK = jax.lax.top_k(jax.nn.softmax(logits), a.top_k)
    idx_TxK, w_TxK = jax.device_put(idx_TxK, tok), jax.device_put(w_TxK / w_TxK.sum(-1, keepdims=True), tok)
    std = a.d_model ** -0.5
    wg = jax.device_put(std * jax.random.normal(keys[2], (a.experts, a.d_model, a.d_ff), dt), exp)
    wu = jax.device_put(std * jax.random.normal(keys[3], (a.experts, a.d_model, a.d_ff), dt), exp)
    wd = jax.device_put(std * jax.random.normal(keys[4], (a.experts, a.d_ff, a.d_model), dt), exp)

    useful_flops = 6 * a.tokens * a.top_k * 3 * a.d_model * a.d_ff  # fwd + 2 bwd GEMMs, SwiGLU's 3 matrices
    rows = []

    def ideal_loss(x, wg, wu, wd):
        x_rep = jnp.repeat(x, a.top_k, axis=0)  # K rows per token, like the routed layer's useful work
        h = jax.nn.silu(x_rep @ wg[0]) * (x_rep @ wu[0])
        return jnp.sum((h @ wd[0]) ** 2)

    with jax.set_mesh(mesh):
        ideal = jax.jit(jax.grad(ideal_loss, argnums=(0, 1, 2, 3)))
        t_ideal = timed(ideal, (x, wg, wu, wd), a.repeats)
        rows.append({"mode": "ideal (dense)", "backend": "-", "label": "-", "time_s": t_ideal, "ratio": 1.0})
        for mode in a.modes.split(","):
            chunks = resolve_exchange_chunks(a.exchange_chunks, platform, a.expert_parallel, mode)
            for asked in a.backends.split(","):
                row = {"mode": mode, "asked": asked, "exchange_chunks": chunks}
                try:
                    backend = layer_gemm(asked, mode, a, platform, cc)
                except ConfigError as err:
                    rows.append({**row, "backend": asked, "label": asked, "refused": str(err)})
                    continue

                def loss(x, wg, wu, wd, mode=mode, backend=backend, chunks=chunks):
                    y, _ = routed_experts(x, idx_TxK, w_TxK, wg, wu, wd, capacity_factor=a.capacity_factor,
                                          mode=mode, gemm=backend, dropless_window=a.dropless_window,
                                          exchange_chunks=chunks)
                    return jnp.sum(y ** 2)

                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
                t = timed(fn, (x, wg, wu, wd), a.repeats)
                fwd = jax.jit(loss).lower(x, wg, wu, wd).compile().as_text()
                rows.append({**row, "backend": backend, "label": kernel_label(backend, asked), "time_s": t,
                             "ratio": t / t_ideal, "fwd_collective_bytes_per_device": collective_bytes(fwd)})
    print(f"{a.experts} experts top-{a.top_k}, {a.tokens} tokens, d_model {a.d_model}, d_ff {a.d_ff}, "
          f"{a.dtype}, capacity factor {a.capacity_factor}, mesh {dict(mesh.shape)} on {n_dev} x "
          f"{jax.devices()[0].device_kind}; useful {useful_flops / 1e9:.2f} GFLOP per fwd+bwd")
    print(f"{'mode':<16}{'backend':<20}{'chunks':>7}{'ms':>9}{'x ideal':>9}{'TFLOP/s':>9}  fwd collective bytes/device")
    for r in rows:
        head = f"{r['mode']:<16}{r['label']:<20}{r.get('exchange_chunks', '-'):>7}"
        if "refused" in r:
            print(f"{head}  refused: {r['refused']}")
            continue
        print(f"{head}{r['time_s'] * 1e3:>9.1f}{r['ratio']:>9.2f}{useful_flops / r['time_s'] / 1e12:>9.3f}"
              f"  {r.get('fwd_collective_bytes_per_device', '')}")
    out = Path(a.json or f"benchmarks/results/moe_layer_e{a.experts}_k{a.top_k}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "useful_flops": useful_flops, "mesh": dict(mesh.shape),
                               "device_kind": jax.devices()[0].device_kind, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
