"""What the tools over a saved model (moejax-eval, moejax-generate) do around their call into the API: bad input
is one line and exit 2, a job that cannot be joined exit 4; process 0 prints the result and writes it as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from moejax.cli.bad_input_exit import exit_bad_input_now


def add_job_flags(parser: argparse.ArgumentParser):
    """The flags that join a multi-process job, as moejax-train's (training/distributed.py reads them)."""
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-process jobs)")
    parser.add_argument("--num_processes", type=int, help="processes in the job")
    parser.add_argument("--process_id", type=int, help="this process's index in [0, num_processes)")
    parser.add_argument("--init_timeout", type=int, default=300, help="seconds to wait for every process to join")


def job_flags(args: argparse.Namespace) -> dict:
    """add_job_flags' values, as the API's keyword arguments (moejax.api.load_for_inference)."""
    return {k: getattr(args, k) for k in ("coordinator", "num_processes", "process_id", "init_timeout")}


def run_inference_command(prog: str, call: Callable[[], dict], render: Callable[[dict], str],
                          json_out: str | None) -> int:
    """call() -> the API's result dict; render(result) -> the text to print. Returns the exit code."""
    from moejax.errors import InputError
    from moejax.training.distributed import DistributedError

    try:
        result = call()
    except InputError as e:
        exit_bad_input_now(prog, e)
    except DistributedError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 4
    import jax

    if jax.process_index() == 0:
        print(render(result), flush=True)
        if json_out:
            Path(json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
