"""Guards: a NaN step is skipped and counted, too many in a row stop the run with the last checkpoint
intact, and the watchdog ends a run that stops making progress with every thread's stack."""

import json
import math
import subprocess
import sys

from tests.test_resume import ROOT, env, run


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_nan_steps_are_skipped_counted_and_too_many_in_a_row_stop_the_run(tmp_path):
    workdir = tmp_path / "run"
    # State steps 3 and 11-13 (logged as 4 and 12-14) get a NaN loss and gradient inside the jitted step.
    proc = run(workdir, "--config.train.steps=20", "--config.guards.inject_nan_steps=3,11,12,13",
               "--config.guards.max_bad_steps=3")
    assert proc.returncode == 3, proc.stderr[-3000:]
    by_step = {r["step"]: r for r in records(workdir)}
    assert sorted(by_step) == list(range(1, 15))
    assert [s for s in by_step if math.isnan(by_step[s]["loss"])] == [4, 12, 13, 14]
    assert [by_step[s]["skipped_steps"] for s in range(1, 15)] == [0] * 3 + [1] * 8 + [2, 3, 4]
    # One bad step is skipped and training goes on unpoisoned: the loss keeps falling.
    assert by_step[11]["loss"] < by_step[3]["loss"] < by_step[1]["loss"]
    assert "step 4: loss nan" in proc.stderr and "the update was skipped (1 in a row, 1 in this run)" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "3 consecutive steps (12-14) had a non-finite loss or gradient" in last, last
    assert "checkpoint step 10, which is intact" in last, last
    checkpoints = workdir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["10"]
    assert (checkpoints / "10" / "commit_success.txt").exists() and not list(checkpoints.glob("*tmp*"))


WATCHDOG = """
import sys, time
from moejax.training.watchdog import Watchdog
w = Watchdog(float(sys.argv[1]), poll_s=0.05).start()
for i in range(int(sys.argv[2])):  # a loop that beats every 0.1 s for a while...
    time.sleep(0.1)
    w.beat(f"step {i}")
time.sleep(float(sys.argv[3]))  # ...then hangs (or not)
w.stop()
print("finished")
"""


def test_watchdog_dumps_every_thread_and_exits_5_on_a_stall():
    proc = subprocess.run([sys.executable, "-c", WATCHDOG, "0.5", "10", "30"], env=env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
    assert "no step finished for" in proc.stderr and "last progress: step 9" in proc.stderr
    assert 'File "<string>", line 8 in <module>' in proc.stderr  # the main thread's stack, at the sleep
    assert "moejax-watchdog" in proc.stderr or "Thread 0x" in proc.stderr
    assert "finished" not in proc.stdout


def test_watchdog_stays_quiet_while_steps_finish():
    proc = subprocess.run([sys.executable, "-c", WATCHDOG, "0.5", "15", "0"], env=env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "finished", proc.stderr
