"""Deviceless GPU targets' host layout: XLA's topology string and the NVLink domain a job uses (no compile)."""

import pytest

from moejax.config import ConfigError
from moejax.planner.gpu_targets import get_target


@pytest.mark.parametrize("name,n,topology,domain", [
    ("gb300", 8, "1x2x4", 8),
    ("gb300", 64, "1x16x4", 64),
    ("gb300", 72, "1x18x4", 72),
    ("gb300", 144, "2x18x4", 72),
    # the record's 256 GB300s: 64 of each rack's 72 (16 of its 18 trays), four racks
    ("gb300", 256, "4x16x4", 64),
    ("h200", 8, "1x1x8", 8),
    ("h200", 64, "8x1x8", 8),
])
def test_a_job_uses_the_same_hosts_of_every_domain(name, n, topology, domain):
    target = get_target(name)
    assert target.topology_string(n) == topology
    assert target.used_domain_size(n) == domain


def test_devices_that_do_not_fill_hosts_are_refused():
    with pytest.raises(ConfigError, match="do not fill hosts of 4"):
        get_target("gb300").topology_string(10)
