"""The per-test time budget `.ci/run` enforces (`--budget SECONDS`), and the tests `make test` leaves to CI.

A test not marked `slow` whose wall time (setup, call and teardown: a compile in a session fixture counts against
the first test that asks for it) exceeds the budget fails the run with one line naming it. Slow tests are few,
marked `slow`, and say in their docstring why they need the time. They, and the two groups of pipelined steps and
FP8 training runs (`pipeline_step`, `fp8_training`: each test inside the budget, minutes together), run only when
asked (`--slow`: `make test SLOW=1`, which CI runs); `make test` leaves them out to stay a 10-minute command. Slow
and CI-only tests are collected first, so that two workers start the longest ones early. conftest.py registers
these hooks; with pytest-xdist the budget is checked in the controller, which receives every worker's reports."""

from __future__ import annotations

import collections

import pytest

SLOW = "slow"
CI_ONLY = (SLOW, "pipeline_step", "fp8_training")


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

    def pytest_runtest_logreport(self, report):
        self.wall[report.nodeid] += report.duration
        if SLOW in report.keywords:
            self.slow.add(report.nodeid)

    def pytest_sessionfinish(self, session):
        budget = self.config.getoption("--budget")
        if budget is None or hasattr(self.config, "workerinput"):  # xdist workers: the controller decides
            return
        self.offenders = over_budget(self.wall, self.slow, budget)
        if self.offenders:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.offenders:
            budget = self.config.getoption("--budget")
            terminalreporter.write_sep("=", "time budget", red=True)
            for nodeid, seconds in self.offenders:
                terminalreporter.write_line(f"over the time budget: {nodeid} took {seconds:.1f} s > {budget:.0f} s; "
                                            f"make it cheaper, or mark it slow with a docstring that says why it "
                                            f"needs the time")
