"""The training loop: config -> mesh -> sharded state -> compiled step -> metrics, reading top to bottom.

The loop dispatches step t before it reads step t-1's metrics, so the host does not stall the device between
logged steps; step time is the wall time between consecutive logged steps' completions divided by the
steps in between, less the time the host spent blocked on eval and checkpoint saves.

Surviving: the run resumes from the latest complete checkpoint (state, data iterator, guard counters);
saves follow a SaveSchedule (steps, minutes, end, SIGTERM/SIGINT); a step whose loss or gradient is not
finite is skipped by the step itself and counted here, and too many in a row stop the run without saving;
a watchdog ends a run whose steps stop finishing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from moejax.data.pipeline import BatchIterator, eval_batches, train_batches
from moejax.data.sources import data_fingerprint, open_sources
from moejax.model.accounting import flops_per_token, param_counts
from moejax.parallel.mesh import batch_sharding, mesh_from_config
from moejax.train import metrics as M
from moejax.train.checkpoint import Checkpointer, CheckpointError
from moejax.train.preemption import SaveSchedule, StopSignals
from moejax.train.optim import make_optimizer
from moejax.train.state import abstract_state, init_state, init_state_from_weights, model_graphdef, state_shardings
from moejax.train.step import jit_eval_step, jit_train_step
from moejax.train.watchdog import Watchdog


class NonFiniteLoss(RuntimeError):
    """guards.max_bad_steps consecutive steps had a non-finite loss or gradient."""


class Stopped(Exception):
    """A stop signal arrived; the state after `step` was saved."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"signal {signum}: saved a checkpoint at step {step} and stopped")
        self.signum, self.step = signum, step


def _global_batch(local_batch: dict, sharding):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)


