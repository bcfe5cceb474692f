"""Which exits of moejax-train a supervisor restarts the job after, and how it names their cause.

A restart helps when the failure is outside the run (a process or node lost, a hang, a crash, a failed join):
the job resumes from the newest checkpoint. It does not help, and is not done, after bad input (2: the same
config fails again), too many non-finite steps (3: the same data and state give the same NaN), or a stop someone
asked for (130/143: SIGINT/SIGTERM, the checkpoint is saved; a scheduler that preempts requeues the job itself).
launch/local.py --max_restarts, launch/slurm/nvl72.sbatch (its retry loop) and launch/k8s/jobset.yaml (its
pod failure policy) follow this table; tests/test_launch_files.py checks that they agree.
"""

from __future__ import annotations

import signal

LOST_PEER = 6  # moejax-train's exit when another process of the job is gone (peer_monitor.py)
# exit code -> why the job ends for good
FINAL = {0: "done", 2: "bad configuration or input", 3: "too many consecutive non-finite steps",
         130: "stopped by SIGINT", 143: "stopped by SIGTERM"}
# exit code -> cause, for the restartable codes moejax itself documents
KNOWN = {4: "could not join the multi-process job", 5: "watchdog: no step finished within guards.step_timeout_s",
         LOST_PEER: "lost a peer process"}


def cause(code: int) -> str:
    """What an exit code says (a negative code: killed by that signal, as Python's subprocess reports it)."""
    if code in FINAL:
        return FINAL[code]
    if code in KNOWN:
        return KNOWN[code]
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if signum:
        try:
            return f"killed by {signal.Signals(signum).name}"
        except ValueError:
            pass
    return f"crashed (exit code {code})"


def should_restart(code: int) -> bool:
    # a signal a supervisor itself sends to stop a job (SIGINT/SIGTERM seen as -2/-15) is a stop, not a failure
    return code not in FINAL and code not in (-signal.SIGINT, -signal.SIGTERM)
