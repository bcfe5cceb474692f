"""The CLI rejects every invalid mesh/config combination with exit code 2, one clear line, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_env import FAST_COMPILE, cpu_env

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, workdir):
    env = cpu_env(8)
    return subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
                           "--workdir", str(workdir), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


BAD = [
    (["--config.mesh.expert=3"], "devices do not divide"),
    (["--config.mesh.data=2", "--config.mesh.expert=2"], "multiply to 4"),
    (["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], "at most one axis may be -1"),
    (["--config.mesh.data=1", "--config.mesh.expert=8", "--config.moe.n_routed_experts=12"],
     "not divisible by the expert axis"),
    (["--config.train.global_batch=12"], "not divisible by the batch-parallel size"),
    (["--config.moe.top_k=20"], "exceeds moe.n_routed_experts"),
    (["--config.model.dtype=float8"], "model.dtype='float8' is not one of"),
    (["--config.mesh.tensor=0"], "must be positive"),
    (["--config.train.seq_len=8192"], "exceeds model.max_seq_len"),
    (["--config.no_such_field=1"], "the config has no field no_such_field"),
    (["--config.train.stepz=1"], "the config has no field train.stepz; did you mean train.steps?"),
    (["--config.model.dtype=float16"], "model.dtype='float16' needs loss scaling, which moejax does not do"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[b[1].split()[0] + str(i) for i, b in enumerate(BAD)])
def test_bad_config_exits_2_and_writes_nothing(args, message, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    keep = workdir / "config.json"
    keep.write_text("an earlier run's config\n")
    proc = run_cli(*args, workdir=workdir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "\\" not in proc.stderr, proc.stderr
    assert message in lines[0], lines[0]
    assert keep.read_text() == "an earlier run's config\n"
    assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]


def test_missing_config_file_exits_2(tmp_path):
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(tmp_path / "nope.py"),
                           "--workdir", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "nope.py" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_laptop_run_needs_no_xla_flags(tmp_path):
    """No accelerator and no device-count flag in XLA_FLAGS: the config's mesh is emulated in CPU devices, said in one line; the dry
    run picks its device count from the mesh too (data=-1 x expert=4 -> 8). Slow (32-34 s on 2 cores in CI's
    suite, the longest test not marked slow before: too near the 60 s budget on a slower machine): two CLI
    processes, each starting jax and compiling a step of its own shape."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = FAST_COMPILE  # no device-count flag: moejax adds it
    small = ["--config.train.steps=1", "--config.model.n_layers=2", "--config.train.global_batch=8",
             "--config.train.seq_len=32", "--config.data.max_bytes=1000000", "--config.train.eval_every=0"]
    proc = subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
                           "--workdir", str(tmp_path / "run"), *small], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no accelerator found: 8 CPU devices emulate the mesh" in proc.stdout
    assert "over 8 devices" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
                           "--dry_run", "--workdir", str(tmp_path / "dry"), *small], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on 8 emulated devices" in proc.stdout
