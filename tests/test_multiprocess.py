"""Multi-process runs behave like the single-process run they were tested as, and fail fast when broken."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(ROOT / "configs/tiny.py"), "--config.train.global_batch=8", "--config.train.seq_len=32",
         "--config.train.log_every=1", "--config.train.eval_every=0", "--config.data.max_bytes=1000000",
         "--config.model.n_layers=2", "--config.mesh.data=2", "--config.mesh.expert=4",
         "--config.checkpoint.every_steps=5"]


def env(devices):
    return cpu_env(devices)


def losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def single_process(workdir, steps):
    return subprocess.run([sys.executable, "-m", "moejax.train", *SMALL, "--workdir", str(workdir),
                           f"--config.train.steps={steps}"], env=env(8), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process_and_checkpoint_moves_between_them(tmp_path):
    """Two processes x 4 devices train as one process x 8 does, and a checkpoint moves between the two. Slow (about
    85 s on 2 cores): three launches, each process starting jax's coordination service and compiling the step on
    one of the machine's two cores beside the other."""
    two = tmp_path / "two"
    proc = subprocess.run([sys.executable, str(ROOT / "launch/local.py"), "--num_processes", "2",
                           "--devices_per_process", "4", "--", *SMALL, "--workdir", str(two),
                           "--config.train.steps=10"], env=env(4), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[p0] step 10/10" in proc.stdout and "[p1] step" not in proc.stdout  # process 0 logs alone
    one = tmp_path / "one"
    ref = single_process(one, 12)
    assert ref.returncode == 0, ref.stderr[-3000:]
    two_losses, one_losses = losses(two), losses(one)
    assert sorted(two_losses) == list(range(1, 11))
    for step, loss in two_losses.items():
        assert abs(loss - one_losses[step]) <= 1e-6 * abs(one_losses[step]), (step, loss, one_losses[step])

    # The 2-process checkpoint (step 10) restores in a 1-process run, which continues the same run.
    resumed = single_process(two, 12)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 10" in resumed.stdout
    after = losses(two)
    for step in (11, 12):
        assert abs(after[step] - one_losses[step]) <= 1e-6 * abs(one_losses[step]), (step, after[step], one_losses[step])


def test_unreachable_coordinator_fails_fast_with_a_clear_message(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moejax.train", *SMALL, "--workdir", str(tmp_path / "run"),
                           "--coordinator", f"127.0.0.1:{free_port()}", "--num_processes", "2",
                           "--process_id", "1", "--init_timeout", "5"], env=env(4), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "could not join the job at 127.0.0.1:" in proc.stderr.strip().splitlines()[-1]
    assert time.monotonic() - start < 90
    assert not (tmp_path / "run").exists()


def test_processes_with_different_configs_stop_with_the_difference(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "moejax.train", *SMALL, "--workdir", str(tmp_path / "run"),
                               f"--config.train.steps={steps}", "--coordinator", f"127.0.0.1:{port}",
                               "--num_processes", "2", "--process_id", str(i), "--init_timeout", "60"],
                              env=env(4), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, steps in enumerate((10, 12))]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert "config differs" in last and "train.steps" in last, last
    assert not (tmp_path / "run").exists()
