"""Training-step speed of a config on the emulated CPU mesh (or real devices): step time, tokens/s,
TFLOP/s per device and MFU, for several mesh layouts and expert-dispatch modes measured in one run (with the
dropped fraction and the dropless rounds of the last step). Prints a table, writes JSON.

    python benchmarks/train_step.py [--config configs/tiny.py] [--steps 10] [--layouts config,expert8]
        [--dispatches config,capacity,allgather,dropless] [--repeats 1] [--json benchmarks/results/train_step.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import shlex
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from moejax.config import validate  # noqa: E402
from moejax.model.accounting import flops_per_token  # noqa: E402
from moejax.parallel.mesh import batch_sharding, make_mesh  # noqa: E402
from moejax.training.metrics import peak_flops_per_device, throughput  # noqa: E402
from moejax.program.optim import make_optimizer  # noqa: E402
from moejax.program.state import init_state, model_graphdef  # noqa: E402
from moejax.program.step import jit_train_step  # noqa: E402

LAYOUTS = {  # name -> (data, fsdp, expert, tensor); -1 fills the rest
    "config": None,
    "data8": (-1, 1, 1, 1),
    "data2 x expert4": (-1, 1, 4, 1),
    "expert8": (1, 1, -1, 1),
    "fsdp2 x expert4": (1, 2, -1, 1),
}


class Program:
    """One compiled training step of a config, with its state and batch: timed in repeats (`--repeats`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.sizes = validate(cfg, jax.device_count())
        mesh = make_mesh(self.sizes)
        tx = make_optimizer(cfg.optim)
        self.state, shardings = init_state(cfg, tx, mesh, cfg.seed)
        tokens = np.random.default_rng(0).integers(0, 256, (cfg.train.global_batch, cfg.train.seq_len + 1), np.int32)
        self.batch = jax.device_put(tokens, batch_sharding(mesh))
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            self.step = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings).lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        for _ in range(2):  # warm-up
            self.state, self.metrics = self.step(self.state, self.batch)
        jax.block_until_ready(self.metrics)
        self.step_times = []

    def time_steps(self, steps: int):
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, self.metrics = self.step(self.state, self.batch)
        jax.block_until_ready(self.metrics)
        self.step_times.append((time.perf_counter() - t0) / steps)

    def result(self, peak: float) -> dict:
        """Throughput at the median repeat's step time (every repeat's step time listed beside it)."""
        cfg = self.cfg
        step_s = float(np.median(self.step_times))
        tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        moe = {k: float(self.metrics[k]) for k in ("dropped_fraction", "dropless_rounds") if k in self.metrics}
        return {"mesh": self.sizes, "compile_s": self.compile_s, "dispatch": cfg.moe.dispatch, **moe,
                "repeat_step_times_s": self.step_times,
                **throughput(step_s, tokens_per_step, flops_per_token(cfg), jax.device_count(), peak)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--steps", type=int, default=10, help="steps per timing repeat")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timing repeats, every program once per repeat in turn (a noisy machine's drift hits all "
                         "alike); the table gives each program's median repeat")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    ap.add_argument("--dispatches", default="config",
                    help="comma-separated moe.dispatch values to measure (config: the config's own)")
    ap.add_argument("--dtype", default="config", help="model.dtype (config: the config's own), e.g. bfloat16 on GPUs")
    ap.add_argument("--json", default="benchmarks/results/train_step.json")
    args = ap.parse_args()
    base = runpy.run_path(args.config)["get_config"]()
    if args.dtype != "config":
        base.model.dtype = args.dtype
    peak, peak_source = peak_flops_per_device(base.hardware.peak_tflops)
    programs = []
    for name in args.layouts.split(","):
        for dispatch in args.dispatches.split(","):
            cfg = base.copy_and_resolve_references()
            if LAYOUTS[name] is not None:
                cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = LAYOUTS[name]
            if dispatch != "config":
                cfg.moe.dispatch = dispatch
            programs.append((name, Program(cfg)))
    for _ in range(args.repeats):
        for _, program in programs:
            program.time_steps(args.steps)
    rows = [{"layout": name, **program.result(peak)} for name, program in programs]
    print(f"{args.config}: {base.train.global_batch} x {base.train.seq_len} tokens/step, "
          f"{flops_per_token(base) / 1e6:.3g} MFLOP/token, {jax.device_count()} x {jax.devices()[0].device_kind}, "
          f"peak {peak / 1e12:.3g} TFLOP/s/dev ({peak_source})")
    print(f"{'layout':<18}{'dispatch':<11}{'step ms':>9}{'tok/s':>9}{'TFLOP/s/dev':>13}{'MFU':>8}{'compile s':>11}"
          f"{'dropped':>9}{'rounds':>8}")
    for r in rows:
        print(f"{r['layout']:<18}{r['dispatch']:<11}{r['step_time_s'] * 1e3:>9.0f}{r['tokens_per_s']:>9.0f}"
              f"{r['tflops_per_device']:>13.4g}{100 * r['mfu']:>7.1f}%{r['compile_s']:>11.1f}"
              f"{100 * r.get('dropped_fraction', 0):>8.1f}%{r.get('dropless_rounds', 1):>8.0f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                               "command": shlex.join(["python", *sys.argv]), "jax": jax.__version__,
                               "config": args.config, "devices": jax.device_count(),
                               "device_kind": jax.devices()[0].device_kind, "peak_flops_per_device": peak,
                               "peak_source": peak_source, "flops_per_token": flops_per_token(base),
                               "steps": args.steps, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
