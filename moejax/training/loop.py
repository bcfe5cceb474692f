"""The training loop: config -> mesh -> sharded state -> compiled step -> metrics, reading top to bottom.

The loop dispatches step t before it reads step t-1's metrics, so the host does not stall the device between
logged steps. It waits for a step only where a log window closes (log_windows.py); the step time is the
window's wall time per step, less the host time spent on eval, saves and the profiler (step_timer.py).

Surviving: the run resumes from the latest complete checkpoint (state, data iterator, guard counters);
saves follow a SaveSchedule (steps, minutes, end, SIGTERM/SIGINT); a step whose loss or gradient is not
finite is skipped by the step itself and counted by the NonFiniteGuard, and too many in a row stop the run
without saving; a watchdog ends a run whose steps stop finishing.
"""

from __future__ import annotations

import contextlib
import json
import time
from functools import partial
from pathlib import Path

import jax

from moejax.config.layers import layer_plan
from moejax.data.pipeline import BatchIterator, eval_batches, train_batches
from moejax.data.sources import data_fingerprint, open_sources
from moejax.model.accounting import flops_per_token, param_counts
from moejax.parallel.mesh import batch_sharding, mesh_from_config
from moejax.parallel.pipeline import describe_split
from moejax.program.optim import make_optimizer
from moejax.program.state import (abstract_state, init_state, model_graphdef, restack, restore_shardings,
                                  stacked_like, train_state_shardings)
from moejax.program.step import jit_eval_step, jit_train_step
from moejax.program.weights import init_state_from_weights
from moejax.training import metrics as M
from moejax.training.checkpoint import Checkpointer, CheckpointError
from moejax.training.local_checkpoint import LocalTier, layout_fingerprint
from moejax.training.resume_point import incompatibilities
from moejax.training.evaluator import Evaluator
from moejax.training.log_windows import LogWindows
from moejax.training.nonfinite_guard import NonFiniteGuard, NonFiniteLoss
from moejax.training.peer_monitor import LostPeer, PeerMonitor, as_lost_peer
from moejax.training.preemption import SaveSchedule, StopSignals
from moejax.training.profile_window import ProfileWindow
from moejax.training.step_timer import StepTimer
from moejax.training.wandb_logger import open_wandb_logger
from moejax.training.watchdog import Watchdog

__all__ = ["LostPeer", "NonFiniteLoss", "Stopped", "train", "write_config"]


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
    # first: a peer that dies while this process compiles or restores is noticed too (exit 6)
    peer_monitor = PeerMonitor(cfg.guards.get("peer_timeout_s", 0)).start()
    try:
        return _train(cfg, workdir, mesh_sizes, sources, is_main)
    except Exception as e:
        lost = as_lost_peer(e)
        if lost is not None:
            raise lost from e
        raise
    finally:
        peer_monitor.stop()


