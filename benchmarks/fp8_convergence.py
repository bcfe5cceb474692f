"""FP8 against bf16 on the same training run: trains a config (default DeepSeek-V3-small, 200 steps on the embedded
corpus) once per model.fp8 format with model.dtype=bfloat16, then prints the final loss, the mean loss of the last
quarter of the steps (every step logged: a short run's loss moves by a few percent from one logged step to the
next, so single logged values are too noisy to compare formats), the held-out loss, and each FP8 run's gap to the
bf16 run. Writes JSON. Each run is `moejax-train` in its own process.

    python benchmarks/fp8_convergence.py [--config configs/deepseek_v3_small.py] [--formats none,blockwise,mxfp8]
        [--steps 200] [--json benchmarks/results/fp8_convergence.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train(config: str, fmt: str, steps: int, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "moejax.train", "--config", config, "--workdir", str(workdir),
           "--config.model.dtype=bfloat16", f"--config.model.fp8={fmt}", f"--config.train.steps={steps}",
           "--config.train.log_every=1"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    tail = [r["loss"] for r in logged[-max(1, steps // 4):]]
    return {"format": fmt, "wall_s": round(time.perf_counter() - t0, 1), "final_loss": logged[-1]["loss"],
            "tail_mean_loss": sum(tail) / len(tail), "eval_loss": evals[-1] if evals else None,
            "losses": [(r["step"], r["loss"]) for r in logged]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/deepseek_v3_small.py")
    p.add_argument("--formats", default="none,blockwise,mxfp8")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default="benchmarks/results/fp8_convergence.json")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [train(args.config, fmt, args.steps, Path(tmp) / fmt) for fmt in formats]
    base = next((r for r in runs if r["format"] == "none"), None)
    print(f"{'model.fp8':<10} {'final loss':>10} {'last-25% mean':>13} {'eval':>7} {'gap vs bf16':>11} {'eval gap':>8} "
          f"{'wall s':>7}")
    for r in runs:
        if base is not None:
            r["gap_vs_bf16"] = r["tail_mean_loss"] / base["tail_mean_loss"] - 1
            r["eval_gap_vs_bf16"] = (r["eval_loss"] / base["eval_loss"] - 1) if r["eval_loss"] and base["eval_loss"] else None
        gap = f"{100 * r['gap_vs_bf16']:+.2f}%" if "gap_vs_bf16" in r else "-"
        ev = f"{r['eval_loss']:.3f}" if r["eval_loss"] is not None else "-"
        egap = f"{100 * r['eval_gap_vs_bf16']:+.2f}%" if r.get("eval_gap_vs_bf16") is not None else "-"
        print(f"{r['format']:<10} {r['final_loss']:>10.3f} {r['tail_mean_loss']:>13.3f} {ev:>7} {gap:>11} {egap:>8} "
              f"{r['wall_s']:>7.0f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "steps": args.steps, "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
