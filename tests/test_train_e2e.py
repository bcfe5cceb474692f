"""The CLI trains on the embedded corpus, writes every documented metric, checkpoints, and resumes."""

import json
import os
import subprocess
import sys
from pathlib import Path
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
            "aux_loss", "seq_aux_loss", "z_loss", "expert_imbalance", "expert_imbalance_per_layer",
            "dropped_fraction", "router_bias_norm"}
SMALL = ["--config.train.global_batch=8", "--config.train.seq_len=32", "--config.train.log_every=2",
         "--config.train.eval_every=3", "--config.train.eval_batches=2", "--config.checkpoint.every_steps=3",
         "--config.data.max_bytes=1000000", "--config.model.n_layers=2", "--config.mesh.data=2",
         "--config.mesh.expert=4"]


def train(workdir, steps, *extra):
    env = cpu_env(8)
    return subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
                           "--workdir", str(workdir), f"--config.train.steps={steps}", *SMALL, *extra],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
    workdir = tmp_path / "run"
    proc = train(workdir, 6, "--config.profile.start_step=1", "--config.profile.num_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    for r in records:
        assert REQUIRED <= r.keys(), REQUIRED - r.keys()
        assert r["mfu"] > 0 and r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0
        assert 0 <= r["dropped_fraction"] <= 1 and len(r["expert_imbalance_per_layer"]) == 1
    assert "eval_loss" in records[1] and "eval_loss" in records[3]
    assert len(records[-1]["tokens_per_expert"]) == 1  # the full matrix on the last step
    assert records[0]["loss"] > records[-1]["loss"]
    console = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert console[0].startswith("step 2/6 | loss ") and "TFLOP/s/dev | MFU " in console[0]
    assert json.loads((workdir / "config.json").read_text())["model"]["n_layers"] == 2
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    assert any((workdir / "tb").iterdir())
    assert list((workdir / "profile" / "process_0").rglob("*.xplane.pb")), "the profiler window wrote no trace"

    proc = train(workdir, 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed at step 6" in proc.stdout
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4, 6, 8]
    # The first run's config (steps=6) is kept beside the new one, not overwritten.
    assert json.loads((workdir / "config.1.json").read_text())["train"]["steps"] == 6
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 8


INJECT_FAILED_SAVE = """
import sys
import moejax.training.checkpoint as C
import moejax.training.metrics as M
waits, wait, close, writer_close = [], C.Checkpointer.wait, C.Checkpointer.close, M.MetricsWriter.close
def failing_wait(self):  # the second wait (the profiler's stop at the end) finds the last save failed
    waits.append(1)
    wait(self)
    if len(waits) == 2:
        raise OSError("disk full (injected)")
C.Checkpointer.wait = failing_wait
C.Checkpointer.close = lambda self: (print("checkpointer closed", flush=True), close(self))
M.MetricsWriter.close = lambda self: (print("writer closed", flush=True), writer_close(self))
from moejax.cli.train import main
sys.exit(main(sys.argv))
"""


def test_a_failed_save_seen_while_stopping_the_trace_still_closes_the_run(tmp_path):
    script = tmp_path / "inject.py"
    script.write_text(INJECT_FAILED_SAVE)
    proc = subprocess.run([sys.executable, str(script), "--config", str(ROOT / "configs/tiny.py"),
                           "--workdir", str(tmp_path / "run"), "--config.train.steps=4", *SMALL,
                           "--config.train.eval_every=0", "--config.profile.start_step=3",
                           "--config.profile.num_steps=10"],  # the window is still open when the run ends
                          capture_output=True, text=True, env=cpu_env(8), cwd=ROOT, timeout=600)
    assert proc.returncode == 1 and "OSError: disk full (injected)" in proc.stderr, proc.stderr[-3000:]
    assert "checkpointer closed" in proc.stdout and "writer closed" in proc.stdout
    assert list((tmp_path / "run" / "profile" / "process_0").rglob("*.xplane.pb")), "the trace was not written"
