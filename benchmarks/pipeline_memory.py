"""Pipeline schedules' memory: XLA's temp memory of the compiled training step (8 emulated CPU devices) under the
circular schedule and 1F1B at a growing micro-batch count, each micro-batch the same size, next to the planner's.

    python benchmarks/pipeline_memory.py [--micro 8,16,32] [--json benchmarks/results/pipeline_memory.json]

The step: DeepSeek-style medium model (a dense layer, 8 MoE layers, MTP off; d_model 256, seq 128, remat
`attention` by default, capacity dispatch) on PP2 x VP2 with expert 2 x tensor 2 inside each stage, 4 rows per micro-batch (global batch
4 M). The circular schedule keeps every tick's residuals until the backward of its pass (they grow with M); 1F1B
keeps V S + 2 S - 2 chunk forwards per stage at most (flat in M). The pass's input and its cotangent ([M, rows,
seq, d_model] each, one activation per token) grow with M under both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moejax.planner.dry_run import dry_run  # noqa: E402
from tests.test_plan_vs_xla import medium_config  # noqa: E402


def row(schedule: str, micro: int, remat: str) -> dict:
    cfg = medium_config(1, 1, 2, 2)
    # No dense layer: the parts outside the stages (embedding, head, loss) are small beside the MoE stack's
    # residuals, whose growth with M is what the schedules differ in.
    cfg.model.n_layers, cfg.model.first_k_dense, cfg.model.remat = 8, 0, remat
    cfg.mesh.stage, cfg.mesh.virtual_stages, cfg.mesh.pipeline_schedule = 2, 2, schedule
    cfg.train.micro_batches, cfg.train.global_batch = micro, 4 * micro
    r = dry_run(cfg, 8)
    return {"schedule": schedule, "remat": remat, "micro_batches": micro, "global_batch": 4 * micro,
            "xla_temp_mb": r["xla"]["temp_bytes"] / 1e6, "xla_total_mb": r["xla"]["memory_bytes"] / 1e6,
            "plan_total_mb": r["plan"]["memory_bytes"] / 1e6, "compile_s": r["compile_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro", default="8,16,32")
    ap.add_argument("--schedules", default="circular,1f1b")
    ap.add_argument("--remat", default="attention")
    ap.add_argument("--json", default="benchmarks/results/pipeline_memory.json")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'schedule':<9} {'M':>3} {'batch':>5} {'XLA temp MB':>11} {'XLA total MB':>12} {'planner MB':>10} "
          f"{'compile s':>9}", flush=True)
    for schedule in args.schedules.split(","):
        for micro in (int(m) for m in args.micro.split(",")):
            r = row(schedule, micro, args.remat)
            rows.append(r)
            print(f"{schedule:<9} {micro:>3} {r['global_batch']:>5} {r['xla_temp_mb']:>11.1f} {r['xla_total_mb']:>12.1f} "
                  f"{r['plan_total_mb']:>10.1f} {r['compile_s']:>9.1f}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