def _train(cfg, workdir: Path, mesh_sizes: dict[str, int], sources, is_main: bool) -> dict:
    mesh = mesh_from_config(cfg, mesh_sizes)
    t, g = cfg.train, cfg.guards
    # capacity_factor <= 0 sizes capacity buffers for the worst case: like dropless, nothing can drop
    can_drop = cfg.moe.dispatch != "dropless" and cfg.moe.capacity_factor > 0
    n_devices = jax.device_count()

    batches, held_out, fingerprint = _data(cfg, sources)
    config_json = cfg.to_json_best_effort(sort_keys=True)

    tx = make_optimizer(cfg.optim)
    graphdef = model_graphdef(cfg)
    checkpointer = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    ck = cfg.checkpoint
    local_tier = (LocalTier(ck.local_dir, workdir, every_steps=ck.local_every_steps, keep=ck.local_keep)
                  if ck.get("local_dir", "") else None)
    if local_tier is not None and local_tier.note and is_main:
        print(f"local checkpoint tier: {local_tier.note}", flush=True)
    state, shardings, next_batch, skipped_total, start = _initial_state(cfg, tx, mesh, checkpointer, local_tier,
                                                                        fingerprint, config_json)
    if is_main:  # only now: a run refused above (broken checkpoint, changed data) leaves config.json alone
        write_config(cfg, workdir)

    to_device = partial(_global_batch, sharding=batch_sharding(mesh))
    example = to_device(batches[next_batch])
    compile_start = time.perf_counter()
    # The eval step is compiled only when it will run: a second compile is most of the start-up of a short run.
    step_fn, eval_fn = _compile(cfg, graphdef, tx, mesh, shardings, state, example,
                                with_eval=bool(held_out) and t.eval_every > 0)
    compile_s = time.perf_counter() - compile_start

    peak, peak_source = M.peak_flops_per_device(cfg.hardware.peak_tflops)
    fpt = flops_per_token(cfg)
    tokens_per_step = t.global_batch * t.seq_len
    if is_main:
        print(_banner(cfg, mesh, fpt, peak, peak_source, compile_s, start), flush=True)

    writer = M.MetricsWriter(workdir, enabled=is_main)
    wandb_logger = open_wandb_logger(cfg.observability.wandb, workdir, json.loads(config_json), start_step=start,
                                     process_index=jax.process_index())
    data_iter = BatchIterator(batches, next_batch)
    signals = StopSignals()
    schedule = SaveSchedule(cfg.checkpoint, t.steps, signals, process_count=jax.process_count())
    watchdog = Watchdog(g.step_timeout_s)
    guard = NonFiniteGuard(g.max_bad_steps, total=skipped_total, latest_checkpoint=checkpointer.latest_step)
    evaluator = Evaluator(eval_fn, held_out, every=t.eval_every, last_step=t.steps, to_device=to_device)
    windows = LogWindows(log_every=t.log_every, last_step=t.steps, expert_load_every=t.expert_load_every,
                         eval_due=evaluator.due, save_fixed=schedule.fixed)
    timer = StepTimer(start)

    def finish(step_done, device_metrics, state_now=None) -> dict | None:
        """Reads step_done's metrics (blocking until it is complete) and counts it in the guard; if it closes a
        log window, logs it and returns the record written. state_now is the state after step_done, given
        when nothing newer has been dispatched."""
        host = M.to_host(device_metrics)
        watchdog.beat(f"step {step_done} finished")
        stop = guard.observe(step_done, host.pop("skipped", 0.0), host.get("loss"), host.get("grad_norm"))
        host["skipped_steps"] = guard.total
        record = log(step_done, host, state_now) if windows.closes(step_done) else None
        if stop:  # raised only now, so that the step that stops the run is logged too
            raise NonFiniteLoss(stop)
        return record

    def log(step_done, host, state_now) -> dict | None:
        """Closes the window at step_done (its step time; eval when due); writes the record if it is logged."""
        step_time = timer.close_window(step_done)
        eval_loss = None
        if evaluator.due(step_done):
            with timer.excluding():  # eval is not training-step time
                eval_loss = evaluator.run(state_now)
                watchdog.beat(f"eval after step {step_done}")
        throughput = M.throughput(step_time, tokens_per_step, fpt, n_devices, peak)
        record = windows.record(step_done, host, throughput, eval_loss)
        if not windows.writes(step_done):
            return None
        if is_main:
            print(M.console_line(record, t.steps, can_drop=can_drop), flush=True)
        writer.write(record)
        if wandb_logger is not None:
            with timer.excluding():  # not training-step time: the expert-load image is drawn on the host
                wandb_logger.log(record)
        return record

    profiler = ProfileWindow(cfg.profile, workdir / "profile", quiesce=checkpointer.wait)
    last, pending = {}, None
    completed = False  # W&B marks a run that ends otherwise failed
    watchdog.start()
    try:
        with signals:
            for step in range(start, t.steps):
                done = step + 1  # what the state counts once this step completes; logs and saves use it
                with timer.excluding():
                    profiler.before_step(step)
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, device_metrics = step_fn(state, to_device(next(data_iter)))
                if pending is not None:
                    finish(*pending)  # step - 1: runs while step is already queued
                    pending = None
                synced = windows.closes(done)
                if synced:
                    # A window closes exactly when its last step completes: wait for it before dispatching the
                    # next (one host bubble per log window, not per step; some runtimes dispatch
                    # synchronously, and without this a window would end one step late).
                    last = finish(done, device_metrics, state) or last
                else:
                    pending = (done, device_metrics)  # closes no window: finishing it later logs nothing
                save_now, stop = schedule.due(done, host_synced=synced)
                # the local tier saves between persistent saves (a step saved persistently needs no local copy)
                local_now = local_tier is not None and local_tier.due(done) and not save_now
                if save_now or local_now:
                    if pending is not None:  # the guard counters saved with the state must include this step
                        finish(*pending)
                        pending = None
                    with timer.excluding():  # a save is not training-step time
                        meta = {"step": done, "seed": cfg.seed, "skipped_steps": guard.total,
                                "data": {**data_iter.get_state(), "fingerprint": fingerprint}}
                        if save_now:
                            checkpointer.save(done, state, meta=meta, config_json=config_json)
                            schedule.saved()
                        else:
                            local_tier.save(done, state, meta=meta, config_json=config_json, shardings=shardings)
                        watchdog.beat(f"checkpoint at step {done}")
                if stop:
                    raise Stopped(signals.received, done)
            if pending is not None:
                finish(*pending)
        completed = True
    finally:
        # Every part closes even when one before it raises: the profiler's stop waits for a save in flight
        # and raises that save's error; the checkpointer and the metrics writers must still close.
        with contextlib.ExitStack() as teardown:  # callbacks run last-registered first
            if wandb_logger is not None:
                teardown.callback(wandb_logger.close, failed=not completed)
            for close in (writer.close, checkpointer.close, profiler.stop, watchdog.stop):
                teardown.callback(close)
            if local_tier is not None:
                teardown.callback(local_tier.close)
    return last