def train(cfg, workdir: Path, mesh_sizes: dict[str, int], sources=None) -> dict:
    """Runs cfg.train.steps steps (resuming from WORKDIR/checkpoints); returns the last logged metrics.
    `sources`: the opened data.corpus (moejax.data.sources.open_sources), when the caller already checked it."""
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    mesh = mesh_from_config(cfg, mesh_sizes)
    t, g = cfg.train, cfg.guards
    n_devices = jax.device_count()

    if sources is None:
        sources = open_sources(cfg.data, vocab_size=cfg.model.vocab_size)
    per_process = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                       vocab_size=cfg.model.vocab_size)
    batches = train_batches(sources, seq_len=t.seq_len, global_batch=t.global_batch, steps=t.steps,
                            seed=cfg.seed, **per_process)
    held_out = eval_batches(sources, seq_len=t.seq_len, global_batch=t.global_batch, n_batches=t.eval_batches,
                            **per_process)
    fingerprint = data_fingerprint(sources)
    config_json = cfg.to_json_best_effort(sort_keys=True)

    tx = make_optimizer(cfg)
    graphdef = model_graphdef(cfg)
    checkpointer = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    start = checkpointer.latest_step() or 0
    next_batch, skipped_total = 0, 0
    if start:
        abstract = abstract_state(cfg, tx)
        shardings = state_shardings(abstract, mesh)
        state, meta = checkpointer.restore(start, abstract, shardings)
        if meta["data"]["fingerprint"] != fingerprint:
            raise CheckpointError(f"the data changed since checkpoint {start} was saved ({meta['data']['fingerprint']}"
                                  f" then, {fingerprint} now); a resumed run must read the same data")
        next_batch, skipped_total = int(meta["data"]["next_batch"]), int(meta["skipped_steps"])
    elif cfg.checkpoint.init_from:  # continue from released (imported) weights
        state, shardings = init_state_from_weights(cfg, tx, mesh, cfg.checkpoint.init_from)
    else:
        state, shardings = init_state(cfg, tx, mesh, cfg.seed)
    if is_main:  # only now: a run refused above (broken checkpoint, changed data) leaves config.json alone
        write_config(cfg, workdir)

    in_sharding = batch_sharding(mesh)
    example = _global_batch(batches[next_batch], in_sharding)
    compile_start = time.perf_counter()
    with jax.set_mesh(mesh):
        step_fn = jit_train_step(cfg, graphdef, tx, mesh, shardings).lower(state, example).compile()
        # Compiled only when it will run: a second compile is most of the start-up of a short run.
        eval_fn = (jit_eval_step(graphdef, mesh, shardings).lower(state, example).compile()
                   if held_out and t.eval_every > 0 else None)
    compile_s = time.perf_counter() - compile_start

    peak, peak_source = M.peak_flops_per_device(cfg)
    fpt = flops_per_token(cfg)
    tokens_per_step = t.global_batch * t.seq_len
    counts = param_counts(cfg)
    if is_main:
        print(f"mesh {dict(mesh.shape)} over {n_devices} devices | params {counts['total'] / 1e6:.2f}M total, "
              f"{counts['active'] / 1e6:.2f}M active | {fpt / 1e6:.3g} MFLOP/token | peak "
              f"{peak / 1e12:.3g} TFLOP/s/dev ({peak_source}) | compiled in {compile_s:.1f}s"
              + (f" | resumed at step {start}" if start else ""), flush=True)

    writer = M.MetricsWriter(workdir, enabled=is_main)
    data_iter = BatchIterator(batches, next_batch)
    signals = StopSignals()
    schedule = SaveSchedule(cfg.checkpoint, t.steps, signals, process_count=jax.process_count())
    watchdog = Watchdog(g.step_timeout_s)
    bad = {"run": 0, "first": None, "total": skipped_total}
    last = {}
    # Step time = wall time between logged steps, less the host time spent blocked on eval and saves.
    window = {"time": time.perf_counter(), "step": start, "excluded": 0.0}

    def eval_due(step_done):
        return bool(held_out) and t.eval_every > 0 and (step_done % t.eval_every == 0 or step_done == t.steps)

    def closes_window(step_done):
        return (step_done % t.log_every == 0 or step_done == t.steps or eval_due(step_done)
                or schedule.fixed(step_done))

    def guard(step_done, host) -> str | None:
        """Counts skipped (non-finite) steps; after guards.max_bad_steps in a row, says why the run stops."""
        if not host.pop("skipped", 0.0):
            bad["run"] = 0
            return None
        bad["run"] += 1
        bad["total"] += 1
        if bad["run"] == 1:
            bad["first"] = step_done
        print(f"step {step_done}: loss {host['loss']} / grad norm {host['grad_norm']} is not finite; the "
              f"update was skipped ({bad['run']} in a row, {bad['total']} in this run)", file=sys.stderr, flush=True)
        if bad["run"] >= g.max_bad_steps:
            kept = checkpointer.latest_step()
            return (
                f"{bad['run']} consecutive steps ({bad['first']}-{step_done}) had a non-finite loss or gradient "
                f"(guards.max_bad_steps={g.max_bad_steps}); no update was applied and nothing was saved after "
                + (f"checkpoint step {kept}, which is intact" if kept else "the start (there is no checkpoint)"))
        return None

    def finish(step_done, device_metrics, state_now=None):
        """Reads step_done's metrics (blocking until it is complete); logs it if it closes a window.
        state_now is the state after step_done, given when nothing newer has been dispatched."""
        host = M.to_host(device_metrics)
        watchdog.beat(f"step {step_done} finished")
        stop = guard(step_done, host)
        host["skipped_steps"] = bad["total"]
        if closes_window(step_done):
            log(step_done, host, state_now)
        if stop:
            raise NonFiniteLoss(stop)

    def log(step_done, host, state_now):
        nonlocal last
        now = time.perf_counter()
        step_time = (now - window["time"] - window["excluded"]) / max(1, step_done - window["step"])
        window.update(time=now, step=step_done, excluded=0.0)
        tpe = host.pop("tokens_per_expert", None)
        record = {"step": step_done, **host, **M.throughput(step_time, tokens_per_step, fpt, n_devices, peak)}
        if eval_due(step_done):
            losses = [eval_fn(state_now, _global_batch(b, in_sharding)) for b in held_out]
            record["eval_loss"] = float(np.mean(jax.device_get(losses)))
            watchdog.beat(f"eval after step {step_done}")
            window["excluded"] += time.perf_counter() - now  # eval is not training-step time
        if tpe is not None and (step_done == t.steps or (t.expert_load_every > 0 and step_done % t.expert_load_every == 0)):
            record["tokens_per_expert"] = tpe
        if step_done % t.log_every == 0 or step_done == t.steps or "eval_loss" in record:
            if is_main:
                print(M.console_line(record, t.steps), flush=True)
            writer.write(record)
            last = record

    def save(step_done):
        save_start = time.perf_counter()
        meta = {"step": step_done, "seed": cfg.seed, "skipped_steps": bad["total"],
                "data": {**data_iter.get_state(), "fingerprint": fingerprint}}
        checkpointer.save(step_done, state, meta=meta, config_json=config_json)
        schedule.saved()
        watchdog.beat(f"checkpoint at step {step_done}")
        window["excluded"] += time.perf_counter() - save_start

    profiler = ProfileWindow(cfg.profile, workdir / "profile")
    pending = None
    watchdog.start()
    try:
        with signals:
            for step in range(start, t.steps):
                window["excluded"] += profiler.before_step(step)
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, device_metrics = step_fn(state, _global_batch(next(data_iter), in_sharding))
                if pending is not None:
                    finish(*pending)  # step - 1: runs while step is already queued
                    pending = None
                synced = closes_window(step + 1)
                if synced:
                    # A window closes exactly when its last step completes: wait for it before dispatching the
                    # next (one host bubble per log window, not per step; some runtimes dispatch
                    # synchronously, and without this a window would end one step late).
                    finish(step + 1, device_metrics, state)
                else:
                    pending = (step + 1, device_metrics)
                save_now, stop = schedule.due(step + 1, host_synced=synced)
                if save_now:
                    if pending is not None:  # the guard counters saved with the state must include this step
                        finish(*pending)
                        pending = None
                    save(step + 1)
                if stop:
                    raise Stopped(signals.received, step + 1)
            if pending is not None:
                finish(*pending)
    finally:
        watchdog.stop()
        profiler.stop()
        checkpointer.close()
        writer.close()
    return last


class ProfileWindow:
    """jax.profiler trace of steps [start_step, start_step + num_steps), viewable in TensorBoard/Perfetto."""

    def __init__(self, profile_cfg, directory: Path):
        self.start = profile_cfg.start_step
        self.stop_at = profile_cfg.start_step + profile_cfg.num_steps
        self.directory = Path(directory) / f"process_{jax.process_index()}"
        self.active = False

    def before_step(self, step: int) -> float:
        """Starts or stops the trace as due; returns the seconds that took (kept out of step time)."""
        began = time.perf_counter()
        if self.start >= 0 and step == self.start and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        elif self.active and step == self.stop_at:
            self.stop()
        return time.perf_counter() - began

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def write_config(cfg, workdir: Path):
    """WORKDIR/config.json; an earlier run's different config is kept as config.<n>.json, never lost."""
    path = Path(workdir) / "config.json"
    text = json.dumps(json.loads(cfg.to_json_best_effort()), indent=2) + "\n"
    if path.exists() and path.read_text() != text:
        n = 1
        while (backup := path.with_name(f"config.{n}.json")).exists():
            n += 1
        path.rename(backup)
    path.write_text(text)
