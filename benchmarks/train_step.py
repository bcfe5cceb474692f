"""Training-step speed of a config: the whole jitted step (forward, backward, AdamW) timed on the emulated CPU mesh
or on real devices, for several mesh layouts, expert-dispatch modes and FP8 formats measured in one run. Reports
step time, tokens/s, model TFLOP/s per device (Megatron-Core convention, moejax/model/accounting.py) and MFU
against both the spec peak (the GPU's dense bf16 peak from parallel/topology.py; on CPU a measured f32 matmul) and
a matmul peak measured in the same process (`--matmul_n`), next to the planner's prediction for the same layout
(memory, step time, MFU at 50% GEMM efficiency) and, on GPUs, the device's peak memory. Prints a table, writes JSON.

    python benchmarks/train_step.py [--config configs/tiny.py] [--steps 10] [--layouts config,expert8]
        [--dispatches config,capacity,allgather,dropless] [--fp8 config,none,rowwise] [--exchange_chunks config,1,2]
        [--repeats 1]
        [--autotune none|load|tune] [--json benchmarks/results/train_step.json]
    python benchmarks/train_step.py --config benchmarks/configs/deepseek_v3_1gpu.py:h200 --layouts config \
        --dispatches dropless,capacity --fp8 none,rowwise --steps 5 --autotune tune        # one GPU

`--config FILE:ARG` passes ARG to the file's get_config, as `moejax-train --config` does. With `--repeats 1` the
programs run one after another and each one's state is freed before the next is built (a one-GPU proxy's state
fills the GPU); with more repeats all programs stay alive and are timed in turn, so a noisy machine's drift hits
all alike.

Kernel configs (tokamax's grouped GEMM and flash attention, on GPUs): `--autotune none` compiles with tokamax's
defaults (its shipped autotuning cache, else its heuristics); `load` compiles under the tuned configs of
`--autotune_cache` (tokamax.AutotuningResult JSON; an error if the file is missing); `tune` times each program with
the defaults, then autotunes its tokamax ops that the cache file lacks (tokamax.autotune, one op at a time, the file
rewritten after each so a cut-short run keeps what it tuned), recompiles under the cache and times it again: the
table then has a `default` and a `tuned` row per program.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# jax preallocates 75% of a GPU's memory by default; the one-GPU proxy's step needs up to 123 GiB of an H200's 131
# (XLA:GPU's figure, benchmarks/RESULTS.md), and this process is the GPU's only user (no NCCL buffers).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from moejax.api import load_config  # noqa: E402
from moejax.config import ConfigError, validate  # noqa: E402
from moejax.config.schema import FP8_FORMATS  # noqa: E402
from moejax.kernels.resolve import apply_kernels, devices_compute_capability, devices_platform  # noqa: E402
from moejax.model.accounting import flops_per_token  # noqa: E402
from moejax.parallel.mesh import batch_sharding, make_mesh  # noqa: E402
from moejax.parallel.topology import TopologyError, detect_topology  # noqa: E402
from moejax.planner.layout import config_layout  # noqa: E402
from moejax.planner.predict import predict  # noqa: E402
from moejax.program.optim import make_optimizer  # noqa: E402
from moejax.program.state import init_state, model_graphdef  # noqa: E402
from moejax.program.step import jit_train_step  # noqa: E402
from moejax.training.metrics import measure_matmul_peak, peak_flops_per_device, throughput  # noqa: E402

LAYOUTS = {  # name -> (data, fsdp, expert, tensor); -1 fills the rest
    "config": None,
    "data8": (-1, 1, 1, 1),
    "data2 x expert4": (-1, 1, 4, 1),
    "expert8": (1, 1, -1, 1),
    "fsdp2 x expert4": (1, 2, -1, 1),
}
PLANNER_EFFICIENCY = 0.5  # moejax-plan's default: the fraction of the bf16 peak the model's GEMMs reach
AUTOTUNE_MODES = ("none", "load", "tune")


class Program:
    """One compiled training step of a config, with its state and batch: timed in repeats (`--repeats`).
    `tuning`: a tokamax AutotuningResult the step is compiled under (None: tokamax's default configs)."""

    def __init__(self, cfg, tuning=None):
        self.cfg, self.tuning = cfg, tuning
        self.sizes = validate(cfg, jax.device_count())
        devices = jax.devices()
        self.kernels_line = apply_kernels(cfg, devices_platform(devices), devices_compute_capability(devices))
        print(self.kernels_line, flush=True)
        mesh = make_mesh(self.sizes)
        tx = make_optimizer(cfg.optim)
        self.state, shardings = init_state(cfg, tx, mesh, cfg.seed)
        tokens = np.random.default_rng(0).integers(0, min(256, cfg.model.vocab_size),
                                                   (cfg.train.global_batch, cfg.train.seq_len + 1), np.int32)
        self.batch = jax.device_put(tokens, batch_sharding(mesh))
        t0 = time.perf_counter()
        with jax.set_mesh(mesh), (tuning if tuning is not None else contextlib.nullcontext()):
            self.lowered = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings).lower(self.state, self.batch)
            self.step = self.lowered.compile()
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

    def result(self, peak: float, matmul_peak: float | None) -> dict:
        """Throughput at the median repeat's step time (every repeat's step time listed beside it)."""
        cfg = self.cfg
        step_s = float(np.median(self.step_times))
        tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        moe = {k: float(self.metrics[k]) for k in ("dropped_fraction", "dropless_rounds") if k in self.metrics}
        row = {"mesh": self.sizes, "compile_s": self.compile_s, "dispatch": cfg.moe.dispatch,
               "exchange_chunks": int(cfg.moe.exchange_chunks),
               "fp8": cfg.model.fp8, "kernels": self.kernels_line,
               "kernel_configs": "default" if self.tuning is None else "tuned", **moe,
               "repeat_step_times_s": self.step_times,
               **throughput(step_s, tokens_per_step, flops_per_token(cfg), jax.device_count(), peak)}
        if matmul_peak:
            row["mfu_vs_matmul_peak"] = row["tflops_per_device"] * 1e12 / matmul_peak
        # GPUs report it, CPUs give None. The allocator's peak is the process's so far (it cannot be reset), so a
        # later program's row shows the largest of the programs run before it too.
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            row["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
        return row

    def release(self):
        """Frees the device buffers (state, batch, executable) before the next program is built."""
        for leaf in jax.tree.leaves((self.state, self.batch, self.metrics)):
            leaf.delete()
        self.step = self.lowered = self.state = self.batch = None
        gc.collect()


def plan_row(cfg) -> dict:
    """The planner's prediction for the layout this config runs at on these devices (moejax-plan's numbers)."""
    device = jax.devices()[0]
    try:
        topo = detect_topology(device.device_kind, device.platform)
    except TopologyError as e:
        return {"error": str(e)}
    layout = config_layout(cfg, validate(cfg, jax.device_count()))
    p = predict(cfg, topo, layout, efficiency=PLANNER_EFFICIENCY, domain_size=min(topo.domain_size or 1,
                                                                                  layout.n_devices))
    return {"topology": topo.name, "layout": layout.name(), "memory_bytes": p.memory.total, "fits": p.fits,
            "memory": p.memory.to_dict(), "step_s": p.step_s, "tflops_per_device": p.tflops_per_gpu, "mfu": p.mfu}


def autotune_cache_path(arg: str) -> Path:
    kind = jax.devices()[0].device_kind.lower().replace(" ", "_")
    return Path(arg.format(device_kind=kind))


def load_tuning(path: Path):
    import tokamax

    return tokamax.AutotuningResult.loads(path.read_text())


def autotune(lowered, path: Path):
    """Autotunes the tokamax ops of a lowered step that the cache at `path` lacks, one op at a time, rewriting
    the file after each; returns the merged AutotuningResult (None: the step has no tokamax op)."""
    import tokamax

    step_ops = tokamax.autotuning.get_bound_args(lowered)
    if not step_ops:
        return None
    result = load_tuning(path) if path.is_file() else None
    known = {(type(ba.op).__name__, ba.autotuning_cache_key) for ba, _ in (result.data if result else ())}
    ops = [ba for ba in step_ops if (type(ba.op).__name__, ba.autotuning_cache_key) not in known]
    print(f"autotune: {len(ops)} tokamax op shape(s) to tune, {len(known)} already in {path}", flush=True)
    for i, ba in enumerate(ops):
        t0 = time.perf_counter()
        tuned = tokamax.autotune([ba], ignore_cache=True, progress_bar=False)
        result = tuned if result is None else result | tuned
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.dumps(prune_errors=True))
        print(f"autotune: {i + 1}/{len(ops)} {type(ba.op).__name__} in {time.perf_counter() - t0:.1f} s -> {path}",
              flush=True)
    return result


