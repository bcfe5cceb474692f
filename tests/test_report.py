"""moejax-report: plots and summary from metrics.jsonl; bad input exits 2 with one line."""

import json

import numpy as np
import pytest

from moejax.cli.report import main as report_main
from moejax.report import read_metrics


def fake_run(workdir, steps=(10, 20, 30, 40), truncated_tail=False):
    workdir.mkdir()
    rng = np.random.default_rng(0)
    lines = []
    for i, s in enumerate(steps):
        r = {"step": s, "loss": 5.0 - i, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.5 + 0.1 * i,
             "tokens_per_s": 1000.0, "tflops_per_device": 0.01, "mfu": 0.2, "expert_imbalance": 2.0 - 0.2 * i,
             "dropped_fraction": 0.1, "tokens_per_expert": rng.integers(1, 50, (3, 8)).tolist()}
        if s % 20 == 0:
            r["eval_loss"] = 5.1 - i
        lines.append(json.dumps(r))
    text = "\n".join(lines) + "\n" + ('{"step": 50, "lo' if truncated_tail else "")
    (workdir / "metrics.jsonl").write_text(text)


def test_report_writes_pngs_and_summary(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run(run, truncated_tail=True)
    assert report_main([str(run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 40 and summary["loss_last"] == 2.0 and summary["eval_loss_last"] == pytest.approx(2.1)
    assert summary["step_time_s_median"] == pytest.approx(0.7)  # the first window (warm-up) is left out
    for name in ("loss.png", "throughput.png", "expert_load.png", "dropped.png"):
        assert (run / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (run / "report" / "report.md").read_text()
    assert "| loss_last | 2 |" in md and "![expert_load](expert_load.png)" in md


def test_resumed_run_keeps_latest_record_per_step(tmp_path):
    run = tmp_path / "run"
    fake_run(run, steps=(10, 20, 10, 20, 30))
    records = read_metrics(run)
    assert [r["step"] for r in records] == [10, 20, 30] and records[0]["loss"] == 3.0


def test_bad_input_exits_2(tmp_path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert report_main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl:2 is not JSON" in err[0]
