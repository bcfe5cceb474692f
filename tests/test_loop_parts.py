"""The training loop's parts, each alone and without a model: the step timer, the non-finite guard, the
evaluator's schedule, the log windows and the profiler window."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from moejax.config import default_config
from moejax.training.evaluator import Evaluator
from moejax.training.log_windows import LogWindows
from moejax.training.nonfinite_guard import NonFiniteGuard
from moejax.training.profile_window import ProfileWindow
from moejax.training.step_timer import StepTimer


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def test_step_time_is_the_window_per_step_less_the_excluded_host_time():
    clock = FakeClock()
    timer = StepTimer(10, clock=clock)  # resumed at step 10: the first window holds steps 11-14
    clock.now += 3.0
    with timer.excluding():  # e.g. eval
        clock.now += 5.0
    timer.exclude(0.5)  # e.g. a save timed elsewhere
    clock.now += 0.5
    assert timer.close_window(14) == pytest.approx((3.0 + 5.0 + 0.5 - 5.0 - 0.5) / 4)
    # The next window starts at the close, with nothing excluded.
    clock.now += 6.0
    assert timer.close_window(16) == pytest.approx(3.0)


def test_step_timer_excludes_a_block_that_raised():
    clock = FakeClock()
    timer = StepTimer(0, clock=clock)
    with pytest.raises(RuntimeError):
        with timer.excluding():
            clock.now += 2.0
            raise RuntimeError
    clock.now += 1.0
    assert timer.close_window(1) == pytest.approx(1.0)


def test_guard_counts_resets_on_a_finite_step_and_keeps_the_total(capsys):
    guard = NonFiniteGuard(3, total=7)  # 7 skipped before the resume
    assert guard.observe(1, 0.0) is None
    assert guard.observe(2, 1.0, float("nan"), float("inf")) is None
    assert (guard.in_a_row, guard.first_bad, guard.total) == (1, 2, 8)
    assert guard.observe(3, 0.0) is None
    assert guard.in_a_row == 0 and guard.total == 8
    assert guard.observe(4, 1.0, float("nan"), 1.5) is None
    assert guard.observe(5, 1.0, float("nan"), 1.5) is None
    assert (guard.in_a_row, guard.first_bad, guard.total) == (2, 4, 10)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "step 2: loss nan / grad norm inf is not finite; the update was skipped (1 in a row, 8 in this run)",
        "step 4: loss nan / grad norm 1.5 is not finite; the update was skipped (1 in a row, 9 in this run)",
        "step 5: loss nan / grad norm 1.5 is not finite; the update was skipped (2 in a row, 10 in this run)"]


def test_guard_stops_after_max_bad_steps_in_a_row_naming_the_intact_checkpoint():
    asked = []

    def latest_checkpoint():
        asked.append(1)
        return 10

    guard = NonFiniteGuard(3, latest_checkpoint=latest_checkpoint)
    for step in (4, 5):  # two in a row, then a finite step: the run starts over
        assert guard.observe(step, 1.0) is None
    assert guard.observe(6, 0.0) is None
    assert guard.observe(12, 1.0) is None and guard.observe(13, 1.0) is None
    assert not asked  # the checkpoint directory is looked at only to explain a stop
    stop = guard.observe(14, 1.0)
    assert stop == ("3 consecutive steps (12-14) had a non-finite loss or gradient (guards.max_bad_steps=3); no "
                    "update was applied and nothing was saved after checkpoint step 10, which is intact")
    assert guard.total == 5


def test_guard_stop_without_a_checkpoint():
    guard = NonFiniteGuard(1)
    stop = guard.observe(1, 1.0)
    assert stop.startswith("1 consecutive steps (1-1) had a non-finite loss or gradient (guards.max_bad_steps=1)")
    assert stop.endswith("nothing was saved after the start (there is no checkpoint)")


def test_eval_is_due_every_n_steps_and_after_the_last():
    evaluator = Evaluator(None, ["b0"], every=3, last_step=10)
    assert [s for s in range(1, 11) if evaluator.due(s)] == [3, 6, 9, 10]
    assert not any(Evaluator(None, ["b0"], every=0, last_step=10).due(s) for s in range(1, 11))
    assert not any(Evaluator(None, [], every=3, last_step=10).due(s) for s in range(1, 11))


def test_eval_runs_every_held_out_batch_on_the_device_and_returns_the_mean():
    seen = []

    def eval_fn(state, batch):
        seen.append((state, batch))
        return jnp.float32(batch["loss"])

    held_out = [{"loss": 1.0}, {"loss": 2.0}, {"loss": 6.0}]
    evaluator = Evaluator(eval_fn, held_out, every=1, last_step=1, to_device=lambda b: {**b, "on_device": True})
    loss = evaluator.run("state")
    assert loss == pytest.approx(3.0) and isinstance(loss, float)
    assert seen == [("state", {**b, "on_device": True}) for b in held_out]


def windows(log_every=4, last_step=10, expert_load_every=0, eval_steps=(), save_steps=()):
    return LogWindows(log_every=log_every, last_step=last_step, expert_load_every=expert_load_every,
                      eval_due=lambda s: s in eval_steps, save_fixed=lambda s: s in save_steps)


def test_windows_close_at_logged_eval_and_fixed_save_steps_but_saves_are_not_written():
    w = windows(log_every=4, last_step=10, eval_steps=(5,), save_steps=(7, 8))
    assert [s for s in range(1, 11) if w.closes(s)] == [4, 5, 7, 8, 10]
    assert [s for s in range(1, 11) if w.writes(s)] == [4, 5, 8, 10]


def test_windows_of_the_e2e_run():
    # tests/test_train_e2e.py: log_every=2, eval_every=3, checkpoint.every_steps=3, 6 steps.
    evaluator = Evaluator(None, ["b"], every=3, last_step=6)
    w = LogWindows(log_every=2, last_step=6, expert_load_every=100, eval_due=evaluator.due,
                   save_fixed=lambda s: s % 3 == 0 or s == 6)
    assert [s for s in range(1, 7) if w.writes(s)] == [2, 3, 4, 6]
    assert [s for s in range(1, 7) if w.closes(s)] == [2, 3, 4, 6]


def test_a_record_holds_the_step_metrics_throughput_eval_then_expert_load():
    w = windows(last_step=10, expert_load_every=4)
    host = {"loss": 2.5, "grad_norm": 1.0, "tokens_per_expert": [[3, 5]], "skipped_steps": 0}
    throughput = {"step_time_s": 0.1, "tokens_per_s": 10.0, "tflops_per_device": 1.0, "mfu": 0.5}
    record = w.record(4, host, throughput, eval_loss=2.0)
    assert list(record) == ["step", "loss", "grad_norm", "skipped_steps", "step_time_s", "tokens_per_s",
                            "tflops_per_device", "mfu", "eval_loss", "tokens_per_expert"]
    assert record["step"] == 4 and record["tokens_per_expert"] == [[3, 5]]
    assert "tokens_per_expert" in host  # the caller's metrics are left as they were
    # Expert load only every expert_load_every steps and on the last; eval loss only when evaluated.
    assert "tokens_per_expert" not in w.record(6, host, throughput)
    assert "tokens_per_expert" in w.record(10, host, throughput)
    assert "eval_loss" not in w.record(6, host, throughput)
    assert "tokens_per_expert" not in windows(last_step=10, expert_load_every=0).record(8, host, throughput)


def window(python_tracer=False, **steps):
    return SimpleNamespace(python_tracer=python_tracer, **steps)


def test_the_python_tracer_is_opt_in(monkeypatch, tmp_path):
    levels = []
    monkeypatch.setattr(jax.profiler, "start_trace",
                        lambda d, profiler_options: levels.append(profiler_options.python_tracer_level))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    for python_tracer in (False, True):
        ProfileWindow(window(python_tracer, start_step=0, num_steps=1), tmp_path).before_step(0)
    assert levels == [0, 1]
    assert default_config().profile.python_tracer is False


def test_profile_window_traces_its_steps_only(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d, profiler_options: calls.append(("start", d)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    # quiesce (the loop's wait for an async checkpoint save) runs before the trace starts and before it stops
    profiler = ProfileWindow(window(start_step=2, num_steps=3), tmp_path,
                             quiesce=lambda: calls.append("quiesce"))
    for step in range(8):
        profiler.before_step(step)
        calls.append(step)
    profiler.stop()  # already stopped: nothing more
    assert calls == [0, 1, "quiesce", ("start", str(tmp_path / "process_0")), 2, 3, 4, "quiesce", ("stop",),
                     5, 6, 7]
    off = ProfileWindow(window(start_step=-1, num_steps=3), tmp_path / "off")
    for step in range(5):
        off.before_step(step)
    off.stop()
    assert calls[-1] == 7 and not (tmp_path / "off").exists()


def test_a_run_stopped_inside_the_profile_window_stops_the_trace(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d, profiler_options: calls.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))
    profiler = ProfileWindow(window(start_step=0, num_steps=10), tmp_path)
    profiler.before_step(0)
    profiler.stop()
    profiler.stop()
    assert calls == ["start", "stop"]

    def failed_save():
        raise OSError("disk full")

    profiler = ProfileWindow(window(start_step=0, num_steps=10), tmp_path, quiesce=lambda: None)
    profiler.before_step(0)
    profiler.quiesce = failed_save  # the save in flight fails while the run is stopping
    with pytest.raises(OSError, match="disk full"):
        profiler.stop()
    assert calls == ["start", "stop", "start", "stop"]  # the trace was stopped (and written) all the same
    profiler.stop()
    assert calls[-1] == "stop" and len(calls) == 4
