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
