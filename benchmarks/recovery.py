"""What losing a process costs: a 2-process x 4-CPU-device job under launch/local.py's supervisor, one process
SIGKILLed mid-run, once with the persistent tier alone and once with the local tier too. Measures the time from the
kill to the job training again (the first step logged after the restart), the steps lost (trained again), the
size of a persistent checkpoint and of one process's local step (own + peer copy), and their save times (persistent:
orbax's commit time less its start; local: what the training waited for, and the background write). Prints a
table, writes JSON.

    python benchmarks/recovery.py [--kill_at 17] [--persistent_every 10] [--local_every 2] \\
        [--json benchmarks/results/recovery.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cpu_env import cpu_env  # noqa: E402

ARGS = ["--config", str(ROOT / "configs/tiny.py"), "--config.train.log_every=1", "--config.train.eval_every=0",
        "--config.mesh.data=2", "--config.mesh.expert=4"]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(tmp: Path, name: str, steps: int, kill_at: int, persistent_every: int, local_every: int) -> dict:
    workdir, local = tmp / name, tmp / f"{name}-local"
    extra = [f"--config.train.steps={steps}", f"--config.checkpoint.every_steps={persistent_every}"]
    if local_every:
        extra += [f"--config.checkpoint.local_dir={local}", f"--config.checkpoint.local_every_steps={local_every}"]
    cmd = [sys.executable, str(ROOT / "launch/local.py"), "--num_processes", "2", "--devices_per_process", "4",
           "--max_restarts", "1", "--", *ARGS, *extra, "--workdir", str(workdir)]
    # no persistent compilation cache: a 2-process CPU job that loads its step from it hangs (jax 0.12.1)
    env = {k: v for k, v in cpu_env(4).items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids, killed_at, resumed, training_again = {}, None, None, None
    for line in proc.stdout:
        if m := re.match(r"\[launch\] process (\d): pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if killed_at is None and line.startswith(f"[p0] step {kill_at}/"):
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
        elif killed_at is not None and resumed is None and (m := re.search(r"resumed at step (\d+)", line)):
            resumed = int(m.group(1))
        elif resumed is not None and training_again is None and line.startswith("[p0] step "):
            training_again = time.monotonic() - killed_at
    if proc.wait() != 0:
        raise SystemExit(f"{name}: the supervised job failed ({proc.returncode})")
    persistent = sorted((p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    orbax_meta = json.loads((persistent[-1] / "_CHECKPOINT_METADATA").read_text())
    out = {"kill_at_step": kill_at, "resumed_at_step": resumed, "steps_lost": kill_at - resumed,
           "kill_to_training_s": round(training_again, 2),
           "persistent_checkpoint_mb": round(dir_bytes(persistent[-1]) / 1e6, 3),
           "persistent_save_s": round((orbax_meta["commit_timestamp_nsecs"] - orbax_meta["init_timestamp_nsecs"]) / 1e9,
                                      3)}
    if local_every:
        steps_dirs = sorted(local.glob("*/process_0/[0-9]*"), key=lambda p: int(p.name))
        index = json.loads((steps_dirs[-1] / "index.json").read_text())
        out.update(local_step_per_process_mb=round(dir_bytes(steps_dirs[-1]) / 1e6, 3),
                   local_save_blocking_s=index["timings"]["blocking_s"],
                   local_background_write_s=index["timings"]["background_write_s"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill_at", type=int, default=17)
    ap.add_argument("--persistent_every", type=int, default=10)
    ap.add_argument("--local_every", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/recovery.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {"persistent only": run(Path(tmp), "persistent", args.steps, args.kill_at, args.persistent_every, 0),
                "local tier": run(Path(tmp), "local", args.steps, args.kill_at, args.persistent_every,
                                  args.local_every)}
    keys = list(dict.fromkeys(k for row in rows.values() for k in row))
    print(f"| {'':40} | " + " | ".join(f"{name:>15}" for name in rows) + " |")
    print(f"| {'-' * 40} | " + " | ".join("-" * 15 for _ in rows) + " |")
    for key in keys:
        print(f"| {key:40} | " + " | ".join(f"{str(row.get(key, '')):>15}" for row in rows.values()) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
