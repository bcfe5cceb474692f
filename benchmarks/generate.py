"""Generation speed and KV-cache memory: prefill and decode tokens/s of DeepSeek-V3-small (random weights) on the
emulated CPU mesh of its config (data 2 x expert 4: expert-parallel decode) and on one device, measured in one run;
then the KV cache DeepSeek-V3 671B keeps per position and layer (MLA's latent against expanded K/V) and the
planner's memory for serving it on GB300s (moejax/planner/serving.py). Prints tables, writes JSON.

    python benchmarks/generate.py [--batch 8 --prompt 128 --new 64] [--json benchmarks/results/generate.json]

Compiles are excluded (moejax.inference.generate compiles before timing); each figure is the best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moejax import load_config  # noqa: E402
from moejax.config import validate  # noqa: E402
from moejax.inference.generate import generate_ids  # noqa: E402
from moejax.parallel.mesh import mesh_from_config  # noqa: E402
from moejax.planner.layout import Layout  # noqa: E402
from moejax.planner.serving import serving_memory  # noqa: E402
from moejax.program.optim import make_optimizer  # noqa: E402
from moejax.program.state import create_model, init_state, model_graphdef  # noqa: E402

GB = 1e9


def speed(model, prompts, new_tokens, mesh, repeats):
    best = None
    for _ in range(repeats):
        g = generate_ids(model, prompts, max_new_tokens=new_tokens, mesh=mesh)
        row = {"prefill_tokens_per_s": g.prompt_tokens / g.prefill_s, "decode_tokens_per_s": g.new_tokens / g.decode_s,
               "prefill_s": g.prefill_s, "decode_s": g.decode_s, "new_tokens": g.new_tokens}
        if best is None or row["decode_s"] + row["prefill_s"] < best["decode_s"] + best["prefill_s"]:
            best = row
    return best, g.tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve_batch", type=int, default=256, help="sequences served at once (671B on GB300s)")
    ap.add_argument("--serve_context", type=int, default=32768, help="positions per sequence (671B on GB300s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    cfg = load_config(ROOT / "configs/deepseek_v3_small.py")
    mesh = mesh_from_config(cfg, validate(cfg, jax.device_count()))
    state, _ = init_state(cfg, make_optimizer(cfg.optim), mesh, cfg.seed)
    on_mesh = nnx.merge(model_graphdef(cfg), state.params, state.model_state)
    one_device = create_model(cfg, cfg.seed)
    prompts = np.random.RandomState(0).randint(0, 256, (args.batch, args.prompt)).tolist()
    rows = {}
    for name, model, m in (("cpu mesh " + " x ".join(f"{a}{s}" for a, s in mesh.shape.items() if s > 1), on_mesh, mesh),
                           ("one cpu device", one_device, None)):
        rows[name], tokens = speed(model, prompts, args.new, m, args.repeats)
        rows[name]["tokens"] = tokens
    same = rows[next(iter(rows))].pop("tokens") == rows["one cpu device"].pop("tokens")

    print(f"DeepSeek-V3-small, {args.batch} prompts x {args.prompt} tokens, {args.new} new tokens each (greedy), "
          f"{jax.device_count()} CPU devices on {os.cpu_count()} cores; same tokens on both: {same}")
    print(f"{'where':<32} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill s':>10} {'decode s':>9}")
    for name, r in rows.items():
        print(f"{name:<32} {r['prefill_tokens_per_s']:>14,.0f} {r['decode_tokens_per_s']:>13,.0f} "
              f"{r['prefill_s']:>10.3f} {r['decode_s']:>9.3f}")

    big = load_config(ROOT / "configs/deepseek_v3_671b.py")
    layouts = [Layout(data=1, fsdp=1, expert=64, tensor=1, remat="none", micro_batch=1, dispatch="dropless"),
               Layout(data=4, fsdp=1, expert=64, tensor=1, remat="none", micro_batch=1, dispatch="dropless"),
               Layout(data=1, fsdp=1, expert=32, tensor=1, remat="none", micro_batch=1, dispatch="dropless")]
    serving = []
    for layout in layouts:
        memory = serving_memory(big, layout, batch=args.serve_batch, context=args.serve_context)
        serving.append({"layout": layout.name(), "gpus": layout.n_devices, **memory})
    kept, expanded = serving[0]["kv_bytes_per_position_per_layer"], serving[0]["expanded_kv_bytes_per_position_per_layer"]
    print(f"\nDeepSeek-V3 671B KV cache per position and layer (bf16): MLA latent + RoPE key {kept:,} B, expanded K/V "
          f"{expanded:,} B ({expanded / kept:.0f}x)")
    print(f"serving {args.serve_batch} sequences x {args.serve_context} positions, bf16 weights and cache, per GB300 "
          f"(288 GB; planner, a prediction):")
    print(f"{'layout':<24} {'gpus':>5} {'rows/gpu':>9} {'weights GB':>11} {'kv cache GB':>12} {'total GB':>9}")
    for s in serving:
        print(f"{s['layout']:<24} {s['gpus']:>5} {s['rows_per_device']:>9} {s['weights'] / GB:>11.1f} "
              f"{s['kv_cache'] / GB:>12.1f} {s['total'] / GB:>9.1f}")

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "speed": rows, "same_tokens": same,
                                               "serving_671b_gb300": serving}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
