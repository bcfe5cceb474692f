"""The 1F1B schedule's residual slots (parallel/one_f_one_b_tables.residual_slot_table): no slot is given to two forwards
alive at once, and the ring holds no more slots than forwards are ever alive together on a stage."""

import numpy as np
import pytest

from moejax.parallel.one_f_one_b_tables import residual_slot_table


def _lives(n_stages, n_micro, n_repeats):
    """Per stage, each forward item's [forward tick, backward tick), from the schedule's definition (module
    docstring): forward item i = g V S + r S + j at tick i + s; its backward, the same micro-batch in the same
    chunk, is backward item g V S + (V - 1 - r) S + j at tick T0 + that + S - 1 - s, T0 = V S + S - 1."""
    n_pad = -(-n_micro // n_stages) * n_stages
    out = []
    for s in range(n_stages):
        rows = []
        for i in range(n_pad * n_repeats):
            g, rest = divmod(i, n_repeats * n_stages)
            r, j = divmod(rest, n_stages)
            back = g * n_repeats * n_stages + (n_repeats - 1 - r) * n_stages + j
            rows.append((i + s, n_repeats * n_stages + n_stages - 1 + back + n_stages - 1 - s))
        out.append(rows)
    return out


@pytest.mark.parametrize("n_stages,n_micro,n_repeats", [(2, 32, 8), (2, 3, 3), (4, 8, 2), (4, 8, 1), (3, 12, 4)])
def test_slots_never_shared_by_live_forwards_and_as_few_as_alive(n_stages, n_micro, n_repeats):
    slot_SxI, n_slots = residual_slot_table(n_stages, n_micro, n_repeats)
    most_alive = 0
    for s, lives in enumerate(_lives(n_stages, n_micro, n_repeats)):
        for a, (start_a, end_a) in enumerate(lives):
            for b in range(a + 1, len(lives)):
                start_b, end_b = lives[b]
                if start_a < end_b and start_b < end_a:  # both alive at one tick: different slots
                    assert slot_SxI[s, a] != slot_SxI[s, b], (s, a, b)
        ticks = max(end for _, end in lives)
        alive = [sum(start <= t < end for start, end in lives) for t in range(ticks)]
        most_alive = max(most_alive, max(alive))
    assert np.all(slot_SxI < n_slots)
    assert n_slots == most_alive  # interval colouring is optimal: no slot more than needed
    if n_micro >= 3 * n_stages:  # a long enough steady state: V S + 2 S - 2 (docs/pipeline.md)
        assert n_slots == n_repeats * n_stages + 2 * n_stages - 2


def test_ticks_leave_out_the_last_slot_only_where_no_stage_needs_it():
    """skip_last_slot: a tick runs the last slot iff a stage busy at it works on a chunk whose last slot holds a
    layer (checked item by item against the schedule); on DeepSeek-V3's split (58 MoE layers, PP2 x VP8: the last
    3 repeats' chunks end in an identity slot) 5 of each round's 16 forward and backward ticks leave it out, and
    an even split runs every slot."""
    from moejax.parallel.one_f_one_b_tables import executed_slots, skip_last_slot
    from moejax.parallel.pipeline import slot_is_layer

    n_stages, n_micro, n_repeats = 2, 32, 8
    last_VxS = slot_is_layer(58, n_stages, n_repeats)[..., -1]
    need_f, need_b = skip_last_slot(n_stages, n_micro, n_repeats, last_VxS)
    t_back = n_repeats * n_stages + n_stages - 1
    n_items = n_micro * n_repeats
    for t in range(len(need_f)):
        fwd = [(t - s, s) for s in range(n_stages) if 0 <= t - s < n_items]
        bwd = [(t - t_back - (n_stages - 1 - s), s) for s in range(n_stages)
               if 0 <= t - t_back - (n_stages - 1 - s) < n_items]
        assert need_f[t] == any(last_VxS[(i % 16) // 2, s] for i, s in fwd)
        assert need_b[t] == any(last_VxS[n_repeats - 1 - (i % 16) // 2, s] for i, s in bwd)
    edge = t_back
    assert need_f[edge:edge + 16].sum() == 11 and need_b[edge + 16:edge + 32].sum() == 11
    forward, backward = executed_slots(n_stages, n_micro, n_repeats, 4, last_VxS)
    ticks_each = n_micro * n_repeats + n_stages - 1  # ticks with a forward (with a backward)
    assert forward < 4 * ticks_each and backward < 4 * ticks_each
    assert forward >= n_micro * 29 and backward >= n_micro * 29  # every real layer of every micro-batch
    assert executed_slots(n_stages, n_micro, n_repeats, 4, None) == (4 * ticks_each, 4 * ticks_each)
