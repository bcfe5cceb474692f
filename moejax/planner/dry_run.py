"""`moejax-train --config C --dry_run`: compile the real training step for an emulated mesh with abstract
state (ShapeDtypeStruct with shardings; nothing is allocated) and put XLA's per-device memory, FLOPs and
collectives next to the planner's prediction for the same layout.

The CLI sets the emulated device count (XLA_FLAGS) before jax is imported; this module only compiles.

The planner's memory column follows the program compiled here (routed experts as the CPU runs them); its
collective bytes are at the model's dtypes, which is what a GPU moves: XLA:CPU widens bf16 collectives to
f32 (its float-normalization-bf16 pass puts converts around them), so a bf16 model's all-to-all shows 2x the
bytes in the XLA column. Both columns are also broken down by the element type moved
(`collective_bytes_by_dtype`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import validate
from moejax.errors import InputError
from moejax.model.accounting import flops_per_token
from moejax.kernels.resolve import KERNEL_FIELDS, apply_kernels, devices_compute_capability, devices_platform
from moejax.parallel.hlo_collectives import bytes_by_dtype, collectives, overlap
from moejax.parallel.hlo_kernels import (kernel_inventory, lowered_custom_calls, stacked_weight_copies,
                                         te_grouped_gemms)
from moejax.parallel.xla_gpu_flags import (DEVICELESS_BASE_SHARE, MEMORY_LIMIT_SLOP_FLAG, scheduler_memory_limit,
                                           scheduler_memory_note, scheduler_slop_for, slop_percent)
from moejax.parallel.xla_gpu_flags import describe as describe_xla_flags
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.parallel.topology import TOPOLOGIES, get_topology
from moejax.planner.comm import buffer_bytes_by_link, step_traffic
from moejax.planner.gpu_targets import compile_only_devices, cross_compiling, get_target
from moejax.planner.comm import bytes_by_dtype as planned_bytes_by_dtype
from moejax.planner.layout import config_layout
from moejax.planner.memory import estimate_memory, within_scheduler_budget
from moejax.planner.predict import domain_size_for
from moejax.program.optim import make_optimizer
from moejax.program.state import abstract_state, model_graphdef, train_state_shardings
from moejax.program.step import jit_train_step


@contextlib.contextmanager
def _entered_together(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def dry_run(cfg, n_devices: int, target: str | None = None, *, keep_hlo: bool = False, compile: bool = True,
            mem_fraction: float | None = None) -> dict:
    """target None: n emulated CPU devices (XLA:CPU); 'h200' | 'b200' | 'gb300': n compile-only GPUs (XLA:GPU,
    planner/gpu_targets.py), with the kernels `auto` resolves to on GPUs. compile=False stops after lowering: the
    report then holds only what jax asks XLA for (kernels, the lowered program's custom calls), in seconds where
    XLA's compile of a large step takes minutes. mem_fraction (GPU targets): compile with the scheduler budget a GPU
    run at XLA_PYTHON_CLIENT_MEM_FRACTION=mem_fraction gives XLA (scheduler_slop_for); None: the deviceless
    compile's own (80% of the target's memory)."""
    sizes = validate(cfg, n_devices)
    gpu = get_target(target) if target else None
    if gpu:
        topo = get_topology(gpu.topology)
        domain = gpu.used_domain_size(n_devices)  # NVL72 at 256 GPUs: 64 of each rack's 72
        devices = compile_only_devices(gpu, n_devices)
        compiling = cross_compiling(devices[0])
    else:
        name = cfg.mesh.topology if cfg.mesh.topology != "auto" else "cpu"
        topo = get_topology(name) if name in TOPOLOGIES else TOPOLOGIES["cpu"]
        domain = domain_size_for(topo, n_devices, int(cfg.mesh.domain_size)) if topo.domain_size else n_devices
        devices = jax.devices()[:n_devices]
        compiling = contextlib.nullcontext()
    platform = devices_platform(devices)
    kernels_line = apply_kernels(cfg, platform, devices_compute_capability(devices))
    if gpu and cfg.kernels.expert_gemm == "te":  # TE asks the machine's GPU what it runs on: answer the target's
        from moejax.planner import te_deviceless

        compiling = _entered_together(compiling, te_deviceless.for_target(gpu.compute_capability))
    mesh = make_mesh(sizes, devices, topology=gpu.topology if gpu else "cpu", domain_size=domain,
                     allow_cross_domain=bool(cfg.mesh.allow_cross_domain_experts))
    tx = make_optimizer(cfg.optim)
    abstract = abstract_state(cfg, tx)
    shardings = train_state_shardings(cfg, abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    # What the training loop feeds: packed rows with their document ids.
    rows = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32,
                                sharding=batch_sharding(mesh))
    batch = {"tokens": rows, "segment_ids": rows}
    start = time.perf_counter()
    compiler_options, slop = {}, slop_percent(os.environ.get("XLA_FLAGS", ""))
    share = DEVICELESS_BASE_SHARE if mem_fraction is None else float(mem_fraction)
    base = int(gpu.memory_bytes * share) if gpu else None  # XLA:GPU's scheduler base: deviceless, or the allocator
    if gpu and mem_fraction is not None:
        io_estimate = sum(_shard_bytes(a) for a in jax.tree.leaves((state, batch)))  # outputs alias the state
        try:
            compiler_options[MEMORY_LIMIT_SLOP_FLAG] = scheduler_slop_for(share, gpu.memory_bytes, io_estimate, slop)
        except ValueError as e:
            raise InputError(f"mem_fraction={share}: {e}") from None
    with compiling, jax.set_mesh(mesh):
        lowered = jit_train_step(cfg, model_graphdef(cfg), tx, mesh, shardings).lower(state, batch)
        if not compile:
            return {"devices": n_devices, "mesh": sizes, "platform": platform, "target": gpu.name if gpu else "cpu",
                    "device_kind": devices[0].device_kind, "kernels": {k: cfg.kernels[k] for k in KERNEL_FIELDS},
                    "kernels_line": kernels_line, "lower_s": time.perf_counter() - start,
                    "xla": {"lowered_custom_calls": lowered_custom_calls(lowered.as_text())}}
        compiled = lowered.compile(compiler_options or None)
    compile_s = time.perf_counter() - start

    mem = compiled.memory_analysis()
    xla_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    # Said now: reading the compiled program's collectives takes minutes (and memory) on a large mesh.
    print(f"compiled in {compile_s:.1f} s; XLA memory per device {xla_bytes / 2**30:.1f} GiB (arguments "
          f"{mem.argument_size_in_bytes / 2**30:.1f} + temp {mem.temp_size_in_bytes / 2**30:.1f} GiB); reading the "
          "collectives", file=sys.stderr, flush=True)
    cost = compiled.cost_analysis() or {}  # XLA:GPU without a device: None
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = compiled.as_text()
    colls = collectives(hlo)
    domain_of = {d.id: i // domain for i, d in enumerate(sorted(devices, key=lambda d: (d.process_index, d.id)))}
    hlo_links = {"nvlink": 0, "nic": 0}
    hlo_kinds: dict[str, int] = {}
    for c in colls:
        link = "nvlink" if all(len({domain_of[i] for i in g}) == 1 for g in c.groups) else "nic"
        hlo_links[link] += c.bytes * c.count
        hlo_kinds[c.kind] = hlo_kinds.get(c.kind, 0) + c.bytes * c.count

    layout = config_layout(cfg, sizes)  # one accumulation pass's rows per device: what the step holds at a time
    predicted_mem = estimate_memory(cfg, layout, platform=platform)
    if gpu:  # as XLA's scheduler budgets this compile (the planner's own rule, planner/memory.py)
        predicted_mem, _ = within_scheduler_budget(predicted_mem, base, slop)
    traffic = step_traffic(cfg, layout)
    pred_kinds: dict[str, int] = {}
    for t in traffic:
        pred_kinds[t.kind] = pred_kinds.get(t.kind, 0) + t.total
    tokens = cfg.train.global_batch * cfg.train.seq_len
    xla_dtypes, plan_dtypes = bytes_by_dtype(colls), planned_bytes_by_dtype(traffic)
    notes = []
    widened = sorted(k for k, d in plan_dtypes.items()
                     if d.get("bf16") and not xla_dtypes.get(k, {}).get("bf16") and xla_dtypes.get(k, {}).get("f32"))
    if widened and platform == "cpu":
        ratios = ", ".join(f"{k} {xla_dtypes[k]['f32'] / 1e6:.2f} MB f32 = {xla_dtypes[k]['f32'] / plan_dtypes[k]['bf16']:.2f}x "
                           f"the planner's {plan_dtypes[k]['bf16'] / 1e6:.2f} MB bf16" for k in widened)
        notes.append("XLA:CPU moves bf16 collectives as f32 (its float-normalization-bf16 pass converts the "
                     f"operands), so the XLA column counts them at 2x: {ratios}; the planner column is at the "
                     "model's dtypes, what a GPU moves")
    scheduler_limit = allocator = None
    if gpu:
        io = xla_bytes - mem.temp_size_in_bytes
        scheduler_limit = scheduler_memory_limit(base, io, slop)
        note = scheduler_memory_note(base, gpu.memory_bytes, io, mem.temp_size_in_bytes, slop)
        notes += [note] if note else []
        if mem_fraction is not None:
            allocator = base
            if xla_bytes > base:
                notes.append(f"XLA's memory per device ({xla_bytes / 2**30:.1f} GiB) exceeds the allocator's "
                             f"{base / 2**30:.1f} GiB at XLA_PYTHON_CLIENT_MEM_FRACTION={share}: a GPU run of it "
                             "runs out of memory")
    return {
        **({"hlo": hlo} if keep_hlo else {}),
        "devices": n_devices, "mesh": sizes, "domain_size": domain, "layout": layout.name(),
        "compile_s": compile_s, "platform": platform, "target": gpu.name if gpu else "cpu",
        "device_kind": devices[0].device_kind, "notes": notes,
        "kernels": {k: cfg.kernels[k] for k in KERNEL_FIELDS}, "kernels_line": kernels_line,
        "collectives": [{"kind": c.kind, "bytes": c.bytes, "count": c.count, "dtypes": dict(c.by_dtype),
                         "group_size": len(c.groups[0]), "overlapped": c.overlapped, "under_gemm": c.under_gemm,
                         "op": c.op_name[-120:]}
                        for c in colls],
        "xla": {"memory_bytes": xla_bytes, "argument_bytes": mem.argument_size_in_bytes,
                "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
                "temp_bytes": mem.temp_size_in_bytes, "flops": float(cost.get("flops", 0.0)),
                "scheduler_memory_limit_bytes": scheduler_limit,
                # --dry_run_mem_fraction: the run's allocator limit (share x memory) and the slop the compile used
                "mem_fraction": mem_fraction, "allocator_bytes": allocator,
                "compiler_options": compiler_options,
                "kernels": kernel_inventory(hlo),
                # whole layer stacks relaid out for a gather (parallel/layouts.py keeps them out): none expected
                "stacked_weight_copies": stacked_weight_copies(hlo),
                "te_grouped_gemms": te_gemm_summary(te_grouped_gemms(hlo)),
                # what jax asked XLA for, before XLA's passes (e.g. block-scaled FP8 dots it may expand)
                "lowered_custom_calls": lowered_custom_calls(lowered.as_text()),
                "collective_bytes": hlo_kinds, "collective_bytes_by_dtype": xla_dtypes,
                "collective_bytes_by_link": hlo_links,
                # per kind: the bytes moved by asynchronous collectives with compute scheduled under them
                "overlap": overlap(colls), "expert_exchange_overlap": expert_exchange_overlap(colls),
                "expert_exchange_under_gemm": expert_exchange_overlap(colls, "gemm_bytes")},
        "plan": {"memory_bytes": predicted_mem.total, "memory": predicted_mem.to_dict(),
                 "model_flops_per_device": flops_per_token(cfg) * tokens / n_devices,
                 "collective_bytes": pred_kinds, "collective_bytes_by_dtype": plan_dtypes,
                 "collective_bytes_by_link": buffer_bytes_by_link(traffic, sizes, domain)},
    }


def _shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    """One device's bytes of an abstract array with a sharding."""
    return int(np.prod(a.sharding.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize


def te_gemm_summary(gemms: list[dict]) -> list[dict]:
    """TE's grouped GEMMs counted by (kind, operand types, workspace, path)."""
    counts: dict[tuple, int] = {}
    for g in gemms:
        key = (g["kind"], " x ".join(g["operands"][::2]) + " (scales " + " x ".join(g["operands"][1::2]) + ")"
               if g["operands"][0].startswith("f8") else " x ".join(g["operands"][::2]), g["workspace_bytes"], g["v2"])
        counts[key] = counts.get(key, 0) + 1
    return [{"kind": k, "operands": ops, "workspace_bytes": ws, "v2": v2, "count": n}
            for (k, ops, ws, v2), n in sorted(counts.items())]


def _dtypes(by_dtype: dict[str, int]) -> str:
    return "+".join(sorted((t for t, n in by_dtype.items() if n), key=lambda t: -by_dtype[t])) or "-"


EXPERT_EXCHANGES = ("all-to-all", "ragged-all-to-all")  # the MoE dispatch and combine (capacity / dropless)


def expert_exchange_overlap(colls, under: str = "overlapped_bytes") -> float | None:
    """The share of the expert exchange's bytes (all-to-all and ragged all-to-all) moved with compute scheduled
    under them (under='gemm_bytes': with a GEMM among it); None when the program has no exchange."""
    by_kind = overlap(colls)
    total = sum(by_kind[k]["bytes"] for k in EXPERT_EXCHANGES if k in by_kind)
    return sum(by_kind[k][under] for k in EXPERT_EXCHANGES if k in by_kind) / total if total else None


def _overlap_line(x: dict) -> str:
    parts = [] if x.get("expert_exchange_overlap") is None else [
        f"expert exchange {x['expert_exchange_overlap']:.0%} (a GEMM under {x['expert_exchange_under_gemm']:.0%})"]
    parts += [f"{kind} {o['share']:.0%}" for kind, o in sorted(x["overlap"].items()) if o["bytes"]]
    return "  collective bytes with compute scheduled under them: " + ", ".join(parts)


def format_report(r: dict) -> str:
    gib = 2**30
    x, p = r["xla"], r["plan"]
    where = (f"{r['devices']} compile-only {r.get('device_kind', 'GPU')} (XLA:GPU, no device)"
             if r.get("platform") == "gpu" else f"{r['devices']} emulated devices")
    lines = [
        f"dry run: {r['layout']} on {where} (NVLink domain {r['domain_size']}), "
        f"compiled in {r['compile_s']:.1f}s",
        f"  {r.get('kernels_line', '')}",
        *([f"  {describe_xla_flags(r['xla_gpu_flags'])}"] if r.get("xla_gpu_flags") else []),
        "  per device:",
        f"  {'':28s} {'XLA':>12s} {'planner':>12s}",
        f"  {'memory (GiB)':28s} {x['memory_bytes'] / gib:12.3f} {p['memory_bytes'] / gib:12.3f}"
        f"   (XLA: arguments {x['argument_bytes'] / gib:.3f} + temp {x['temp_bytes'] / gib:.3f}, outputs aliased)",
    ]
    if x.get("scheduler_memory_limit_bytes") is not None:
        lines.append(f"  {'scheduler budget (GiB)':28s} {x['scheduler_memory_limit_bytes'] / gib:12.3f}"
                     + (f"   (a GPU run at XLA_PYTHON_CLIENT_MEM_FRACTION={x['mem_fraction']}: allocator "
                        f"{x['allocator_bytes'] / gib:.3f} GiB, the compile's "
                        + ", ".join(f"--{k}={v}" for k, v in x['compiler_options'].items()) + ")"
                        if x.get("mem_fraction") is not None else "   (deviceless: 80% of the target's memory)"))
    for kind in sorted(set(x["collective_bytes"]) | set(p["collective_bytes"])):
        types = ""
        if "collective_bytes_by_dtype" in x:
            types = (f"   (XLA {_dtypes(x['collective_bytes_by_dtype'].get(kind, {}))}, "
                     f"planner {_dtypes(p['collective_bytes_by_dtype'].get(kind, {}))})")
        lines.append(f"  {kind + ' (MB/step)':28s} {x['collective_bytes'].get(kind, 0) / 1e6:12.2f} "
                     f"{p['collective_bytes'].get(kind, 0) / 1e6:12.2f}{types}")
    for link in ("nvlink", "nic"):
        lines.append(f"  {'on ' + link + ' (MB/step)':28s} {x['collective_bytes_by_link'][link] / 1e6:12.2f} "
                     f"{p['collective_bytes_by_link'][link] / 1e6:12.2f}")
    if r.get("platform") == "gpu" and x.get("overlap"):  # XLA:CPU runs every collective synchronously
        lines.append(_overlap_line(x))
    if x["flops"]:
        lines.append(f"  {'FLOPs (TFLOP/step)':28s} {x['flops'] / 1e12:12.4f} {p['model_flops_per_device'] / 1e12:12.4f}"
                     "   (XLA counts a scan body once; the planner column is model FLOPs for all layers)")
    if "kernels" in x:
        calls = ", ".join(f"{t} x{n}" for t, n in x["kernels"]["custom_calls"].items()) or "none"
        fusions = ", ".join(f"{t} x{n}" for t, n in x["kernels"]["fusions"].items()) or "none"
        dots = ", ".join(f"{t} x{n}" for t, n in x["kernels"].get("dots", {}).items()) or "none"
        lines += [f"  custom calls (as in the text): {calls}", f"  fusions: {fusions}",
                  f"  dot operand types (lhs x rhs): {dots}"]
    if x.get("te_grouped_gemms"):
        lines.append("  Transformer Engine grouped GEMMs (as in the text): " + ", ".join(
            f"{g['kind']} {g['operands']} x{g['count']}" for g in x["te_grouped_gemms"])
            + f"; cuBLAS workspace {x['te_grouped_gemms'][0]['workspace_bytes'] / 2**20:.0f} MiB per call"
            + ("" if all(g["v2"] for g in x["te_grouped_gemms"]) else
               "; V1 path (cuBLAS < 13.2 build: copies the group sizes to the host and waits, every call)"))
    if x.get("stacked_weight_copies"):
        copies = ", ".join(f"{shape} ({n / gib:.2f} GiB)" for shape, n in x["stacked_weight_copies"].items())
        lines.append(f"  whole-stack weight relayouts (one of each shape): {copies}")
    if r.get("collectives"):
        lines.append(f"  {'collective':20s} {'dtype':>10s} {'group':>6s} {'MB each':>10s} {'x/step':>7s} "
                     f"{'overlap':>7s}  op")
        for c in sorted(r["collectives"], key=lambda c: -c["bytes"] * c["count"]):
            lines.append(f"  {c['kind']:20s} {'+'.join(c['dtypes']):>10s} {c['group_size']:6d} "
                         f"{c['bytes'] / 1e6:10.3f} {c['count']:7d} {'yes' if c.get('overlapped') else 'no':>7s}"
                         f"  {c['op'][-60:]}")
    lines += [f"  note: {n}" for n in r.get("notes", ())]
    return "\n".join(lines)
