"""The training loop: config -> mesh -> sharded state -> compiled step -> metrics, reading top to bottom.

The loop dispatches step t before it reads step t-1's metrics, so the host never stalls the device; step
time is the wall time between consecutive logged steps divided by the steps in between.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import numpy as np

from moejax.data.corpus import stdlib_token_streams
from moejax.data.pipeline import eval_batches, prefetching_iterator, train_batches
from moejax.model.accounting import flops_per_token, param_counts
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.train import metrics as M
from moejax.train.checkpoint import Checkpointer
from moejax.train.optim import make_optimizer
from moejax.train.state import abstract_state, init_state, model_graphdef, state_shardings
from moejax.train.step import jit_eval_step, jit_train_step

class NonFiniteLoss(RuntimeError):
    pass


def _global_batch(local_np, sharding):
    return jax.make_array_from_process_local_data(sharding, local_np)


def train(cfg, workdir: Path, mesh_sizes: dict[str, int]) -> dict:
    """Runs cfg.train.steps steps (resuming from WORKDIR/checkpoints); returns the last logged metrics."""
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    mesh = make_mesh(mesh_sizes)
    t = cfg.train
    n_devices = jax.device_count()

    train_tokens, eval_tokens = stdlib_token_streams(cfg.data.max_bytes, cfg.data.eval_every_nth_file)
    batches = train_batches(train_tokens, seq_len=t.seq_len, global_batch=t.global_batch, steps=t.steps,
                            seed=cfg.seed, process_index=jax.process_index(), process_count=jax.process_count())
    held_out = eval_batches(eval_tokens, seq_len=t.seq_len, global_batch=t.global_batch,
                            n_batches=t.eval_batches, process_index=jax.process_index(),
                            process_count=jax.process_count())

    tx = make_optimizer(cfg)
    graphdef = model_graphdef(cfg)
    checkpointer = Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep,
                                every_steps=cfg.checkpoint.every_steps)
    start = checkpointer.latest_step() or 0
    if start:
        abstract = abstract_state(cfg, tx)
        shardings = state_shardings(abstract, mesh)
        state = checkpointer.restore(start, abstract, shardings)
    else:
        state, shardings = init_state(cfg, tx, mesh, cfg.seed)

    in_sharding = batch_sharding(mesh)
    example = _global_batch(batches[0], in_sharding)
    compile_start = time.perf_counter()
    with jax.set_mesh(mesh):
        step_fn = jit_train_step(cfg, graphdef, tx, mesh, shardings).lower(state, example).compile()
        eval_fn = jit_eval_step(graphdef, mesh, shardings).lower(state, example).compile()
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
    data_iter = prefetching_iterator(batches, start)
    last = {}
    # Step time = wall time between logged steps, less the host time spent blocked on eval and saves.
    window = {"time": time.perf_counter(), "step": start, "excluded": 0.0}

    def eval_due(step_done):
        return t.eval_every > 0 and (step_done % t.eval_every == 0 or step_done == t.steps)

    def finish(step_done, device_metrics):
        nonlocal last
        eval_losses = device_metrics.pop("eval_losses", None)
        host = M.to_host(device_metrics)  # blocks until step_done is complete
        if not math.isfinite(host["loss"]):
            raise NonFiniteLoss(f"loss is {host['loss']} at step {step_done}")
        is_last = step_done == t.steps
        if not (step_done % t.log_every == 0 or eval_losses is not None or is_last):
            return
        now = time.perf_counter()
        step_time = (now - window["time"] - window["excluded"]) / max(1, step_done - window["step"])
        tpe = host.pop("tokens_per_expert", None)
        record = {"step": step_done, **host,
                  **M.throughput(step_time, tokens_per_step, fpt, n_devices, peak)}
        window.update(time=now, step=step_done, excluded=0.0)
        if eval_losses is not None:
            record["eval_loss"] = float(np.mean(jax.device_get(eval_losses)))
            window["excluded"] += time.perf_counter() - now
        if tpe is not None and is_last:
            record["tokens_per_expert"] = tpe
        if is_main:
            print(M.console_line(record, t.steps), flush=True)
        writer.write(record)
        last = record

    pending = None
    try:
        for step in range(start, t.steps):
            state, device_metrics = step_fn(state, _global_batch(next(data_iter), in_sharding))
            if eval_due(step + 1):  # dispatched now, on the state after step + 1, read in finish()
                device_metrics = {**device_metrics,
                                  "eval_losses": [eval_fn(state, _global_batch(b, in_sharding)) for b in held_out]}
            if pending is not None:
                finish(*pending)
            pending = (step + 1, device_metrics)
            if checkpointer.should_save(step + 1, t.steps):
                finish(*pending)  # read this step's time before the save blocks the host
                pending = None
                save_start = time.perf_counter()
                checkpointer.save(step + 1, state)
                window["excluded"] += time.perf_counter() - save_start
        if pending is not None:
            finish(*pending)
    finally:
        checkpointer.close()
        writer.close()
    return last


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
