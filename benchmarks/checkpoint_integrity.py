"""What a checkpoint's integrity manifest costs: trains configs/tiny.py for a few steps (one checkpoint, emulated CPU
devices), then times writing the manifest (what process 0 adds to each save's background finalisation) and verifying
it (what a resume adds before it restores); a whole save (start to committed) of arrays of the checkpoint's size,
with the manifest and without; and CRC32's throughput on this machine, one thread and the manifest's threads, to
extrapolate to a larger checkpoint. Prints a table, writes JSON.

    python benchmarks/checkpoint_integrity.py [--steps 10] [--json benchmarks/results/checkpoint_integrity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moejax.training.checkpoint import ITEMS, orbax_manager  # noqa: E402
from moejax.training.checkpoint_integrity import CRC_THREADS, verify, write_manifest  # noqa: E402


def crc32_gb_per_s(threads: int, total_mb: int = 1024, block_mb: int = 16) -> float:
    """GB/s of zlib.crc32 over total_mb of in-memory 16 MiB blocks (what crc32_file does once the bytes are read)."""
    block = os.urandom(block_mb << 20)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: zlib.crc32(block), range(total_mb // block_mb)))
    return total_mb * (1 << 20) / (time.perf_counter() - start) / 1e9


def save_seconds(directory: Path, n_bytes: int, with_manifest: bool, repeats: int = 3) -> float:
    """Best time of a save (Checkpointer.save to committed) of float32 arrays totalling n_bytes."""
    import jax.numpy as jnp
    import ml_collections

    from moejax.training.checkpoint import Checkpointer

    state = {f"w{i}": jnp.ones((n_bytes // 4 // 16,), jnp.float32) * i for i in range(16)}
    cfg = ml_collections.ConfigDict(dict(keep=1, keep_every_steps=0))
    checkpointer = Checkpointer(directory, cfg)
    if not with_manifest:
        checkpointer._manager.close()  # the same manager without the manifest callback
        checkpointer._manager = orbax_manager(directory, cfg)
    times = []
    for step in range(1, repeats + 1):
        start = time.perf_counter()
        checkpointer.save(step, state, meta={"step": step}, config_json="{}")
        checkpointer.wait()
        times.append(time.perf_counter() - start)
    checkpointer.close()
    return min(times)


def best_of(n: int, f) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
                        f"--config.train.steps={args.steps}", "--config.train.eval_every=0", "--workdir",
                        str(workdir)], cwd=ROOT, check=True, capture_output=True)
        step_dir = workdir / "checkpoints" / str(args.steps)
        files = [p for item in ITEMS for p in (step_dir / item).rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        write_s = best_of(3, lambda: write_manifest(step_dir, ITEMS))
        verify_s = best_of(3, lambda: verify(step_dir))
        assert verify(step_dir).verified
        save_with = save_seconds(Path(tmp) / "with", size, with_manifest=True)
        save_without = save_seconds(Path(tmp) / "without", size, with_manifest=False)
    one, many = crc32_gb_per_s(1), crc32_gb_per_s(CRC_THREADS)
    result = {"checkpoint_bytes": size, "files": len(files), "write_manifest_s": write_s, "verify_s": verify_s,
              "save_s_with_manifest": save_with, "save_s_without_manifest": save_without,
              "checkpoint_mb_per_s_verified": size / verify_s / 1e6, "crc32_gb_per_s_1_thread": one,
              f"crc32_gb_per_s_{CRC_THREADS}_threads": many, "cpu_count": os.cpu_count()}
    for key, value in result.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