def _data(cfg, sources):
    """(this process's training batches in order, its held-out batches, the data's fingerprint)."""
    t = cfg.train
    if sources is None:
        sources = open_sources(cfg.data, vocab_size=cfg.model.vocab_size)
    per_process = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                       vocab_size=cfg.model.vocab_size)
    batches = train_batches(sources, seq_len=t.seq_len, global_batch=t.global_batch, steps=t.steps,
                            seed=cfg.seed, **per_process)
    held_out = eval_batches(sources, seq_len=t.seq_len, global_batch=t.global_batch, n_batches=t.eval_batches,
                            **per_process)
    return batches, held_out, data_fingerprint(sources)


def _initial_state(cfg, tx, mesh, checkpointer: Checkpointer, local_tier: LocalTier | None, fingerprint: str,
                   config_json: str):
    """(state, shardings, next batch index, skipped steps so far, step): the newest of the persistent checkpoint and
    the local tier's newest step every process can restore; else the imported weights of checkpoint.init_from, else
    a fresh init from the seed."""
    persistent = checkpointer.latest_step() or 0
    abstract = abstract_state(cfg, tx)
    shardings = train_state_shardings(cfg, abstract, mesh)
    local = None
    if local_tier is not None:
        local = local_tier.newest_restorable(layout_fingerprint(jax.tree.flatten_with_path(abstract)[0], shardings))
        if local is not None and local.step <= persistent:
            local = None
    if local is not None:
        problems = incompatibilities(local.saved_config, json.loads(config_json))
        if problems:
            raise CheckpointError(f"the local checkpoint tier holds step {local.step} of an incompatible run "
                                  f"({problems[0]}); use a new --workdir or the saved values")
        state, meta = local_tier.restore(local, abstract, shardings), local.meta
        if jax.process_index() == 0:
            sent = "".join(f"; process {owner}'s shards sent back by process {holder}"
                           for holder, owner in local.returned)
            print(f"restoring step {local.step} from the local tier{sent} (persistent: "
                  f"{persistent or 'none'})", flush=True)
        return (state, shardings, *_checked_meta(meta, local.step, fingerprint), local.step)
    start = persistent
    if start:
        saved_like = stacked_like(checkpointer.saved_config(start), cfg)
        if saved_like is None:
            state, meta = checkpointer.restore(start, abstract, shardings)
        else:  # saved with another storage of the MoE stack (virtual stages, uneven split): moved into ours
            saved_abstract = abstract_state(saved_like, tx)
            state, meta = checkpointer.restore(start, saved_abstract, restore_shardings(cfg, saved_abstract, mesh))
            state = restack(state, abstract, shardings, mesh, saved_like, cfg)
        return (state, shardings, *_checked_meta(meta, start, fingerprint), start)
    if cfg.checkpoint.init_from:  # continue from released (imported) weights
        state, shardings = init_state_from_weights(cfg, tx, mesh, cfg.checkpoint.init_from)
    else:
        state, shardings = init_state(cfg, tx, mesh, cfg.seed)
    return state, shardings, 0, 0, 0


def _checked_meta(meta: dict, step: int, fingerprint: str) -> tuple[int, int]:
    """(next batch index, skipped steps so far) of a restored checkpoint, whose data must be this run's."""
    if meta["data"]["fingerprint"] != fingerprint:
        raise CheckpointError(f"the data changed since checkpoint {step} was saved ({meta['data']['fingerprint']}"
                              f" then, {fingerprint} now); a resumed run must read the same data")
    return int(meta["data"]["next_batch"]), int(meta["skipped_steps"])


def _compile(cfg, graphdef, tx, mesh, shardings, state, example, *, with_eval: bool):
    """(compiled train step, compiled eval step or None), for the state's and the example batch's layouts."""
    with jax.set_mesh(mesh):
        step_fn = jit_train_step(cfg, graphdef, tx, mesh, shardings).lower(state, example).compile()
        eval_fn = jit_eval_step(graphdef, mesh, shardings).lower(state, example).compile() if with_eval else None
    return step_fn, eval_fn


def _banner(cfg, mesh, fpt: float, peak: float, peak_source: str, compile_s: float, start: int) -> str:
    counts = param_counts(cfg)
    n_moe, stages = layer_plan(cfg.model).n_moe, int(mesh.shape.get("stage", 1))
    piped = (f" | {describe_split(n_moe, stages, int(cfg.mesh.virtual_stages), int(cfg.train.micro_batches))}, "
             f"{cfg.mesh.get('pipeline_schedule', 'circular')} schedule" if stages > 1 and n_moe else "")
    return (f"mesh {dict(mesh.shape)} over {jax.device_count()} devices | params {counts['total'] / 1e6:.2f}M "
            f"total, {counts['active'] / 1e6:.2f}M active | {fpt / 1e6:.3g} MFLOP/token | peak "
            f"{peak / 1e12:.3g} TFLOP/s/dev ({peak_source}){piped} | compiled in {compile_s:.1f}s"
            + (f" | resumed at step {start}" if start else ""))


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
