"""Pipeline stages: the measured bubble of the circular schedule next to the planner's (S - 1) / (M V), and the
training step time for PP 1 / 2 / 4 next to the planner's compute factor, on the emulated 8-device CPU mesh.

    python benchmarks/pipeline_bubble.py [--micro 8] [--repeats 3] [--no-steps]
        [--json benchmarks/results/pipeline_bubble.json]

Schedule rows: L residual MLP layers (width 512, hidden 2048, 256 rows per micro-batch), forward + backward, run by
`circular_pipeline` over S stages x V virtual stages (mesh stage S x data 8/S) and, as the reference, the same
layers applied in order to one micro-batch at a time on one stage's devices (data 8/S, identical per-device
shapes). The emulated devices share this machine's cores, so time follows the work all devices do: a stage
computes on its idle ticks too, and the ratio pipeline / in order - 1 is the bubble as the schedule spends it (on
GPUs it is idle time), plus the schedule's own overhead (hand-offs, buffer updates).

Step rows: one training step of a DeepSeek-style model (a dense layer, 8 MoE layers with shared + routed experts,
MTP; d_model 256) on PP 1 / 2 / 4 with expert 2 inside every stage and one sequence per device per pass (PP1:
gradient accumulation over 4 passes; PP2 / PP4: 8 / 16 micro-batches); the planner's
`stage_compute` (MoE layers x (1 + bubble), the rest computed by every stage) is the predicted ratio to PP 1.
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
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from moe_layer import timed as _timed  # noqa: E402  (benchmarks/: best of `repeats` after a warm-up)
from moejax.parallel.pipeline import bubble_fraction, circular_pipeline, to_chunks  # noqa: E402

D, F, ROWS, LAYERS = 512, 2048, 256, 8


def _layers(params, x_BxD):
    def one(x, w):
        return x + jnp.tanh(x @ w["w1"]) @ w["w2"], None
    return jax.lax.scan(one, x_BxD, params)[0]


def schedule_row(stages: int, virtual: int, micro: int, repeats: int) -> dict:
    devices = np.asarray(jax.devices()[:8])
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(0, 0.02, (LAYERS, D, F)), jnp.float32),
              "w2": jnp.asarray(rng.normal(0, 0.02, (LAYERS, F, D)), jnp.float32)}
    x_MxBxD = jnp.asarray(rng.normal(size=(micro, ROWS, D)), jnp.float32)

    pipe_mesh = Mesh(devices.reshape(stages, 8 // stages), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    one_mesh = Mesh(devices[:8 // stages].reshape(1, 8 // stages), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)

    def piped_loss(p, x):
        y, _ = circular_pipeline(lambda c, xb, _s: (_layers(c, xb), None), to_chunks(p, stages, virtual), x,
                                 mesh=pipe_mesh, axis="stage", n_repeats=virtual)
        return jnp.sum(y * y)

    def in_order_loss(p, x):  # one micro-batch at a time: the pipeline's per-device matmul shapes
        return jnp.sum(jax.lax.map(lambda xb: _layers(p, xb), x) ** 2)

    def put(mesh, tree, spec):
        return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), tree)

    with jax.set_mesh(pipe_mesh):
        pipe = jax.jit(jax.value_and_grad(piped_loss))
        p_in = put(pipe_mesh, params, lambda a: P())
        x_in = put(pipe_mesh, x_MxBxD, lambda a: P(None, "data"))
        piped_s = _timed(pipe, (p_in, x_in), repeats)
    with jax.set_mesh(one_mesh):
        ref = jax.jit(jax.value_and_grad(in_order_loss))
        p_in = put(one_mesh, params, lambda a: P())
        x_in = put(one_mesh, x_MxBxD, lambda a: P(None, "data"))
        in_order_s = _timed(ref, (p_in, x_in), repeats)
    return {"stages": stages, "virtual": virtual, "micro": micro, "pipelined_s": piped_s, "in_order_s": in_order_s,
            "measured_bubble": piped_s / in_order_s - 1, "planned_bubble": bubble_fraction(stages, micro, virtual)}


def step_row(stages: int, repeats: int) -> dict:
    from moejax.config import validate
    from moejax.parallel.mesh import batch_sharding, make_mesh
    from moejax.planner.layout import Layout
    from moejax.planner.predict import stage_terms
    from moejax.program.optim import make_optimizer
    from moejax.program.state import init_state, model_graphdef
    from moejax.program.step import jit_train_step
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_pipeline_step import pipeline_config

    cfg = pipeline_config("capacity", 1)
    cfg.model.d_model, cfg.train.seq_len, cfg.train.global_batch = 256, 64, 32
    cfg.mesh.stage, cfg.mesh.data, cfg.mesh.expert = stages, 4 // stages, 2
    micro = cfg.train.global_batch // (cfg.mesh.data * cfg.mesh.expert)  # one sequence per device per pass
    cfg.train.micro_batches = micro
    sizes = validate(cfg, 8)
    mesh = make_mesh(sizes)
    tx = make_optimizer(cfg.optim)
    state, shardings = init_state(cfg, tx, mesh, cfg.seed)
    tokens = np.random.default_rng(0).integers(0, 256, (cfg.train.global_batch, cfg.train.seq_len + 1), np.int32)
    batch = jax.device_put(tokens, batch_sharding(mesh))
    with jax.set_mesh(mesh):
        step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings).lower(state, batch).compile()
        state, metrics = step(state, batch)  # warm-up (the step donates its state: thread it through)
        jax.block_until_ready(metrics)
        step_s = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            step_s = min(step_s, time.perf_counter() - t0)
    layout = Layout(sizes["data"], sizes["fsdp"], sizes["expert"], sizes["tensor"], cfg.model.remat,
                    cfg.train.global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"]) // micro,
                    cfg.moe.dispatch, stages)
    bubble, factor = stage_terms(cfg, layout, int(cfg.train.seq_len))
    return {"stages": stages, "micro": micro, "step_s": step_s, "planned_bubble": bubble, "planned_compute": factor}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=8, help="micro-batches M")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (the best is kept)")
    ap.add_argument("--no-steps", action="store_true", help="only the schedule rows")
    ap.add_argument("--json", default="benchmarks/results/pipeline_bubble.json")
    args = ap.parse_args(argv)

    rows = [schedule_row(s, v, args.micro, args.repeats) for s, v in ((2, 1), (2, 2), (4, 1), (4, 2))]
    print(f"circular schedule, {LAYERS} layers, M={args.micro} (forward + backward; best of {args.repeats})")
    print(f"  {'PP':>3s} {'VP':>3s} {'pipelined s':>12s} {'in order s':>11s} {'measured bubble':>16s} "
          f"{'planned (S-1)/(MV)':>19s}")
    for r in rows:
        print(f"  {r['stages']:3d} {r['virtual']:3d} {r['pipelined_s']:12.4f} {r['in_order_s']:11.4f} "
              f"{r['measured_bubble']:16.1%} {r['planned_bubble']:19.1%}")
    steps = [] if args.no_steps else [step_row(s, args.repeats) for s in (1, 2, 4)]
    if steps:
        base = steps[0]["step_s"]
        print("\ntraining step, DeepSeek-style 1 dense + 8 MoE layers + MTP, d_model 256, 32 x 64 tokens, expert 2 "
              "per stage, one sequence per device per pass")
        print(f"  {'PP':>3s} {'M':>3s} {'step s':>8s} {'vs PP1':>7s} {'planned':>8s} {'planned bubble':>15s}")
        for r in steps:
            print(f"  {r['stages']:3d} {r['micro']:3d} {r['step_s']:8.3f} {r['step_s'] / base:7.3f} "
                  f"{r['planned_compute']:8.3f} {r['planned_bubble']:15.1%}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schedule": rows, "steps": steps, "devices": jax.device_count(),
                               "platform": jax.devices()[0].platform}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
