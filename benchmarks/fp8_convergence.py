"""FP8 against bf16 on the same training run: trains a config (default DeepSeek-V3-small, 200 steps on the embedded
corpus) once per model.fp8 format with model.dtype=bfloat16, then prints the final loss, the mean loss of the last
quarter of the steps (every step logged: a short run's loss moves by a few percent from one logged step to the
next, so single logged values are too noisy to compare formats), the held-out loss, and each FP8 run's gap to the
bf16 run of the same seed. With several --seeds (config.seed: initialisation and data order) it also prints each
format's mean over the seeds and the mean and spread of its per-seed gaps, which separate a format's bias from one
run's noise. The pseudo-format `f32` (f32 compute, no FP8) measures the noise floor: how far a harmless precision
change moves a seed's loss. Writes JSON. Each run is `moejax-train` in its own process.

    python benchmarks/fp8_convergence.py [--config configs/deepseek_v3_small.py] [--formats none,blockwise,rowwise,mxfp8,f32]
        [--steps 200] [--seeds 0] [--json benchmarks/results/fp8_convergence.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train(config: str, fmt: str, steps: int, workdir: Path, seed: int = 0) -> dict:
    # "f32": f32 compute without FP8, a precision change that should cost nothing: its gap to bf16 at a seed is
    # that seed's noise floor (how far any perturbation of the run moves its loss at this length)
    dtype, fp8 = ("float32", "none") if fmt == "f32" else ("bfloat16", fmt)
    cmd = [sys.executable, "-m", "moejax.train", "--config", config, "--workdir", str(workdir),
           f"--config.model.dtype={dtype}", f"--config.model.fp8={fp8}", f"--config.train.steps={steps}",
           "--config.train.log_every=1", f"--config.seed={seed}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    tail = [r["loss"] for r in logged[-max(1, steps // 4):]]
    return {"format": fmt, "seed": seed, "wall_s": round(time.perf_counter() - t0, 1), "final_loss": logged[-1]["loss"],
            "tail_mean_loss": sum(tail) / len(tail), "eval_loss": evals[-1] if evals else None,
            "losses": [(r["step"], r["loss"]) for r in logged]}


def _over_seeds(fmt: str, runs: list[dict]) -> dict:
    """One format's runs over the seeds: mean losses, and the mean and range of its per-seed gaps to bf16."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    gaps = [r["gap_vs_bf16"] for r in runs if "gap_vs_bf16" in r]
    eval_gaps = [r["eval_gap_vs_bf16"] for r in runs if r.get("eval_gap_vs_bf16") is not None]
    return {"format": fmt, "seeds": [r["seed"] for r in runs], "mean_tail_loss": mean([r["tail_mean_loss"] for r in runs]),
            "mean_eval_loss": mean([r["eval_loss"] for r in runs if r["eval_loss"] is not None] or [float("nan")]),
            "mean_gap": mean(gaps) if gaps else None, "min_gap": min(gaps) if gaps else None,
            "max_gap": max(gaps) if gaps else None, "mean_eval_gap": mean(eval_gaps) if eval_gaps else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/deepseek_v3_small.py")
    p.add_argument("--formats", default="none,blockwise,mxfp8")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", default="0", help="comma-separated config.seed values, each format run per seed")
    p.add_argument("--json", default="benchmarks/results/fp8_convergence.json")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [train(args.config, fmt, args.steps, Path(tmp) / f"{fmt}-{seed}", seed) for seed in seeds
                for fmt in formats]
    print(f"{'model.fp8':<10} {'seed':>4} {'final loss':>10} {'last-25% mean':>13} {'eval':>7} {'gap vs bf16':>11} "
          f"{'eval gap':>8} {'wall s':>7}")
    for r in runs:
        base = next((b for b in runs if b["format"] == "none" and b["seed"] == r["seed"]), None)
        if base is not None:
            r["gap_vs_bf16"] = r["tail_mean_loss"] / base["tail_mean_loss"] - 1
            r["eval_gap_vs_bf16"] = (r["eval_loss"] / base["eval_loss"] - 1) if r["eval_loss"] and base["eval_loss"] else None
        gap = f"{100 * r['gap_vs_bf16']:+.2f}%" if "gap_vs_bf16" in r else "-"
        ev = f"{r['eval_loss']:.3f}" if r["eval_loss"] is not None else "-"
        egap = f"{100 * r['eval_gap_vs_bf16']:+.2f}%" if r.get("eval_gap_vs_bf16") is not None else "-"
        print(f"{r['format']:<10} {r['seed']:>4} {r['final_loss']:>10.3f} {r['tail_mean_loss']:>13.3f} {ev:>7} "
              f"{gap:>11} {egap:>8} {r['wall_s']:>7.0f}")
    summary = [_over_seeds(fmt, [r for r in runs if r["format"] == fmt]) for fmt in formats] if len(seeds) > 1 else []
    if summary:
        print(f"\nover seeds {args.seeds}: {'model.fp8':<10} {'mean last-25%':>13} {'mean eval':>9} {'mean gap':>9} "
              f"{'gap min..max':>16} {'mean eval gap':>13}")
        for s in summary:
            gaps = (f"{100 * s['mean_gap']:+.2f}%", f"{100 * s['min_gap']:+.2f}..{100 * s['max_gap']:+.2f}%",
                    f"{100 * s['mean_eval_gap']:+.2f}%") if s["mean_gap"] is not None else ("-", "-", "-")
            print(f"{'':<{len('over seeds ' + args.seeds) + 2}}{s['format']:<10} {s['mean_tail_loss']:>13.3f} "
                  f"{s['mean_eval_loss']:>9.3f} {gaps[0]:>9} {gaps[1]:>16} {gaps[2]:>13}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "steps": args.steps, "seeds": seeds, "runs": runs,
                                   "over_seeds": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
