"""Weights & Biases (observability.wandb), in W&B's offline mode (nothing leaves the machine): the offline run
directory holds every logged record's metrics at its step, the eval loss and the expert-load image; a resumed run
continues the same W&B run id; only process 0 opens a run; asking for W&B without wandb installed, or for a mode
that does not exist, is bad input (one line, exit 2, before anything compiles)."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_env import cpu_env
from wandb_records import history_rows, read_records, run_ids

from moejax.config import ConfigError, default_config, validate
from moejax.training.wandb_logger import RUN_ID_FILE, check_wandb_installed, open_wandb_logger, wandb_run_id

# The training tests need wandb (the test extra installs it); the others check what happens without it.
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# configs/tiny.py shrunk (tests/test_evaluate.py's sizes): logged at 2, 3 (eval), 4 and 6 (eval, the last); the
# tokens-per-expert matrix kept at 3 and 6.
SMALL = ["--config.train.global_batch=8", "--config.train.seq_len=32", "--config.train.log_every=2",
         "--config.train.eval_every=3", "--config.train.eval_batches=1", "--config.train.expert_load_every=3",
         "--config.optim.warmup_steps=2", "--config.data.max_bytes=300000", "--config.model.n_layers=2",
         "--config.model.d_model=64", "--config.model.head_dim=16", "--config.model.d_ff=128",
         "--config.moe.d_ff_expert=32", "--config.hardware.peak_tflops=1",
         "--config.observability.wandb.mode=offline", "--config.observability.wandb.project=moejax-test"]


def wandb_env(home: Path) -> dict:
    """Offline, quiet W&B whose every directory (settings, cache, staging) lies under `home`: nothing is sent,
    nothing written outside the test's temporary directory."""
    return cpu_env(8, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off", WANDB_ERROR_REPORTING="false",
                   WANDB_X_DISABLE_STATS="true", WANDB_CONFIG_DIR=str(home / "config"),
                   WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))


def train(workdir: Path, steps: int, *extra, python_prelude: str = "") -> subprocess.CompletedProcess:
    script = f"{python_prelude}\nimport sys\nfrom moejax.cli.train import main\nsys.exit(main(sys.argv))"
    return subprocess.run([sys.executable, "-c", script, "--config", str(ROOT / "configs/tiny.py"), "--workdir",
                           str(workdir), f"--config.train.steps={steps}", *SMALL, *extra],
                          capture_output=True, text=True, env=wandb_env(workdir.parent), cwd=ROOT, timeout=300)


def offline_runs(workdir: Path) -> list[Path]:
    """The offline run directories wandb wrote under WORKDIR/wandb (observability.wandb.dir's default), oldest
    first (their names start with the time)."""
    return sorted((workdir / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 6-step run logged to an offline W&B run."""
    workdir = tmp_path_factory.mktemp("wandb") / "run"
    proc = train(workdir, STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


@needs_wandb
def test_the_offline_run_holds_every_logged_metric_at_its_step(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    [offline] = offline_runs(run)
    run_id = (run / RUN_ID_FILE).read_text().strip()
    wandb_file = offline / f"run-{run_id}.wandb"
    logged = read_records(wandb_file)
    assert run_ids(logged) == {run_id}
    rows = history_rows(logged)
    assert sorted(rows) == [2, 3, 4, 6]
    for record in records:
        row = rows[record["step"]]
        for key in ("loss", "lr", "grad_norm", "mfu", "tokens_per_s", "step_time_s", "tflops_per_device",
                    "expert_imbalance", "dropless_rounds"):
            assert row[key] == pytest.approx(record[key], rel=1e-12), (record["step"], key)
        scalars = {k for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        assert scalars <= row.keys(), scalars - row.keys()  # every scalar TensorBoard gets
        assert row["expert_imbalance/layer_0"] == pytest.approx(record["expert_imbalance_per_layer"][0])
    assert [s for s in rows if "eval_loss" in rows[s]] == [3, 6]
    assert rows[6]["eval_loss"] == pytest.approx(records[-1]["eval_loss"], rel=1e-12)
    assert [s for s in rows if "expert_load" in rows[s]] == [3, 6]
    image = rows[6]["expert_load"]
    assert image["_type"] == "image-file" and image["format"] == "png"
    assert (offline / "files" / image["path"]).is_file()


@needs_wandb
def test_a_resumed_run_continues_the_same_wandb_run(run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(run, workdir)  # the module's run stays as it was for the other tests
    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    proc = train(workdir, STEPS + 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed at step {STEPS}" in proc.stdout
    first, resumed = offline_runs(workdir)  # one offline directory per wandb.init; `wandb sync` joins them by id
    assert (workdir / RUN_ID_FILE).read_text().strip() == run_id
    logged = read_records(resumed / f"run-{run_id}.wandb")
    assert run_ids(logged) == {run_id}
    assert sorted(history_rows(logged)) == [STEPS + 2]


def test_a_run_from_step_0_starts_a_new_wandb_run(tmp_path):
    """No checkpoint to resume: an earlier id in WORKDIR is not reused (W&B would drop the new run's steps at or
    below the last one the old run holds); resuming reads it back (the loop resumes with the id: test above)."""
    (tmp_path / RUN_ID_FILE).write_text("oldrun00\n")
    run_id = wandb_run_id(tmp_path, resuming=False)
    assert run_id != "oldrun00" and len(run_id) == 8 and (tmp_path / RUN_ID_FILE).read_text().strip() == run_id
    assert wandb_run_id(tmp_path, resuming=True) == run_id


def test_only_process_0_opens_a_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would raise
    wandb_cfg = default_config().observability.wandb
    wandb_cfg.mode = "offline"
    for process_index in (1, 2, 7):
        assert open_wandb_logger(wandb_cfg, tmp_path, {}, start_step=0, process_index=process_index) is None
    wandb_cfg.mode = "disabled"
    assert open_wandb_logger(wandb_cfg, tmp_path, {}, start_step=0, process_index=0) is None
    assert not any(tmp_path.iterdir())  # no run id written, no wandb directory


def test_wandb_asked_for_without_wandb_installed_is_one_line_exit_2(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    proc = train(workdir, 2, python_prelude="import sys; sys.modules['wandb'] = None  # as if not installed")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("moejax-train: error: observability.wandb.mode='offline' needs wandb, which is not "
                                   "installed: pip install 'moejax[wandb]' (or observability.wandb.mode='disabled')")
    assert not workdir.exists()
    monkeypatch.setitem(sys.modules, "wandb", None)
    wandb_cfg = default_config().observability.wandb
    check_wandb_installed(wandb_cfg)  # disabled: wandb is not needed


def test_a_mode_that_does_not_exist_is_refused():
    cfg = default_config()
    cfg.observability.wandb.mode = "onlne"
    with pytest.raises(ConfigError, match=r"^observability.wandb.mode='onlne' is not one of 'disabled', 'online', "
                                          r"'offline'$"):
        validate(cfg, 8)
