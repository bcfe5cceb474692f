"""The scheduler files parse, and say what moejax-train reads: SLURM detection and the JAX_* job variables."""

import subprocess
from pathlib import Path

import yaml

from moejax.training.distributed import detect_cluster

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


def test_sbatch_is_valid_bash_and_runs_one_task_per_gpu():
    path = LAUNCH / "slurm/nvl72.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    directives = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH --") and "=" in line)
    assert directives["ntasks-per-node"] == directives["gpus-per-node"] == "4"
    assert int(directives["nodes"]) % int(directives["segment"]) == 0
    assert "moejax-train" in text and "srun" in text


def test_slurm_and_env_jobs_are_detected():
    assert detect_cluster({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "128"}) == "slurm"
    assert detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None  # a 1-task allocation
    assert detect_cluster({"JAX_COORDINATOR_ADDRESS": "host:1234"}) == "env"
    assert detect_cluster({"OMPI_COMM_WORLD_SIZE": "16"}) == "openmpi"
    assert detect_cluster({}) is None


def test_jobset_parses_and_is_consistent():
    docs = list(yaml.safe_load_all((LAUNCH / "k8s/jobset.yaml").read_text()))
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    domain = next(d for d in docs if d["kind"] == "ComputeDomain")
    rack = jobset["spec"]["replicatedJobs"][0]
    job = rack["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    racks, trays = rack["replicas"], job["parallelism"]
    assert job["completions"] == trays and job["completionMode"] == "Indexed"
    assert int(env["TRAYS_PER_RACK"]) == trays
    assert int(env["JAX_NUM_PROCESSES"]) == racks * trays == domain["spec"]["numNodes"]
    name = jobset["metadata"]["name"]
    assert env["JAX_COORDINATOR_ADDRESS"].startswith(f"{name}-{rack['name']}-0-0.{name}:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "nvidia.com/gpu.clique" in jobset["metadata"]["annotations"].values()
    assert "moejax-train" in container["args"][0] and "JAX_PROCESS_ID" in container["args"][0]


def test_restart_policy_and_the_launchers_agree():
    """launch/local.py, the sbatch retry loop and the JobSet's pod failure policy restart after the same exits."""
    from moejax.training.restart_policy import FINAL, cause, should_restart

    assert [should_restart(c) for c in (0, 2, 3, 130, 143, -15)] == [False] * 6
    assert [should_restart(c) for c in (1, 4, 5, 6, 134, -6, -9, 137)] == [True] * 8
    assert cause(6) == "lost a peer process" and cause(-9) == "killed by SIGKILL" and cause(134) == "killed by SIGABRT"
    sbatch = (LAUNCH / "slurm/nvl72.sbatch").read_text()
    final_case = next(line.strip() for line in sbatch.splitlines() if 'exit "$code" ;;' in line)
    assert sorted(int(c) for c in final_case.split(")")[0].split("|")) == sorted(FINAL)
    jobset = next(d for d in yaml.safe_load_all((LAUNCH / "k8s/jobset.yaml").read_text()) if d["kind"] == "JobSet")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    fail_codes = [r["onExitCodes"]["values"] for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    # 130/143 are not in the pod policy: Kubernetes stops pods with SIGTERM, and a JobSet restart is then wanted
    assert fail_codes == [[c for c in sorted(FINAL) if c not in (0, 130, 143)]]
    rule = jobset["spec"]["failurePolicy"]["rules"][0]
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]


def test_the_launchers_give_xla_the_allocator_share_the_planner_budgets():
    """moejax-plan budgets XLA:GPU's scheduler at LAUNCH_MEM_FRACTION of each GPU's memory: the sbatch and the JobSet
    set that XLA_PYTHON_CLIENT_MEM_FRACTION."""
    import re

    from moejax.parallel.xla_gpu_flags import LAUNCH_MEM_FRACTION

    sbatch = (LAUNCH / "slurm/nvl72.sbatch").read_text()
    assert float(re.search(r"XLA_PYTHON_CLIENT_MEM_FRACTION:-([0-9.]+)", sbatch)[1]) == LAUNCH_MEM_FRACTION
    jobset = next(d for d in yaml.safe_load_all((LAUNCH / "k8s/jobset.yaml").read_text()) if d["kind"] == "JobSet")
    env = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert float(next(e["value"] for e in env if e["name"] == "XLA_PYTHON_CLIENT_MEM_FRACTION")) == LAUNCH_MEM_FRACTION
