"""A run at a glance from WORKDIR/metrics.jsonl: PNG plots and a markdown summary.

Plots: loss and eval loss; tokens/s and MFU; expert load (tokens per expert / mean) per MoE layer over
steps, from the records that carry the full `tokens_per_expert` matrix; dropped fraction and imbalance.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np


class ReportError(ValueError):
    pass


def read_metrics(workdir: Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist; is {workdir} a moejax-train workdir?")
    records = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # a run killed mid-write leaves a truncated last line; the rest is good
            raise ReportError(f"{path}:{i + 1} is not JSON") from None
    if not records:
        raise ReportError(f"{path} holds no records yet")
    # A resumed run may re-log steps: keep the latest record of each step.
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def summarize(records: list[dict]) -> dict:
    last = records[-1]
    timed = records[1:] or records  # the first window holds warm-up effects
    evals = [r for r in records if "eval_loss" in r]
    out = {
        "steps": last["step"], "loss_first": records[0]["loss"], "loss_last": last["loss"],
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "step_time_s_median": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops_per_device_median": statistics.median(r["tflops_per_device"] for r in timed),
        "mfu_median": statistics.median(r["mfu"] for r in timed),
    }
    if "expert_imbalance" in last:
        out.update(expert_imbalance_last=last["expert_imbalance"], dropped_fraction_last=last["dropped_fraction"])
    return out


def _plot_loss(plt, records, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set(xlabel="step", ylabel="nats / token", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_throughput(plt, records, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["tokens_per_s"] for r in records], color="tab:blue")
    ax.set(xlabel="step", ylabel="tokens / s", title="throughput and MFU")
    ax.tick_params(axis="y", labelcolor="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r["mfu"] for r in records], color="tab:orange")
    ax2.set_ylabel("MFU %", color="tab:orange")
    ax2.tick_params(axis="y", labelcolor="tab:orange")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_expert_load(plt, records, path) -> bool:
    loads = [r for r in records if "tokens_per_expert" in r]
    if not loads:
        return False
    stack_SxLxE = np.asarray([r["tokens_per_expert"] for r in loads], dtype=np.float64)
    rel = stack_SxLxE / np.maximum(stack_SxLxE.mean(axis=-1, keepdims=True), 1e-9)
    n_layers = rel.shape[1]
    cols = min(4, n_layers)
    rows = math.ceil(n_layers / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1.2, 3.0 * rows), squeeze=False,
                             layout="constrained")
    steps = [r["step"] for r in loads]
    x_end = steps[-1] if len(steps) > 1 else steps[0] + 1  # one record still gets a visible column
    vmax = max(2.0, float(rel.max()))
    for layer in range(rows * cols):
        ax = axes[layer // cols][layer % cols]
        if layer >= n_layers:
            ax.axis("off")
            continue
        im = ax.imshow(rel[:, layer, :].T, aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=vmax,
                       extent=(steps[0], x_end, -0.5, rel.shape[2] - 0.5), interpolation="nearest")
        ax.set(title=f"MoE layer {layer}", xlabel="step", ylabel="expert" if layer % cols == 0 else None)
        ax.yaxis.get_major_locator().set_params(integer=True)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="tokens / mean tokens")
    fig.suptitle("expert load")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_dropped(plt, records, path) -> bool:
    if "dropped_fraction" not in records[-1]:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [100 * r["dropped_fraction"] for r in records], color="tab:red", label="dropped %")
    ax.set(xlabel="step", ylabel="dropped assignments %", title="capacity drops and load imbalance")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["expert_imbalance"] for r in records], color="tab:gray", label="max/mean load")
    ax2.set_ylabel("max / mean tokens per expert")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(workdir: Path, out_dir: Path | None = None) -> dict:
    """Writes the PNGs and report.md into out_dir (default WORKDIR/report); returns the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(workdir)
    out_dir = Path(out_dir or Path(workdir) / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = ["loss.png", "throughput.png"]
    _plot_loss(plt, records, out_dir / "loss.png")
    _plot_throughput(plt, records, out_dir / "throughput.png")
    if _plot_expert_load(plt, records, out_dir / "expert_load.png"):
        pngs.append("expert_load.png")
    if _plot_dropped(plt, records, out_dir / "dropped.png"):
        pngs.append("dropped.png")
    summary = summarize(records)
    lines = [f"# moejax run: {Path(workdir).name}", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items()]
    lines += [""] + [f"![{p[:-4]}]({p})" for p in pngs]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return {**summary, "files": [str(out_dir / p) for p in pngs + ["report.md"]]}
