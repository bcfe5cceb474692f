"""The per-test time budget `.ci/run` enforces (`--budget SECONDS`), and the tests `make test` leaves to CI.

A test not marked `slow` whose wall time (setup, call and teardown: a compile in a session fixture counts against
the first test that asks for it) exceeds the budget fails the run with one line naming it. Slow tests are few,
marked `slow`, and say in their docstring why they need the time. They, and the two groups of pipelined steps and
FP8 training runs (`pipeline_step`, `fp8_training`: each test inside the budget, minutes together), run only when
asked (`--slow`: `make test SLOW=1`, which CI runs); `make test` leaves them out to stay a 10-minute command. Slow
and CI-only tests are collected first, so that two workers start the longest ones early. conftest.py registers
these hooks; with pytest-xdist the budget is checked in the controller, which receives every worker's reports.

The budget is in seconds of the reference machine (2 cores, idle): the controller times a fixed workload at the
session's start and end, and a machine that ran it slower (CI's, or this one when shared) gets the budget scaled by
the ratio (never below the budget itself); the summary prints both."""

from __future__ import annotations

import collections
import os
import time

import pytest

SLOW = "slow"
CI_ONLY = (SLOW, "pipeline_step", "fp8_training")
# The reference machine's time for speed_probe_s's workload (2 cores, nothing else running, 2026-12-07: 0.123-0.128 s
# in three processes). CI's machine is slower and noisier, and this one runs at half speed at times: the budget is
# in the reference machine's seconds, scaled by how much slower the machine running the suite is.
REFERENCE_PROBE_S = 0.125


def speed_probe_s() -> float:
    """The best of three timings of a fixed single-threaded workload (interpreter and memory bound, like most of the
    suite's tracing and compiling); MOEJAX_TEST_SPEED_PROBE_S stands in for it (tests/test_budget.py)."""
    if os.environ.get("MOEJAX_TEST_SPEED_PROBE_S"):
        return float(os.environ["MOEJAX_TEST_SPEED_PROBE_S"])
    best = float("inf")
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(2_000_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - start)
    return best


def slowdown(probes: list[float]) -> float:
    """How much slower than the reference machine this one ran (the mean of its probes), never below 1."""
    return max(1.0, sum(probes) / len(probes) / REFERENCE_PROBE_S)


def pytest_addoption(parser):
    group = parser.getgroup("moejax")
    group.addoption("--budget", type=float, default=None, metavar="SECONDS",
                    help="fail the run when a test not marked slow takes longer than SECONDS of wall time")
    group.addoption("--slow", action="store_true", default=False,
                    help="also run the CI-only tests: marked slow, pipeline_step or fp8_training")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{SLOW}: needs more than the per-test budget; its docstring says why")
    config.pluginmanager.register(Budget(config), "moejax-budget")


def _ci_only(item) -> bool:
    return any(item.get_closest_marker(name) for name in CI_ONLY)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(reason="CI-only (slow, pipeline_step or fp8_training): runs with --slow, make test SLOW=1")
        for item in items:
            if _ci_only(item):
                item.add_marker(skip)
        return
    items.sort(key=lambda item: (not item.get_closest_marker(SLOW), not _ci_only(item)))  # stable: collection order within each group


def over_budget(wall: dict, slow: set, budget: float) -> list[tuple[str, float]]:
    """(nodeid, seconds) of every test not marked slow that took longer than `budget`, slowest first."""
    return sorted(((n, s) for n, s in wall.items() if s > budget and n not in slow), key=lambda t: -t[1])


class Budget:
    def __init__(self, config):
        self.config = config
        self.wall = collections.defaultdict(float)  # nodeid -> seconds (setup + call + teardown)
        self.slow = set()
        self.offenders: list[tuple[str, float]] = []  # set by pytest_sessionfinish when --budget is given
        self.probes: list[float] = []  # speed_probe_s at the start and the end of the session (the controller's)
        self.scaled_budget = None

    def _deciding(self) -> bool:
        """--budget given, and this is the process that decides (with xdist: the controller, not a worker)."""
        return self.config.getoption("--budget") is not None and not hasattr(self.config, "workerinput")

    def pytest_sessionstart(self, session):
        if self._deciding():
            self.probes.append(speed_probe_s())

    def pytest_runtest_logreport(self, report):
        self.wall[report.nodeid] += report.duration
        if SLOW in report.keywords:
            self.slow.add(report.nodeid)

    def pytest_sessionfinish(self, session):
        if not self._deciding():  # xdist workers: the controller decides
            return
        self.probes.append(speed_probe_s())
        self.scaled_budget = self.config.getoption("--budget") * slowdown(self.probes)
        self.offenders = over_budget(self.wall, self.slow, self.scaled_budget)
        if self.offenders:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    # trylast: after the slowest-tests list, next to the short summary, so that a log's tail shows why a run that
    # passed every test failed
    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if self.scaled_budget is None:  # no --budget, or an xdist worker (pytest_sessionfinish sets it otherwise)
            return
        budget, scaled = self.config.getoption("--budget"), self.scaled_budget
        terminalreporter.write_sep("=", "time budget", red=bool(self.offenders))
        terminalreporter.write_line(
            f"budget {budget:.0f} s of the reference machine's = {scaled:.0f} s here (a fixed workload took "
            + " / ".join(f"{p:.3f}" for p in self.probes) + f" s at the session's start / end, "
            f"{REFERENCE_PROBE_S:.3f} s there)")
        for nodeid, seconds in self.offenders:
            terminalreporter.write_line(f"over the time budget: {nodeid} took {seconds:.1f} s > {scaled:.0f} s; "
                                        f"make it cheaper, or mark it slow with a docstring that says why it "
                                        f"needs the time")
        # The durations list above counts setup and call apart; the budget counts them together. CI's machine is
        # noisier than a developer's: the tests nearest the budget here are the next to fail there.
        nearest = sorted(((s, n) for n, s in self.wall.items() if n not in self.slow and s <= scaled), reverse=True)[:5]
        terminalreporter.write_line("nearest the budget (setup + call + teardown): " + "; ".join(
            f"{n} {s:.1f} s" for s, n in nearest))