TABLE_HEAD = (f"{'layout':<16}{'dispatch':<10}{'chunks':>7} {'fp8':<10}{'configs':<9}{'step ms':>10}{'tok/s':>10}{'TFLOP/s':>9}"
              f"{'MFU':>7}{'MFU mm':>8}{'mem GB':>8}{'plan GB':>8}{'plan MFU':>9}{'compile s':>10}{'dropped':>8}"
              f"{'rounds':>7}")


def table_line(r: dict) -> str:
    """One row of the table: MFU against the spec peak and against the measured matmul (mm), the device's peak
    memory next to the planner's (GB), the planner's MFU for the layout."""
    plan = r["plan"]
    mem = f"{r['device_peak_bytes'] / 1e9:.1f}" if "device_peak_bytes" in r else "-"
    mm = f"{100 * r['mfu_vs_matmul_peak']:.1f}%" if "mfu_vs_matmul_peak" in r else "-"
    plan_gb = f"{plan['memory_bytes'] / 1e9:.1f}" if "memory_bytes" in plan else "-"
    plan_mfu = f"{100 * plan['mfu']:.1f}%" if "mfu" in plan else "-"
    return (f"{r['layout']:<16}{r['dispatch']:<10}{r.get('exchange_chunks', 1):>7} {r['fp8']:<10}{r['kernel_configs']:<9}"
            f"{r['step_time_s'] * 1e3:>10.1f}{r['tokens_per_s']:>10.4g}{r['tflops_per_device']:>9.3g}"
            f"{100 * r['mfu']:>6.1f}%{mm:>8}{mem:>8}{plan_gb:>8}{plan_mfu:>9}{r['compile_s']:>10.1f}"
            f"{100 * r.get('dropped_fraction', 0):>7.1f}%{r.get('dropless_rounds', 1):>7.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py", help="config file, FILE:ARG passes ARG to get_config")
    ap.add_argument("--steps", type=int, default=10, help="steps per timing repeat")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timing repeats; above 1 every program stays alive and is timed once per repeat in turn "
                         "(a noisy machine's drift hits all alike); the table gives each program's median repeat")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    ap.add_argument("--dispatches", default="config",
                    help="comma-separated moe.dispatch values to measure (config: the config's own)")
    ap.add_argument("--fp8", default="config",
                    help="comma-separated model.fp8 formats to measure (config: the config's own), of: "
                         + ", ".join(FP8_FORMATS))
    ap.add_argument("--exchange_chunks", default="config",
                    help="comma-separated moe.exchange_chunks values to measure (config: the config's own; 0: auto)")
    ap.add_argument("--dtype", default="config", help="model.dtype (config: the config's own), e.g. bfloat16 on GPUs")
    ap.add_argument("--matmul_n", type=int, default=0,
                    help="size of the square matmul whose measured rate is the second MFU's peak (model.dtype); "
                         "0: 8192 on GPUs, 1024 on CPUs; -1: none")
    ap.add_argument("--autotune", default="none", choices=AUTOTUNE_MODES,
                    help="tokamax kernel configs: none (defaults), load (--autotune_cache), tune (both, tuning what "
                         "the cache lacks)")
    ap.add_argument("--autotune_cache", default="benchmarks/tokamax_autotune/{device_kind}.json",
                    help="tokamax AutotuningResult JSON ({device_kind}: jax's device kind, lower case)")
    ap.add_argument("--json", default="benchmarks/results/train_step.json")
    args = ap.parse_args()
    try:
        base = load_config(args.config)
        if args.dtype != "config":
            base.model.dtype = args.dtype
        for fmt in args.fp8.split(","):
            if fmt not in ("config", *FP8_FORMATS):
                raise ConfigError(f"--fp8 {fmt!r}: one of config, {', '.join(FP8_FORMATS)}")
        for chunks in args.exchange_chunks.split(","):
            if chunks != "config" and not chunks.isdigit():
                raise ConfigError(f"--exchange_chunks {chunks!r}: config or an integer >= 0")
        if args.autotune != "none":
            try:
                import tokamax  # noqa: F401
            except ImportError:
                raise ConfigError(f"--autotune {args.autotune} needs tokamax (pip install 'moejax[gpu]')") from None
        cache_path = autotune_cache_path(args.autotune_cache)
        if args.autotune == "tune" and args.repeats > 1:
            raise ConfigError("--autotune tune times programs one at a time: use --repeats 1")
        if args.autotune == "load" and not cache_path.is_file():
            raise ConfigError(f"--autotune load: no tuned cache at {cache_path} (run with --autotune tune first)")
    except ConfigError as e:
        sys.exit(f"train_step: {e}")
    peak, peak_source = peak_flops_per_device(base.hardware.peak_tflops)
    platform = jax.devices()[0].platform
    matmul_n = args.matmul_n or (1024 if platform == "cpu" else 8192)
    matmul_peak = measure_matmul_peak(jax.numpy.dtype(base.model.dtype), matmul_n) if matmul_n > 0 else None
    if platform == "cpu" and matmul_peak:
        matmul_peak /= jax.local_device_count()  # the emulated devices share the process's cores

    print(f"{args.config}: {base.train.global_batch} x {base.train.seq_len} tokens/step, "
          f"{flops_per_token(base) / 1e9:.4g} GFLOP/token, {jax.device_count()} x {jax.devices()[0].device_kind}, "
          f"spec peak {peak / 1e12:.4g} TFLOP/s/dev ({peak_source})"
          + (f", measured {matmul_n}^3 matmul {matmul_peak / 1e12:.4g} TFLOP/s/dev" if matmul_peak else "")
          + (f", XLA_PYTHON_CLIENT_MEM_FRACTION={os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']}"
             if platform == "gpu" else ""), flush=True)

    configs = []
    for name in args.layouts.split(","):
        for dispatch in args.dispatches.split(","):
            for fmt in args.fp8.split(","):
                for chunks in args.exchange_chunks.split(","):
                    cfg = base.copy_and_resolve_references()
                    if LAYOUTS[name] is not None:
                        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = LAYOUTS[name]
                    if dispatch != "config":
                        cfg.moe.dispatch = dispatch
                    if fmt != "config":
                        cfg.model.fp8 = fmt
                    if chunks != "config":
                        cfg.moe.exchange_chunks = int(chunks)
                    configs.append((name, cfg))

    def write_json(rows):  # after every finished program too: a run cut short keeps what it measured
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                                   "command": shlex.join(["python", *sys.argv]), "jax": jax.__version__,
                                   "config": args.config, "devices": jax.device_count(),
                                   "device_kind": jax.devices()[0].device_kind, "peak_flops_per_device": peak,
                                   "peak_source": peak_source, "matmul_n": matmul_n if matmul_peak else None,
                                   "matmul_peak_flops_per_device": matmul_peak,
                                   "flops_per_token": flops_per_token(base), "steps": args.steps,
                                   "repeats": args.repeats, "autotune": args.autotune, "rows": rows}, indent=2))

    rows, programs = [], []

    def finish(name, program, plan):
        rows.append({"layout": name, **program.result(peak, matmul_peak), "plan": plan})
        write_json(rows)
        print(TABLE_HEAD + "\n" + table_line(rows[-1]), flush=True)
        if args.repeats == 1:
            program.release()

    for name, cfg in configs:
        try:
            plan = plan_row(cfg)
            tuning = load_tuning(cache_path) if args.autotune == "load" else None
            program = Program(cfg, tuning)
        except ConfigError as e:
            sys.exit(f"train_step: {e}")
        if args.repeats > 1:
            programs.append((name, program, plan))
            continue
        program.time_steps(args.steps)
        if args.autotune == "tune":
            lowered = program.lowered
            finish(name, program, plan)
            tuning = autotune(lowered, cache_path)
            if tuning is None:
                print("autotune: the step has no tokamax op", flush=True)
                continue
            program = Program(cfg.copy_and_resolve_references(), tuning)
            program.time_steps(args.steps)
        finish(name, program, plan)
    for _ in range(args.repeats if programs else 0):
        for _, program, _ in programs:
            program.time_steps(args.steps)
    for name, program, plan in programs:
        finish(name, program, plan)

    print("\n" + TABLE_HEAD)
    for r in rows:
        print(table_line(r))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
