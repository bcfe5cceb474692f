"""`moejax-plan --topology T --gpus N[,N...]`: rank layouts at each GPU count and the scaling between counts."""

from __future__ import annotations

from moejax.config import ConfigError, validate
from moejax.config.schema import PIPELINE_SCHEDULES
from moejax.errors import InputError
from moejax.parallel.topology import Topology
from moejax.parallel.xla_gpu_flags import LAUNCH_MEM_FRACTION
from moejax.planner.layout import Layout
from moejax.planner.predict import assumptions, domain_size_for, enumerate_layouts, predict, rank


def plan(cfg, topo: Topology, gpu_counts: list[int], *, efficiency: float, domain_size: int = 0,
         remats=("none", "dots", "full"), dispatches=None, top: int = 5, candidates: tuple[Layout, ...] = (),
         mem_fraction: float = LAUNCH_MEM_FRACTION) -> dict:
    """mem_fraction: XLA's allocator's share of each GPU's memory (predict). `candidates`: layouts to rank among
    the searched ones at their GPU count and explain, whether or not the config can run them (e.g. a published
    record's layout)."""
    runs = []
    for n in gpu_counts:
        domain = domain_size_for(topo, n, domain_size)
        layouts = enumerate_layouts(cfg, n, domain, remats=remats, dispatches=dispatches, hbm_bytes=topo.hbm_bytes)
        ranked = rank([predict(cfg, topo, lay, efficiency=efficiency, domain_size=domain, mem_fraction=mem_fraction)
                       for lay in layouts])
        runs.append({"gpus": n, "domain_size": domain, "layouts_considered": len(layouts),
                     "layouts_that_fit": sum(p.fits for p in ranked),
                     "best": [p.to_dict() for p in ranked[:top]],
                     # the fastest layout with pipeline stages that fits, else the one closest to fitting
                     "best_pipelined": _best_pipelined(ranked),
                     "candidates": [_candidate(cfg, topo, lay, ranked, efficiency, domain, mem_fraction)
                                    for lay in candidates if lay.n_devices == n]})
    base = next((r for r in runs if r["best"] and r["best"][0]["fits"]), None)
    for r in runs:
        best = r["best"][0] if r["best"] and r["best"][0]["fits"] else None
        r["scaling_efficiency"] = (best["tokens_per_s_per_gpu"] / base["best"][0]["tokens_per_s_per_gpu"]
                                   if best and base else None)
    return {"topology": topo.name, "efficiency": efficiency, "mem_fraction": mem_fraction,
            "global_batch": int(cfg.train.global_batch),
            "seq_len": int(cfg.train.seq_len), "runs": runs,
            "assumptions": assumptions(topo, efficiency, runs[0]["domain_size"] if runs else 0, cfg,
                                       remats=remats, dispatches=dispatches, mem_fraction=mem_fraction)}


def _best_pipelined(ranked) -> dict | None:
    staged = [p for p in ranked if p.layout.stage > 1]
    if not staged:
        return None
    fitting = [p for p in staged if p.fits]
    return (fitting[0] if fitting else min(staged, key=lambda p: p.memory.total)).to_dict()


def _candidate(cfg, topo: Topology, layout: Layout, ranked, efficiency: float, domain: int,
               mem_fraction: float) -> dict:
    """A given layout's prediction, its place among the searched layouts, and why moejax could not run it (the
    config error), if so."""
    pred = predict(cfg, topo, layout, efficiency=efficiency, domain_size=domain, mem_fraction=mem_fraction)
    place = 1 + sum(1 for p in ranked if (not p.fits, p.step_s) < (not pred.fits, pred.step_s))
    trial = cfg.copy_and_resolve_references()
    with trial.unlocked():
        for axis, size in layout.sizes.items():
            trial.mesh[axis] = size
        trial.mesh.virtual_stages = layout.virtual
        trial.mesh.pipeline_in_flight = layout.in_flight
        trial.mesh.pipeline_schedule = layout.schedule
        trial.moe.dispatch = layout.dispatch
        trial.train.micro_batches = layout.n_micro(int(cfg.train.global_batch))
    try:
        validate(trial, layout.n_devices)
        runs = None
    except ConfigError as e:
        runs = str(e)
    return {**pred.to_dict(), "rank": place, "of": len(ranked), "config_error": runs}


