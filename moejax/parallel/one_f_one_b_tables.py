"""The interleaved 1F1B schedule's static tables (parallel/one_f_one_b.py runs it): which residual slot each forward
item's residuals take, how many ticks each phase has, which ticks need an uneven split's last slot, the runs of ticks
the program scans as one body each, and the layer slots a stage executes (the planner's stage compute). Plain
numpy: the schedule is fixed by the stage, micro-batch and virtual-stage counts, so all of it is known before
tracing.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=256)
def residual_slot_table(n_stages: int, n_micro: int, n_repeats: int) -> tuple[np.ndarray, int]:
    """(slot_SxI: the ring slot each stage keeps forward item i's residuals in, K: the ring's slots).

    A forward's residuals live from its tick to its backward's, and how long depends on the chunk (stage 0's first
    chunk waits (2 V + 1) S - 2 ticks, its last about 2 S): a slot per item modulo the longest life would keep
    (2 V + 1) S - 1 slots, about twice the forwards ever alive at once. The schedule is static, so the slots are
    assigned here, once, by greedy interval colouring in start order (optimal for intervals: K is the most
    forwards alive at one tick on any stage, V S + 2 S - 2 in the steady state). A backward reads its slot before
    the same tick's forward writes (the loop body's order), so a slot is free again at its backward's tick."""
    n_pad = -(-n_micro // n_stages) * n_stages
    item_I = np.arange(n_pad * n_repeats)
    g, rest = item_I // (n_repeats * n_stages), item_I % (n_repeats * n_stages)
    r, j = rest // n_stages, rest % n_stages
    back_item_I = (g * n_repeats + n_repeats - 1 - r) * n_stages + j  # the same micro-batch's backward in this chunk
    t_back = n_repeats * n_stages + n_stages - 1
    slot_SxI = np.zeros((n_stages, item_I.size), np.int32)
    n_slots = 0
    for s in range(n_stages):
        free_from: list[int] = []  # per slot: the tick from which it is free
        for i in item_I:  # starts (tick i + s) are in item order
            k = next((k for k, tick in enumerate(free_from) if tick <= i + s), len(free_from))
            if k == len(free_from):
                free_from.append(0)
            free_from[k] = t_back + back_item_I[i] + n_stages - 1 - s
            slot_SxI[s, i] = k
        n_slots = max(n_slots, len(free_from))
    slot_SxI.setflags(write=False)
    return slot_SxI, n_slots


def schedule_ticks_1f1b(n_stages: int, n_micro: int, n_repeats: int) -> tuple[int, int]:
    """(forward-only ticks = backward-only ticks, rounds of V S ticks with a forward and a backward each)."""
    return n_repeats * n_stages + n_stages - 1, -(-n_micro // n_stages) - 1


def skip_last_slot(n_stages: int, n_micro: int, n_repeats: int, last_slot_VxS=None) -> tuple[np.ndarray, np.ndarray]:
    """(need_f [T], need_b [T]): whether tick t's forward / backward must run the chunks' last slot, i.e. whether any
    stage busy at t works on a chunk whose last slot holds a layer (last_slot_VxS [V, S]; None: every chunk's does).
    An uneven split's identity slots come last in the last chunks (parallel/pipeline.layer_slots), so at some
    ticks every stage's chunk ends in one and the tick leaves it out instead of computing and discarding it."""
    n_pad = -(-n_micro // n_stages) * n_stages
    n_items, round_ticks = n_pad * n_repeats, n_repeats * n_stages
    edge, middle = schedule_ticks_1f1b(n_stages, n_pad, n_repeats)
    n_ticks = 2 * edge + middle * round_ticks
    if last_slot_VxS is None:
        return np.ones(n_ticks, bool), np.ones(n_ticks, bool)
    last_VxS = np.asarray(last_slot_VxS, bool)
    t_T, s_S = np.arange(n_ticks)[:, None], np.arange(n_stages)[None, :]

    def need(item_TxS, reverse):
        busy = (item_TxS >= 0) & (item_TxS < n_items)
        r = (np.clip(item_TxS, 0, n_items - 1) % round_ticks) // n_stages
        r = n_repeats - 1 - r if reverse else r
        return np.any(busy & last_VxS[r, np.broadcast_to(s_S, r.shape)], axis=1)

    t_back = round_ticks + n_stages - 1
    return need(t_T - s_S, False), need(t_T - t_back - (n_stages - 1 - s_S), True)


def tick_runs(n_stages: int, n_micro: int, n_repeats: int, last_slot_VxS=None):
    """The schedule's three loops as runs of ticks with equal needs of the last slot (skip_last_slot), each run one
    scan whose body is traced for its needs: (warm-up [(first tick, ticks, need_f)], one round of the steady state
    [(first tick in the round, ticks, (need_f, need_b))] (the rounds' union: every round runs these), cool-down
    [(first tick, ticks, need_b)])."""
    need_f_T, need_b_T = skip_last_slot(n_stages, n_micro, n_repeats, last_slot_VxS)
    n_pad = -(-n_micro // n_stages) * n_stages
    edge, middle = schedule_ticks_1f1b(n_stages, n_pad, n_repeats)
    round_ticks = n_repeats * n_stages

    def runs(first, flags):
        out, k = [], 0
        while k < len(flags):
            n = 1
            while k + n < len(flags) and flags[k + n] == flags[k]:
                n += 1
            out.append((first + k, n, flags[k]))
            k += n
        return out

    steady_T = edge + np.arange(middle * round_ticks)
    need_GxKx2 = np.stack([need_f_T[steady_T], need_b_T[steady_T]], -1).reshape(middle, round_ticks, 2)
    round_flags = [(bool(f), bool(b)) for f, b in need_GxKx2.any(axis=0)]
    cool = edge + middle * round_ticks
    return (runs(0, [bool(x) for x in need_f_T[:edge]]), runs(0, round_flags),
            runs(cool, [bool(x) for x in need_b_T[cool:cool + edge]]))


def executed_slots(n_stages: int, n_micro: int, n_repeats: int, n_chunk_slots: int,
                   last_slot_VxS=None) -> tuple[int, int]:
    """(forward, backward) layer-slot executions of one stage in a pass, as one_f_one_b runs them (tick_runs): C
    slots per tick with a forward (backward), C - 1 at those that leave the last slot out. The planner's stage
    compute."""
    warm_up, one_round, cool_down = tick_runs(n_stages, n_micro, n_repeats, last_slot_VxS)
    rounds = schedule_ticks_1f1b(n_stages, -(-n_micro // n_stages) * n_stages, n_repeats)[1]
    slots = lambda n, need: n * (n_chunk_slots - 1 + int(need))  # noqa: E731
    forward = sum(slots(n, f) for _, n, f in warm_up) + rounds * sum(slots(n, f) for _, n, (f, _) in one_round)
    backward = sum(slots(n, b) for _, n, b in cool_down) + rounds * sum(slots(n, b) for _, n, (_, b) in one_round)
    return forward, backward
