"""Routed-expert layer speed: forward+backward of every dispatch mode x grouped-matmul backend, beside the
same useful FLOPs as one dense SwiGLU ("ideal": every token's K expert rows through one expert-sized FFN,
no routing), all measured in one run on the same mesh. Prints a table of ratios, writes JSON.

    python benchmarks/moe_layer.py [--experts 16 --top_k 4] [--tokens 4096 --d_model 256 --d_ff 256]
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
    ap.add_argument("--backends", default="einsum,ragged_dot",
                    help="grouped GEMMs (on CPU ragged_dot is a masked dense matmul: E_local x the work)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    n_dev = jax.device_count()
    mesh = make_mesh(dict(data=n_dev // a.expert_parallel, fsdp=1, expert=a.expert_parallel, tensor=1))
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
        rows.append({"mode": "ideal (dense)", "backend": "-", "time_s": t_ideal, "ratio": 1.0})
        for mode in a.modes.split(","):
            for backend in a.backends.split(","):
                def loss(x, wg, wu, wd, mode=mode, backend=backend):
                    y, _ = routed_experts(x, idx_TxK, w_TxK, wg, wu, wd, capacity_factor=a.capacity_factor,
                                          mode=mode, gemm=backend, dropless_window=a.dropless_window)
                    return jnp.sum(y ** 2)

                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
                t = timed(fn, (x, wg, wu, wd), a.repeats)
                fwd = jax.jit(loss).lower(x, wg, wu, wd).compile().as_text()
                rows.append({"mode": mode, "backend": backend, "time_s": t, "ratio": t / t_ideal,
                             "fwd_collective_bytes_per_device": collective_bytes(fwd)})
    print(f"{a.experts} experts top-{a.top_k}, {a.tokens} tokens, d_model {a.d_model}, d_ff {a.d_ff}, "
          f"{a.dtype}, capacity factor {a.capacity_factor}, mesh {dict(mesh.shape)} on {n_dev} x "
          f"{jax.devices()[0].device_kind}; useful {useful_flops / 1e9:.2f} GFLOP per fwd+bwd")
    print(f"{'mode':<16}{'backend':<12}{'ms':>9}{'x ideal':>9}{'TFLOP/s':>9}  fwd collective bytes/device")
    for r in rows:
        print(f"{r['mode']:<16}{r['backend']:<12}{r['time_s'] * 1e3:>9.1f}{r['ratio']:>9.2f}"
              f"{useful_flops / r['time_s'] / 1e12:>9.3f}  {r.get('fwd_collective_bytes_per_device', '')}")
    out = Path(a.json or f"benchmarks/results/moe_layer_e{a.experts}_k{a.top_k}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "useful_flops": useful_flops, "mesh": dict(mesh.shape),
                               "device_kind": jax.devices()[0].device_kind, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
