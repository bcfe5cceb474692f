"""Weights & Biases: process 0 logs every metrics.jsonl record to one W&B run (`observability.wandb`).

The record's scalars go under their metrics.jsonl names at the record's step (what TensorBoard gets too), the
per-layer expert imbalance as `expert_imbalance/layer_N`, and the tokens-per-expert matrix, on the steps that
keep it, as an `expert_load` heatmap image. A run that resumes from a checkpoint continues the W&B run whose id
WORKDIR/wandb_run_id holds; a run that starts at step 0 starts a new W&B run (W&B ignores a step at or below the
last one a run holds, so a restarted run's first steps would be lost in the old one).

wandb is an optional dependency (the `wandb` extra): it is imported only when a run logs to W&B, and
`check_wandb_installed` refuses a config that asks for it where it is missing, before anything compiles.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import string
from pathlib import Path

from moejax.config import ConfigError
from moejax.training.expert_load_image import expert_load_image

RUN_ID_FILE = "wandb_run_id"
WANDB_EXTRA = "pip install 'moejax[wandb]'"


def check_wandb_installed(wandb_cfg) -> None:
    """ConfigError (one line) when observability.wandb asks for W&B and wandb is not installed."""
    if wandb_cfg.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"observability.wandb.mode={wandb_cfg.mode!r} needs wandb, which is not installed: "
                          f"{WANDB_EXTRA} (or observability.wandb.mode='disabled')")


def wandb_run_id(workdir: Path, *, resuming: bool) -> str:
    """The W&B run id of this run: WORKDIR/wandb_run_id's when resuming a checkpoint, else a new one, written there."""
    path = Path(workdir) / RUN_ID_FILE
    if resuming and path.is_file() and (saved := path.read_text().strip()):
        return saved
    # W&B's own id alphabet (wandb.sdk.lib.runid): 8 of [a-z0-9]
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.write_text(run_id + "\n")
    return run_id


def open_wandb_logger(wandb_cfg, workdir: Path, config: dict, *, start_step: int,
                      process_index: int) -> WandbLogger | None:
    """Process 0's W&B logger for the run in `workdir` resuming at `start_step` (0: a new run); None on every other
    process (one process logs, as with metrics.jsonl) and when observability.wandb.mode is disabled."""
    if process_index != 0 or wandb_cfg.mode == "disabled":
        return None
    import wandb

    workdir = Path(workdir)
    run_dir = Path(wandb_cfg.dir or os.environ.get("WANDB_DIR") or workdir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tags = [t.strip() for t in wandb_cfg.tags.split(",") if t.strip()]
    run = wandb.init(
        project=wandb_cfg.project, entity=wandb_cfg.entity or None, name=wandb_cfg.name or workdir.name,
        group=wandb_cfg.group or None, tags=tags or None, job_type="train", mode=wandb_cfg.mode,
        dir=str(run_dir), config=config,
        id=wandb_run_id(workdir, resuming=start_step > 0), resume="allow",
        # A library's run: leave any run the caller has open (and the global wandb.run) alone.
        reinit="create_new")
    return WandbLogger(run, wandb.Image)


class WandbLogger:
    """One W&B run: `log` writes a metrics.jsonl record, `close` finishes the run."""

    def __init__(self, run, image_type):
        self.run = run
        self._image = image_type  # wandb.Image

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, record: dict) -> None:
        step = record["step"]
        data = {}
        for key, value in record.items():
            if key == "expert_imbalance_per_layer":
                data.update({f"expert_imbalance/layer_{layer}": x for layer, x in enumerate(value)})
            elif key == "tokens_per_expert":
                data["expert_load"] = self._image(expert_load_image(value, step),
                                                  caption=f"step {step}: tokens per expert / mean, per MoE layer")
            elif key != "step" and isinstance(value, (int, float)):
                data[key] = value
        self.run.log(data, step=step)

    def close(self, *, failed: bool = False) -> None:
        """Finishes the run: W&B marks it failed when the training run ended with an error (or a stop signal)."""
        self.run.finish(exit_code=1 if failed else 0)
