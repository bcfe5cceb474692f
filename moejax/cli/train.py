"""`moejax-train --config configs/tiny.py [--config.a.b=v ...] --workdir DIR` (also `python -m moejax.train`).

Exit codes: 0 done; 2 bad configuration or input, including processes of one job that disagree, bad data
and a WORKDIR holding an incompatible run or no checkpoint that passes its integrity check (one line on
stderr, nothing in DIR overwritten; a damaged newest checkpoint alone is passed over, or refused with
checkpoint.on_bad_checkpoint=refuse); 3 too many consecutive non-finite steps; 4 could not join the
multi-process job; 5 the watchdog saw no step finish within guards.step_timeout_s; 6 another process of the job
is gone (a collective failed on a lost peer, or its heartbeat stopped for guards.peer_timeout_s); 130/143 stopped by
SIGINT/SIGTERM after saving a checkpoint; anything else is a crash (a native one, e.g. SIGSEGV in a library,
first writes every thread's Python stack to stderr).

Multi-process jobs: pass --coordinator HOST:PORT --num_processes N --process_id I, or set
JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or run under SLURM/Open MPI (detected).
"""

from __future__ import annotations

import faulthandler
import logging
import sys
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from moejax.cli.bad_input_exit import exit_bad_input_now
from moejax.cli.config_flag import UsageError, parse_config

FLAGS = flags.FlagValues()
config_flags.DEFINE_config_file("config", None, "ml_collections config file, e.g. configs/tiny.py",
                                flag_values=FLAGS, lock_config=True)
flags.DEFINE_string("workdir", None, "directory for metrics.jsonl, config.json, checkpoints/ and tb/",
                    flag_values=FLAGS)

flags.DEFINE_string("coordinator", None, "HOST:PORT of process 0 (multi-process jobs)", flag_values=FLAGS)
flags.DEFINE_integer("num_processes", None, "processes in the job", flag_values=FLAGS)
flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)", flag_values=FLAGS)
flags.DEFINE_integer("init_timeout", 300, "seconds to wait for every process to join and agree", flag_values=FLAGS)
flags.DEFINE_bool("dry_run", False, "compile the train step for an emulated mesh with abstract state and compare "
                  "XLA's memory/FLOPs/collectives with moejax-plan's prediction; trains nothing", flag_values=FLAGS)
flags.DEFINE_integer("dry_run_devices", 0, "emulated devices for --dry_run (0: the product of the mesh axes; "
                     "with an axis of -1, the smallest multiple of the others' product that is >= 8)",
                     flag_values=FLAGS)
flags.DEFINE_string("dry_run_target", "", "compile --dry_run for NVIDIA GPUs with XLA:GPU on this machine, no GPU "
                    "needed: h200 | b200 | gb300 (needs the gpu extra); empty: emulated CPU devices",
                    flag_values=FLAGS)

flags.DEFINE_float("dry_run_mem_fraction", None, "with --dry_run_target: compile with the memory budget XLA:GPU's "
                   "scheduler has in a GPU run at XLA_PYTHON_CLIENT_MEM_FRACTION=this (launch/ sets 0.95; without "
                   "it a deviceless compile budgets 80% of the GPU's memory) and say whether the program fits that "
                   "allocator", flag_values=FLAGS)

PROG = "moejax-train"


def _usage_error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    # A segfault or abort inside XLA, orbax's tensorstore or the profiler kills the process with no Python
    # traceback; this makes it print which thread was where (job logs are often all there is to go on).
    if sys.__stderr__ is not None and not faulthandler.is_enabled():  # the process's own stderr, even in a notebook
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    argv = list(sys.argv if argv is None else argv)
    try:
        cfg = parse_config(FLAGS, argv, __doc__, "configs/tiny.py")
    except UsageError as e:
        return _usage_error(str(e))
    if cfg is None:  # --help
        return 0
    from moejax.config.ranges import check_ranges  # jax-free: a bad number is refused before jax loads
    from moejax.errors import InputError

    try:
        check_ranges(cfg)
    except InputError as e:
        return _usage_error(str(e))
    if FLAGS.dry_run:
        return _dry_run(cfg)
    if not FLAGS.workdir:
        return _usage_error("--workdir is required")

    from moejax import api
    from moejax.training.distributed import DistributedError
    from moejax.training.loop import LostPeer, NonFiniteLoss, Stopped
    from moejax.training.peer_monitor import lost_peer_exit

    try:  # bad config, data or WORKDIR: exit 2 before anything is compiled or written
        run = api.prepare_training(cfg, FLAGS.workdir, coordinator=FLAGS.coordinator,
                                   num_processes=FLAGS.num_processes, process_id=FLAGS.process_id,
                                   init_timeout=FLAGS.init_timeout)
    except InputError as e:
        return _usage_error(str(e))
    except DistributedError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 4

    if run.emulated_cpu_devices:
        print(f"no accelerator found: {run.emulated_cpu_devices} CPU devices emulate the mesh (set XLA_FLAGS="
              f"--xla_force_host_platform_device_count=N to choose)", flush=True)
    print(run.kernels, flush=True)
    if run.xla_flags:
        print(run.xla_flags, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        api.run_training(run)
    except InputError as e:  # found only once reading or restoring: still bad input
        exit_bad_input_now(PROG, e)
    except NonFiniteLoss as e:
        print(f"{PROG}: stopped: {e}", file=sys.stderr)
        return 3
    except LostPeer as e:  # at once: jax's shutdown would wait for the dead process, then abort (134)
        lost_peer_exit(str(e))
    except Stopped as e:  # preempted: the checkpoint is saved; the shell's usual code for the signal
        print(f"{PROG}: {e}", file=sys.stderr)
        return 128 + e.signum
    return 0


def _dry_run(cfg) -> int:
    """--dry_run: emulate the mesh's devices on CPU (before jax starts), compile, report."""
    import json

    from moejax import api
    from moejax.errors import InputError

    # tokamax logs every autotuning-cache miss (no device to autotune on in a deviceless compile).
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        report = api.dry_run(cfg, FLAGS.dry_run_devices or None, FLAGS.dry_run_target or None,
                             FLAGS.dry_run_mem_fraction)
    except InputError as e:
        return _usage_error(str(e))
    from moejax.planner.dry_run import format_report

    print(format_report(report))
    if FLAGS.workdir:
        Path(FLAGS.workdir).mkdir(parents=True, exist_ok=True)
        (Path(FLAGS.workdir) / "dry_run.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