def parse_layout(text: str) -> Layout:
    """'stage=2,virtual=8,expert=32,data=4,cp=4,remat=full,mb=1,dispatch=capacity,schedule=1f1b' -> Layout (unnamed
    axes 1, remat full, mb 1, dispatch capacity, schedule circular); InputError on a bad field."""
    fields = {"data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, "stage": 1, "virtual": 1, "remat": "full",
              "micro_batch": 1, "dispatch": "capacity", "in_flight": 0, "schedule": "circular"}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = {"mb": "micro_batch", "vp": "virtual", "pp": "stage", "ep": "expert", "tp": "tensor",
               "cp": "context", "inflight": "in_flight", "sched": "schedule"}.get(key, key)
        if key not in fields or not value:
            raise InputError(f"--layout {text!r}: {part!r} is not one of {', '.join(fields)}=value")
        try:
            fields[key] = value if key in ("remat", "dispatch", "schedule") else int(value)
        except ValueError:
            raise InputError(f"--layout {text!r}: {key} must be an integer, not {value!r}") from None
    if fields["schedule"] not in PIPELINE_SCHEDULES:
        raise InputError(f"--layout {text!r}: schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, not "
                         f"{fields['schedule']!r}")
    return Layout(**fields)


def format_plan(result: dict) -> str:
    gb = 1e9
    lines = [f"{result['topology']}: global batch {result['global_batch']} x seq {result['seq_len']}"]
    for r in result["runs"]:
        eff = f"{r['scaling_efficiency']:.1%}" if r["scaling_efficiency"] is not None else "-"
        lines.append(f"\n{r['gpus']} GPUs (domain {r['domain_size']}): {r['layouts_that_fit']} of "
                     f"{r['layouts_considered']} layouts fit; scaling efficiency vs the first count: {eff}")
        lines.append(f"  {'layout':66s} {'mem GB':>7s} {'NVLink GB':>9s} {'NIC GB':>7s} {'step s':>7s} "
                     f"{'tok/s/GPU':>9s} {'TFLOP/s':>8s} {'MFU':>6s}")
        for p in r["best"]:
            flag = "" if p["fits"] else "  (does not fit)"
            lines.append(f"  {p['name']:66s} {p['memory']['total'] / gb:7.1f} {p['wire_bytes']['nvlink'] / gb:9.2f} "
                         f"{p['wire_bytes']['nic'] / gb:7.2f} {p['step_s']:7.2f} {p['tokens_per_s_per_gpu']:9.0f} "
                         f"{p['tflops_per_gpu']:8.0f} {p['mfu']:6.1%}{flag}")
        if r["best"]:
            m = r["best"][0]["memory"]
            lines.append("  best layout's memory per GPU (GB): " + ", ".join(
                f"{k} {v / gb:.1f}" for k, v in m.items()))
        if (bp := r.get("best_pipelined")) and bp["name"] not in {p["name"] for p in r["best"]}:
            fit = "fits" if bp["fits"] else "does not fit"
            lines.append(f"  best with pipeline stages: {bp['name']} ({fit}, {bp['memory']['total'] / gb:.1f} GB): step "
                         f"{bp['step_s']:.2f} s, {bp['tflops_per_gpu']:.0f} TFLOP/s, bubble {bp['bubble']:.2%}, "
                         f"compute x{bp['stage_compute']:.3f} of an even split, NIC {bp['wire_bytes']['nic'] / gb:.1f} GB")
        for c in r.get("candidates", []):
            fit = "fits" if c["fits"] else f"does not fit ({c['memory']['total'] / gb:.0f} GB)"
            lines.append(f"  candidate {c['name']}: rank {c['rank']} of {c['of']}, {fit}, step {c['step_s']:.2f} s, "
                         f"{c['tokens_per_s_per_gpu']:.0f} tok/s/GPU, {c['tflops_per_gpu']:.0f} TFLOP/s, MFU {c['mfu']:.1%}; "
                         f"bubble {c['bubble']:.2%}, compute x{c['stage_compute']:.3f} of an even split, "
                         f"exposed communication {c['exposed_comm_s']:.2f} s, NIC {c['wire_bytes']['nic'] / gb:.1f} GB")
            lines.append("    memory (GB): " + ", ".join(f"{k} {v / gb:.1f}" for k, v in c["memory"].items()))
            if c["config_error"]:
                lines.append(f"    moejax cannot run it as configured: {c['config_error']}")
    lines.append("\nassumptions:")
    lines += [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines)
