"""The Python API (moejax.load_config / check_config / train / dry_run / plan) checks what the CLI checks and
raises where the CLI exits; launch/sweep.py trains through it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moejax
from moejax import api
from moejax.data.shards import DataError
from moejax.parallel.topology import TopologyError
from cpu_env import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.py"
SMALL = {"train.global_batch": 8, "train.seq_len": 32, "data.max_bytes": 1_000_000, "model.n_layers": 2,
         "mesh.data": 2, "mesh.expert": 4, "train.steps": 3, "train.log_every": 1, "train.eval_every": 0,
         "optim.warmup_steps": 1}


def test_load_config_applies_typed_overrides_and_names_mistakes():
    cfg = moejax.load_config(TINY, {"train.steps": 7, "optim.lr": 1e-3, "moe.dispatch": "allgather"})
    assert (cfg.train.steps, cfg.optim.lr, cfg.moe.dispatch) == (7, 1e-3, "allgather")
    with pytest.raises(moejax.ConfigError, match=r"^the config has no field train\.stepz; did you mean train\.steps\?$"):
        moejax.load_config(TINY, {"train.stepz": 7})
    with pytest.raises(moejax.ConfigError, match=r"^train\.steps='many'"):
        moejax.load_config(TINY, {"train.steps": "many"})
    with pytest.raises(moejax.ConfigError, match="does not exist"):
        moejax.load_config(ROOT / "configs" / "nope.py")
    with pytest.raises(AttributeError):  # locked, as --config is: no new fields by assignment
        cfg.train.stepz = 1


def test_check_config_composes_the_checks_of_every_layer(tmp_path):
    def check(**overrides):
        return moejax.check_config(moejax.load_config(TINY, overrides), 8)

    assert check() == {"stage": 1, "data": 2, "fsdp": 1, "context": 1, "expert": 4, "tensor": 1}
    with pytest.raises(moejax.ConfigError, match="do not divide by the fixed axes' product 3"):
        check(**{"mesh.expert": 3})
    with pytest.raises(TopologyError, match="mesh.topology='nvl9000' is not one of 'auto'"):
        check(**{"mesh.topology": "nvl9000"})
    with pytest.raises(DataError, match="smaller than the byte tokenizer"):
        check(**{"model.vocab_size": 100})
    with pytest.raises(DataError):
        check(**{"data.corpus": str(tmp_path / "no-such-tokens")})
    with pytest.raises(moejax.InputError, match="is neither a weights directory"):
        check(**{"checkpoint.init_from": str(tmp_path)})
    for error in (TopologyError, DataError, moejax.ConfigError):
        assert issubclass(error, moejax.InputError)


def test_dry_run_and_plan_refuse_bad_input_before_compiling(devices):
    cfg = moejax.load_config(TINY)
    with pytest.raises(moejax.ConfigError, match="not divisible by the batch-parallel size"):
        moejax.dry_run(cfg, 64)
    with pytest.raises(moejax.InputError, match="the dry run needs 64 devices"):
        moejax.dry_run(moejax.load_config(TINY, {"train.global_batch": 64}), 64)  # jax already runs 8 here
    # With an axis of -1 the dry run's device count is the smallest multiple of the other axes' product >= 8.
    assert api.mesh_device_count(cfg.mesh) == 8
    assert api.mesh_device_count(moejax.load_config(TINY, {"mesh.expert": 32}).mesh) == 32
    assert api.mesh_device_count(moejax.load_config(TINY, {"mesh.data": 3, "mesh.expert": 1}).mesh) == 3
    with pytest.raises(TopologyError):
        moejax.plan(cfg, topology="nope", gpus=[8])
    with pytest.raises(moejax.InputError, match="efficiency"):
        moejax.plan(cfg, topology="hgx-h100", gpus=[8], efficiency=2.0)
    with pytest.raises(moejax.InputError, match=r"remats\[0\]='some' is not one of"):
        moejax.plan(cfg, topology="hgx-h100", gpus=[8], remats=("some",))


# (arguments, the message's start); each raises before any layout is searched
BAD_PLAN_ARGUMENTS = [
    ({"gpus": -8}, "gpus=-8: must be an integer >= 1"),
    ({"gpus": "256"}, "gpus='256': must be an integer >= 1"),
    ({"gpus": 2.5}, "gpus=2.5: must be an integer >= 1"),
    ({"gpus": True}, "gpus=True: must be an integer >= 1"),
    ({"gpus": None}, "gpus=None: must be an integer >= 1"),
    ({"gpus": []}, "gpus=[]: give one value or a non-empty list of them"),
    ({"gpus": (8, 0)}, "gpus[1]=0: must be an integer >= 1"),
    ({"topology": "nvl9000"}, "unknown topology 'nvl9000'; known: gb300-nvl72"),
    ({"topology": ["hgx-h100"]}, "topology=['hgx-h100'] is not a topology name; known: gb300-nvl72"),
    ({"efficiency": float("nan")}, "efficiency=nan: must be a finite number in (0, 1]"),
    ({"efficiency": "0.5"}, "efficiency='0.5': must be a finite number in (0, 1]"),
    ({"domain_size": -1}, "domain_size=-1: must be an integer >= 0"),
    ({"mem_fraction": 1.5}, "mem_fraction=1.5: must be a finite number in (0, 1]"),
    ({"top": 0}, "top=0: must be an integer >= 1"),
    ({"remats": "some"}, "remats='some' is not one of 'none', 'full', 'dots'"),
    ({"remats": ()}, "remats=(): give one value or a non-empty list of them"),
    ({"dispatches": ["capacity", "teleport"]}, "dispatches[1]='teleport' is not one of"),
    ({"candidates": [8]}, "candidates[0]=8 is not a layout like"),
    ({"candidates": "ep=4,data=4"}, "layout 'ep=4,data=4' uses 16 GPUs, a count not in gpus=[8]"),
]


@pytest.mark.parametrize("arguments,message", BAD_PLAN_ARGUMENTS, ids=[m.split(":")[0].split(" is")[0]
                                                                       for _, m in BAD_PLAN_ARGUMENTS])
def test_plan_refuses_a_bad_argument_in_one_line(arguments, message):
    cfg = moejax.load_config(TINY)
    with pytest.raises(moejax.InputError) as e:
        moejax.plan(cfg, **{"topology": "hgx-h100", "gpus": 8, **arguments})
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_plan_dry_run_and_train_check_the_config_and_the_device_count(tmp_path):
    with pytest.raises(moejax.ConfigError, match=r"^optim\.lr=nan: must be a finite number >= 0"):
        moejax.plan(moejax.load_config(TINY, {"optim.lr": float("nan")}), topology="hgx-h100", gpus=8)
    with pytest.raises(moejax.ConfigError, match=r"^optim\.b2=1\.5: must be a finite number in \[0, 1\)$"):
        moejax.train(moejax.load_config(TINY, {"optim.b2": 1.5}), tmp_path / "run")  # before the job is joined
    assert not (tmp_path / "run").exists()
    for n, shown in ((-8, "-8"), ("8", "'8'"), (2.5, "2.5"), (True, "True")):
        with pytest.raises(moejax.InputError, match=rf"^n_devices={shown}: must be an integer >= 1"):
            moejax.dry_run(moejax.load_config(TINY), n)
    # the allocator share is a GPU run's: refused for an XLA:CPU compile, and outside (0, 1]
    with pytest.raises(moejax.InputError, match=r"^mem_fraction=0\.9 needs a GPU target"):
        moejax.dry_run(moejax.load_config(TINY), 8, mem_fraction=0.9)
    with pytest.raises(moejax.InputError, match=r"^mem_fraction=0: must be a finite number in \(0, 1\]"):
        moejax.dry_run(moejax.load_config(TINY), 8, "h200", mem_fraction=0)


def test_plan_ranks_layouts():
    result = moejax.plan(moejax.load_config(TINY), topology="hgx-h100", gpus=[8, 16], remats=("none",), top=2)
    assert [r["gpus"] for r in result["runs"]] == [8, 16]
    assert result["runs"][0]["best"] and result["runs"][0]["scaling_efficiency"] == 1.0
    # One count, one remat policy, one dispatch mode and one layout given as themselves, not as lists.
    one = moejax.plan(moejax.load_config(TINY), topology="hgx-h100", gpus=8, remats="none", dispatches="dropless",
                      top=2, candidates="ep=4,data=2,remat=none")
    assert [r["gpus"] for r in one["runs"]] == [8] and one["runs"][0]["best"] == result["runs"][0]["best"]
    assert len(one["runs"][0]["candidates"]) == 1


def _sweep(tmp_path, *values):
    sets = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = FAST_COMPILE  # no device-count flag: moejax adds it
    return subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), "--config", str(TINY),
                           "--field", "optim.lr", "--values", ",".join(values), "--workdir", str(tmp_path / "sweep"),
                           "--cpu_devices", "8", *sets], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)


def test_sweep_trains_each_value_through_the_api(tmp_path):
    proc = _sweep(tmp_path, "1e-3", "oops")  # a value of the wrong type stops the sweep before any training
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "optim.lr='oops'" in proc.stderr, proc.stderr
    assert not (tmp_path / "sweep").exists()

    proc = _sweep(tmp_path, "1e-3", "3e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert [r["value"] for r in runs] == [1e-3, 3e-3]
    for r in runs:  # moejax.train returned the run's last logged record
        last = json.loads(Path(r["workdir"], "metrics.jsonl").read_text().splitlines()[-1])
        assert r["step"] == last["step"] == 3 and r["loss"] == last["loss"] and r["mfu"] == last["mfu"]
        saved = json.loads(Path(r["workdir"], "config.json").read_text())
        assert saved["optim"]["lr"] == r["value"] and saved["train"]["steps"] == 3
    assert runs[0]["loss"] != runs[1]["loss"]

    # The API raises where moejax-train exits 2, before anything in WORKDIR is touched.
    workdir = Path(runs[0]["workdir"])
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    cfg = moejax.load_config(TINY, {**SMALL, "optim.lr": 1e-3, "model.d_model": 64})
    with pytest.raises(moejax.InputError, match="incompatible run .* model.d_model=128 there, 64 here"):
        moejax.train(cfg, workdir)
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*")} == before
