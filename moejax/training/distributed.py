"""Joining a multi-process JAX job, and checking that every process runs the same thing.

One process per GPU (or per tray, or per CPU-emulated host in tests). The job is found from, in order:
explicit flags (--coordinator/--num_processes/--process_id), JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES,
JAX_PROCESS_ID; what our Kubernetes JobSet sets), or a scheduler JAX detects itself (SLURM, Open MPI).
No sign of a job means a single process, and nothing is initialised.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import jax

from moejax.errors import InputError


class DistributedError(RuntimeError):
    """The process could not join the job; the message says why."""


class ProcessesDisagree(InputError, DistributedError):
    """The processes of one job run different configs or devices (bad input: moejax-train exits 2)."""


def detect_cluster(env=os.environ) -> str | None:
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "env"
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    return None


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               timeout_s: int) -> str | None:
    """Joins the job if there is one (returns how it was found), else returns None. Call before any jax use."""
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    how = "flags" if explicit else detect_cluster()
    if how is None:
        return None
    if explicit and None in (coordinator, num_processes, process_id):
        raise DistributedError("--coordinator, --num_processes and --process_id go together; give all three")
    # CPU devices talk through gloo across processes (tests, laptops); GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", f"the {how} job's coordinator")
    if process_id and coordinator:
        # XLA's coordination client aborts the whole process (no Python exception) when it cannot connect,
        # so first wait for the coordinator's port ourselves and fail with a message we control.
        wait_for_port(coordinator, timeout_s)
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - jax raises several types; all mean "could not join"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"could not join the job at {where} within {timeout_s}s ({first})") from e
    return how


def wait_for_port(address: str, timeout_s: float):
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(f"could not join the job at {address} within {timeout_s}s: "
                                       f"nothing accepts connections there ({e.strerror or e})") from e
            time.sleep(0.5)


def _fingerprint(config_json: str) -> dict:
    return {"config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
            "local_devices": jax.local_device_count(), "platform": jax.local_devices()[0].platform,
            "config": json.loads(config_json)}


def _first_difference(a, b, prefix="") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"{prefix.rstrip('.')}: {a!r} here vs {b!r} there"


def check_processes_agree(config_json: str, timeout_s: int):
    """Every process publishes its config and device count through the coordinator's key-value store
    and compares with every other; any difference stops all of them with the first differing field."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    mine = _fingerprint(config_json)
    client.key_value_set(f"moejax/fingerprint/{jax.process_index()}", json.dumps(mine))
    for other in range(jax.process_count()):
        try:
            theirs = json.loads(client.blocking_key_value_get(f"moejax/fingerprint/{other}", timeout_s * 1000))
        except Exception as e:  # noqa: BLE001
            raise ProcessesDisagree(f"process {other} did not report its config within {timeout_s}s") from e
        for key in ("local_devices", "platform"):
            if theirs[key] != mine[key]:
                raise ProcessesDisagree(f"process {other} has {key}={theirs[key]} but process "
                                       f"{jax.process_index()} has {mine[key]}; every process must match")
        if theirs["config_sha256"] != mine["config_sha256"]:
            diff = _first_difference(mine["config"], theirs["config"])
            raise ProcessesDisagree(f"process {other}'s config differs from process {jax.process_index()}'s "
                                   f"({diff}); every process must run the same config")
