"""`moejax-plan --topology T --gpus N[,N...]`: rank layouts at each GPU count and the scaling between counts."""

from __future__ import annotations

from moejax.parallel.topology import Topology
from moejax.planner.predict import assumptions, domain_size_for, enumerate_layouts, predict, rank


def plan(cfg, topo: Topology, gpu_counts: list[int], *, efficiency: float, domain_size: int = 0,
         remats=("none", "dots", "full"), dispatches=None, top: int = 5) -> dict:
    runs = []
    for n in gpu_counts:
        domain = domain_size_for(topo, n, domain_size)
        layouts = enumerate_layouts(cfg, n, domain, remats=remats, dispatches=dispatches)
        ranked = rank([predict(cfg, topo, lay, efficiency=efficiency, domain_size=domain) for lay in layouts])
        runs.append({"gpus": n, "domain_size": domain, "layouts_considered": len(layouts),
                     "layouts_that_fit": sum(p.fits for p in ranked),
                     "best": [p.to_dict() for p in ranked[:top]]})
    base = next((r for r in runs if r["best"] and r["best"][0]["fits"]), None)
    for r in runs:
        best = r["best"][0] if r["best"] and r["best"][0]["fits"] else None
        r["scaling_efficiency"] = (best["tokens_per_s_per_gpu"] / base["best"][0]["tokens_per_s_per_gpu"]
                                   if best and base else None)
    return {"topology": topo.name, "efficiency": efficiency, "global_batch": int(cfg.train.global_batch),
            "seq_len": int(cfg.train.seq_len), "runs": runs,
            "assumptions": assumptions(topo, efficiency, runs[0]["domain_size"] if runs else 0, cfg,
                                       remats=remats, dispatches=dispatches)}


def format_plan(result: dict) -> str:
    gb = 1e9
    lines = [f"{result['topology']}: global batch {result['global_batch']} x seq {result['seq_len']}"]
    for r in result["runs"]:
        eff = f"{r['scaling_efficiency']:.1%}" if r["scaling_efficiency"] is not None else "-"
        lines.append(f"\n{r['gpus']} GPUs (domain {r['domain_size']}): {r['layouts_that_fit']} of "
                     f"{r['layouts_considered']} layouts fit; scaling efficiency vs the first count: {eff}")
        lines.append(f"  {'layout':58s} {'mem GB':>7s} {'NVLink GB':>9s} {'NIC GB':>7s} {'step s':>7s} "
                     f"{'tok/s/GPU':>9s} {'TFLOP/s':>8s} {'MFU':>6s}")
        for p in r["best"]:
            flag = "" if p["fits"] else "  (does not fit)"
            lines.append(f"  {p['name']:58s} {p['memory']['total'] / gb:7.1f} {p['wire_bytes']['nvlink'] / gb:9.2f} "
                         f"{p['wire_bytes']['nic'] / gb:7.2f} {p['step_s']:7.2f} {p['tokens_per_s_per_gpu']:9.0f} "
                         f"{p['tflops_per_gpu']:8.0f} {p['mfu']:6.1%}{flag}")
        if r["best"]:
            m = r["best"][0]["memory"]
            lines.append("  best layout's memory per GPU (GB): " + ", ".join(
                f"{k} {v / gb:.1f}" for k, v in m.items()))
    lines.append("\nassumptions:")
    lines += [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines)
