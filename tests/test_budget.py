"""The per-test time budget and the CI-only selection (tests/budget.py), on a throwaway test file run by pytest in a
subprocess: a test over the budget fails the run with one line naming it, a slow one does not, a machine slower than
the reference gets the budget scaled, and without `--slow` the CI-only tests skip."""

import subprocess
import sys
from pathlib import Path

from budget import REFERENCE_PROBE_S

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import time
import pytest

def test_quick():
    pass

def test_over_budget():
    time.sleep(1.5)

@pytest.mark.slow
def test_slow_and_says_why():
    """Slow: sleeps to stand for a long run."""
    time.sleep(1.5)

@pytest.mark.pipeline_step
def test_ci_only_group():
    pass
'''


def _pytest(tmp_path, *args, slowdown=1.0):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  pipeline_step: a group\n  fp8_training: a group\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "budget", "-p", "no:cacheprovider", "-q",
                           "test_sample.py", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin",
                               "MOEJAX_TEST_SPEED_PROBE_S": str(REFERENCE_PROBE_S * slowdown)})


def test_a_test_over_the_budget_fails_the_run_with_one_line_naming_it(tmp_path):
    r = _pytest(tmp_path, "--slow", "--budget", "1")
    assert r.returncode == 1, r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith("over the time budget")]
    assert len(lines) == 1 and "test_sample.py::test_over_budget took" in lines[0], r.stdout
    assert "4 passed" in r.stdout  # every test passed: the budget alone failed the run


def test_within_the_budget_and_without_slow_the_ci_only_tests_skip(tmp_path):
    r = _pytest(tmp_path, "--budget", "5")
    assert r.returncode == 0, r.stdout
    assert "2 passed, 2 skipped" in r.stdout and "over the time budget" not in r.stdout, r.stdout


def test_a_slower_machine_gets_the_budget_scaled_by_its_speed(tmp_path):
    """The speed probe took twice the reference machine's time: the 1 s budget is 2 s there, and the 1.5 s test
    passes it."""
    r = _pytest(tmp_path, "--slow", "--budget", "1", slowdown=2.0)
    assert r.returncode == 0 and "over the time budget" not in r.stdout, r.stdout
    assert "budget 1 s of the reference machine's = 2 s here" in r.stdout, r.stdout
