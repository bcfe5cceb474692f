#!/usr/bin/env python3
"""A sweep over one config field through moejax's Python API: one run per value, one after another in this
process, then a table of the final metrics (and WORKDIR/sweep.json).

    python launch/sweep.py --config configs/tiny.py --field optim.lr --values 1e-3,3e-3,1e-2 \\
        --workdir runs/lr-sweep --set train.steps=200

Each run gets WORKDIR/<field>=<value> as its workdir, so rerunning the sweep resumes unfinished runs and
skips finished ones (their checkpoints are at the last step). On a machine without accelerators,
--cpu_devices N emulates N CPU devices (the tiny configs want 8). A bad config or value stops the sweep
before anything is trained, with one line and exit 2.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import moejax
from moejax import api


def _value(text: str):
    """'3e-3' -> 0.003, '8' -> 8, 'true' -> True, 'dots' -> 'dots': Python literals, else the string."""
    lowered = {"true": True, "false": False}.get(text.strip().lower())
    if lowered is not None:
        return lowered
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise moejax.InputError(f"--set {pair!r} is not FIELD=VALUE")
        out[key.strip()] = _value(value)
    return out


def _num(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config file, e.g. configs/tiny.py")
    parser.add_argument("--field", required=True, help="the dotted config field to sweep, e.g. optim.lr")
    parser.add_argument("--values", required=True, help="comma-separated values, e.g. 1e-3,3e-3")
    parser.add_argument("--workdir", required=True, help="one sub-directory per run, and sweep.json")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an override for every run (repeatable), e.g. --set train.steps=100")
    parser.add_argument("--cpu_devices", type=int, default=0, help="emulate this many CPU devices (0: off)")
    args = parser.parse_args(argv)

    try:
        shared = _overrides(args.set)
        values = [_value(v) for v in args.values.split(",") if v.strip()]
        # Every config is built and checked before the first run trains: a typo stops the sweep at once.
        configs = [api.load_config(args.config, {**shared, args.field: v}) for v in values]
        if args.cpu_devices:
            api.emulate_cpu_devices(args.cpu_devices)
        import jax

        for cfg in configs:
            api.check_config(cfg, jax.device_count())
    except moejax.InputError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2

    rows = []
    for value, cfg in zip(values, configs):
        workdir = Path(args.workdir) / f"{args.field}={value}"
        print(f"== {args.field}={value} -> {workdir}", flush=True)
        last = moejax.train(cfg, workdir)
        rows.append({"value": value, "workdir": str(workdir), **{k: last.get(k) for k in
                     ("step", "loss", "eval_loss", "tokens_per_s", "mfu")}})

    print(f"\n{args.field:>16s} {'step':>6s} {'loss':>8s} {'eval':>8s} {'tok/s':>10s} {'MFU %':>6s}")
    for r in rows:
        mfu = 100 * r["mfu"] if r["mfu"] is not None else None
        print(f"{str(r['value']):>16s} {_num(r['step'], 'd'):>6s} {_num(r['loss'], '.4f'):>8s} "
              f"{_num(r['eval_loss'], '.4f'):>8s} {_num(r['tokens_per_s'], '.0f'):>10s} {_num(mfu, '.1f'):>6s}")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (Path(args.workdir) / "sweep.json").write_text(json.dumps({"field": args.field, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
