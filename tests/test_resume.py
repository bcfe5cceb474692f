"""Exact resume: a run killed (SIGKILL) or preempted (SIGTERM) at a random step and resumed has per-step
losses bitwise identical to the run that never stopped (CPU, f32); a checkpoint restored onto another
mesh and device count continues it to 1e-6 relative. Broken or incompatible checkpoints exit 2 untouched."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30
SMALL = ["--config", str(ROOT / "configs/tiny.py"), "--config.train.global_batch=8", "--config.train.seq_len=32",
         "--config.train.log_every=1", "--config.train.eval_every=0", "--config.data.max_bytes=1000000",
         "--config.model.n_layers=2", "--config.model.d_model=64", "--config.model.head_dim=16",
         "--config.model.d_ff=128", "--config.moe.d_ff_expert=32", "--config.moe.capacity_factor=0",
         "--config.checkpoint.every_steps=10", "--config.checkpoint.keep=10", f"--config.train.steps={STEPS}",
         "--config.hardware.peak_tflops=1"]
# Runs of one config share compiled executables through JAX's persistent cache (a compile is most of a short
# run's time); the SIGKILL test's resumed run compiles afresh, so bitwise equality also covers a recompile.
XLA_CACHE = Path(tempfile.gettempdir()) / "moejax-test-xla-cache"
RNG = random.Random(int(os.environ.get("MOEJAX_TEST_SEED", time.time_ns() % 1000)))


def command(workdir, *extra):
    return [sys.executable, "-m", "moejax.train", *SMALL, "--workdir", str(workdir), *extra]


def env(devices=8, cache=True):
    e = cpu_env(devices)
    if cache:
        e.update(JAX_COMPILATION_CACHE_DIR=str(XLA_CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return e


def run(workdir, *extra, devices=8, cache=True):
    return subprocess.run(command(workdir, *extra), env=env(devices, cache), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def records(workdir):
    """Every metrics record in file order (a resumed run appends the steps it redoes)."""
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(workdir):
    return {r["step"]: r["loss"] for r in records(workdir)}


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight") / "run"
    proc = run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
    return workdir


def interrupt_at_random_step(workdir, sig, earliest, cache=True):
    """Starts the run, waits until it logged a random step >= earliest with checkpoint 10 complete, sends sig."""
    target = RNG.randint(earliest, STEPS - 4)
    proc = subprocess.Popen(command(workdir), env=env(cache=cache), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics, done = workdir / "metrics.jsonl", workdir / "checkpoints" / "10" / "commit_success.txt"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and done.exists():
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip()]
            if steps and steps[-1] >= target:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.communicate()[1][-2000:]
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return target, proc.returncode, out, err


def test_sigkill_then_resume_is_bitwise_identical(straight, tmp_path):
    workdir = tmp_path / "run"
    target, rc, _, _ = interrupt_at_random_step(workdir, signal.SIGKILL, earliest=11)
    assert rc == -signal.SIGKILL
    before = losses(workdir)
    assert max(before) >= target
    proc = run(workdir, cache=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed_at = int(proc.stdout.split("resumed at step ")[1].split()[0])
    assert resumed_at % 10 == 0 and resumed_at <= max(before), (resumed_at, max(before))
    want = losses(straight)
    for r in records(workdir):  # the killed run's steps and the resumed run's, redone ones included
        assert r["loss"] == want[r["step"]], (r["step"], r["loss"], want[r["step"]], f"killed at {target}")
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))


def test_sigterm_saves_then_resume_is_bitwise_identical(straight, tmp_path):
    workdir = tmp_path / "run"
    target, rc, _, err = interrupt_at_random_step(workdir, signal.SIGTERM, earliest=11)
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    saved = int(err.split("saved a checkpoint at step ")[1].split()[0])
    assert saved >= target and (workdir / "checkpoints" / str(saved)).is_dir()
    assert max(losses(workdir)) == saved  # it stopped right after the step in flight
    proc = run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed at step {saved}" in proc.stdout
    want = losses(straight)
    for r in records(workdir):
        assert r["loss"] == want[r["step"]], (r["step"], r["loss"], want[r["step"]], f"stopped at {saved}")


def test_restore_onto_another_mesh_and_device_count(straight, tmp_path):
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "10", workdir / "checkpoints" / "10")
    # 8 devices as data=2 x expert=4 -> 4 devices as fsdp=2 x expert=2: every array is resharded.
    proc = run(workdir, "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.expert=2", devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed at step 10" in proc.stdout
    want, got = losses(straight), losses(workdir)
    assert sorted(got) == list(range(11, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-6 * abs(want[step]), (step, loss, want[step])


def test_incompatible_workdir_and_broken_checkpoint_exit_2_untouched(straight, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    before = tree_digest(workdir)
    for extra, message in ((["--config.model.d_model=128"], "model.d_model=64 there, 128 here"),
                           (["--config.seed=1"], "seed=0 there, 1 here")):
        proc = run(workdir, *extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "incompatible run" in lines[0], proc.stderr[-2000:]
        assert message in lines[0], lines[0]
        assert tree_digest(workdir) == before

    # A truncated checkpoint: the latest step lost its array data (refused as asked; falling back, the default, is
    # tests/test_checkpoint_integrity.py's).
    shutil.rmtree(workdir / "checkpoints" / "30" / "state" / "d")
    before = tree_digest(workdir)
    proc = run(workdir, f"--config.train.steps={STEPS + 5}", "--config.checkpoint.on_bad_checkpoint=refuse")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "checkpoints/30 is incomplete or corrupt" in lines[0] and "resume from step 20" in lines[0], lines[0]
    assert tree_digest(workdir) == before


def test_resume_takes_the_changes_deepseek_v3_makes_mid_run(straight, tmp_path):
    """moejax/config/changes.py in use: resuming at step 20 with the MTP weight lowered, the bias update rate
    set to 0 and a re-annealed learning rate runs, records the new values, and the bias stops moving."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    shutil.copytree(straight / "checkpoints" / "20", workdir / "checkpoints" / "20")
    proc = run(workdir, "--config.model.mtp_loss_weight=0.1", "--config.moe.bias_update_rate=0.0",
               "--config.optim.lr=1e-4", "--config.optim.warmup_steps=0", "--config.train.steps=24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed at step 20" in proc.stdout
    saved = json.loads((workdir / "config.json").read_text())
    assert (saved["model"]["mtp_loss_weight"], saved["moe"]["bias_update_rate"], saved["optim"]["lr"]) == (0.1, 0.0, 1e-4)
    got = records(workdir)
    assert [r["step"] for r in got] == [21, 22, 23, 24]
    assert len({r["router_bias_norm"] for r in got}) == 1  # rate 0: the bias no longer moves
    assert all(r["lr"] <= 1e-4 for r in got)


def test_context_extension_starts_from_a_training_checkpoint(straight, tmp_path):
    """checkpoint.init_from=WORKDIR/checkpoints/STEP with YaRN switched on and a longer sequence (what
    configs/deepseek_v3_671b_context.py does after pre-training): step 0 holds the trained weights, so the
    first loss is the trained model's, far below a random model's ln(264) = 5.58; a model field that context
    extension does not change is refused with exit 2, naming it."""
    trained = straight / "checkpoints" / "30"
    extend = ["--config.model.rope_scaling=yarn", "--config.model.yarn.factor=2.0",
              "--config.model.yarn.original_max_position=32", "--config.train.seq_len=64",
              "--config.train.steps=2", f"--config.checkpoint.init_from={trained}"]
    proc = run(tmp_path / "ctx", *extend, cache=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed" not in proc.stdout
    first = records(tmp_path / "ctx")[0]
    assert first["step"] == 1 and first["loss"] < 0.8 * losses(straight)[1], (first["loss"], losses(straight)[1])
    proc = run(tmp_path / "bad", *extend, "--config.model.n_kv_heads=2", cache=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "model.n_kv_heads is 0 in the weights, 2 in the config" in proc.stderr
    assert not (tmp_path / "bad" / "config.json").exists()
