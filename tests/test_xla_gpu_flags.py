"""moejax's XLA:GPU overlap flags are added to XLA_FLAGS where the user has not set them, never over a user's."""

from moejax.parallel.xla_gpu_flags import OVERLAP_FLAGS, add_overlap_flags, describe, user_set


def test_missing_overlap_flags_are_added_and_the_users_win():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_pipelined_all_gather=false"}
    in_effect = add_overlap_flags(env)
    flags = user_set(env["XLA_FLAGS"])
    assert flags["xla_force_host_platform_device_count"] == "8"
    assert flags["xla_gpu_enable_pipelined_all_gather"] == "false" == in_effect["xla_gpu_enable_pipelined_all_gather"]
    assert env["XLA_FLAGS"].count("xla_gpu_enable_pipelined_all_gather") == 1
    assert all(flags[name] == in_effect[name] for name in OVERLAP_FLAGS)
    assert add_overlap_flags(env) == in_effect and user_set(env["XLA_FLAGS"]) == flags  # idempotent
    assert add_overlap_flags({})["xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert "--xla_gpu_enable_pipelined_all_gather=false" in describe(in_effect)
