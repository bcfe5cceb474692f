"""When checkpoints are saved and kept: steps, minutes, stop signals, and retention (latest K + every M)."""

import os
import signal
import time

import jax.numpy as jnp
import ml_collections
import numpy as np

from moejax.training.checkpoint import Checkpointer
from moejax.training.preemption import SaveSchedule, StopSignals


def ckpt_cfg(**kw):
    c = ml_collections.ConfigDict(dict(every_steps=0, every_minutes=0.0, keep=2, keep_every_steps=0))
    c.update(kw)
    return c


def test_every_steps_and_the_last_step():
    with StopSignals() as signals:
        schedule = SaveSchedule(ckpt_cfg(every_steps=5), 12, signals)
        assert [s for s in range(1, 13) if schedule.due(s, host_synced=False)[0]] == [5, 10, 12]


def test_every_minutes():
    with StopSignals() as signals:
        schedule = SaveSchedule(ckpt_cfg(every_minutes=0.2 / 60), 100, signals)  # 0.2 s
        assert schedule.due(1, host_synced=False) == (False, False)
        time.sleep(0.25)
        assert schedule.due(2, host_synced=False) == (True, False)
        schedule.saved()
        assert schedule.due(3, host_synced=False) == (False, False)


def test_sigterm_and_sigint_ask_for_a_save_and_a_stop():
    # What was installed before (a shell's background job starts with SIGINT ignored, not the default).
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        with StopSignals() as signals:
            schedule = SaveSchedule(ckpt_cfg(), 100, signals)
            os.kill(os.getpid(), sig)  # recorded, not fatal
            time.sleep(0.01)
            assert signals.received == sig
            assert schedule.due(7, host_synced=False) == (True, True)
    # The previous handlers are back afterwards.
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_retention_keeps_the_latest_k_and_every_mth(tmp_path):
    checkpointer = Checkpointer(tmp_path / "ck", ckpt_cfg(keep=2, keep_every_steps=4))
    for step in range(1, 11):
        state = {"w": jnp.full((4,), float(step))}
        checkpointer.save(step, state, meta={"step": step}, config_json="{}")
    checkpointer.close()
    kept = sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit())
    assert kept == [4, 8, 9, 10]
    again = Checkpointer(tmp_path / "ck", ckpt_cfg(keep=2, keep_every_steps=4))
    abstract = {"w": jnp.zeros((4,))}
    state, meta = again.restore(8, abstract, {"w": jax_sharding()})
    again.close()
    np.testing.assert_array_equal(state["w"], np.full((4,), 8.0))
    assert meta == {"step": 8}


def jax_sharding():
    import jax

    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
