"""moejax's XLA:GPU overlap flags are added to XLA_FLAGS where the user has not set them, never over a user's; the
scheduler's memory budget is XLA's own."""

import pytest

from moejax.parallel.xla_gpu_flags import (OVERLAP_FLAGS, add_overlap_flags, describe, scheduler_memory_limit,
                                           scheduler_memory_note, scheduler_slop_for, slop_percent, user_set)


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


def test_scheduler_budget_is_xlas():
    """DeepSeek-V3 671B, the record's layout compiled for 256 GB300s without a device (benchmarks/RESULTS.md): XLA
    logged its rematerialisation target (budget + arguments) as 224,635,032,773 bytes at the default slop and
    285,738,126,565 with --xla_gpu_memory_limit_slop_factor=148; arguments (outputs aliased) 115,111,143,788 and
    temporaries 168,653,762,320 bytes as its memory analysis reported them."""
    gb300, io, temp = 288_000_000_000, 115_111_143_788, 168_653_762_320
    base = int(gb300 * 0.8)
    assert slop_percent("--xla_gpu_enable_latency_hiding_scheduler=true") == 95
    assert slop_percent("--xla_gpu_memory_limit_slop_factor=148") == 148
    assert scheduler_memory_limit(base, io, 95) + io == pytest.approx(224_635_032_773, rel=1e-5)
    assert scheduler_memory_limit(base, io, 148) + io == pytest.approx(285_738_126_565, rel=1e-5)
    note = scheduler_memory_note(base, gb300, io, temp, 95)
    assert "scheduled for memory" in note and "--xla_gpu_memory_limit_slop_factor=150 " in note
    whole = scheduler_memory_limit(base, io, 150)
    assert gb300 - io <= whole < gb300 - io + (base - io) // 100  # the smallest slop that budgets the device
    assert scheduler_memory_note(base, gb300, io, temp, 150) is None
    over = scheduler_memory_note(base, gb300, base + 1, 1, 95)  # arguments over the base: no budget, no slop helps
    assert over is not None and "no memory budget" in over and "slop_factor=" not in over
    # --dry_run_mem_fraction 0.95: the slop a deviceless compile needs for a GPU run's budget at that allocator share
    # (the attention compile in benchmarks/RESULTS.md ran with 130)
    run = scheduler_memory_limit(int(gb300 * 0.95), io, 95)
    assert scheduler_slop_for(0.95, gb300, io) == 130
    assert run * 0.99 < scheduler_memory_limit(base, io, 130) <= run
    assert scheduler_slop_for(0.95, gb300, io, 148) == 203  # a user's slop applies on the GPU too
    assert scheduler_slop_for(0.3, gb300, io) == 0  # the allocator below the arguments: no budget
    with pytest.raises(ValueError, match="exceed XLA:GPU's deviceless base"):
        scheduler_slop_for(0.95, gb300, base)
