"""Continue from released weights: HF checkpoint -> `moejax-convert import` -> `moejax-train` from the written
train_config.py on the (data=2, expert=4) mesh; the run starts from exactly the imported parameters. A
weights directory that does not fit the config, and a bad HF directory, exit 2 with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from cpu_env import cpu_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
ENV = cpu_env(8)


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Mixtral-format model big enough for the byte vocabulary, saved by transformers and imported."""
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(vocab_size=264, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=256)
    hf_dir = tmp_path_factory.mktemp("hf")
    transformers.MixtralForCausalLM(hf_cfg).save_pretrained(hf_dir)
    weights = tmp_path_factory.mktemp("w") / "weights_dir"
    proc = run("-m", "moejax.cli.convert", "import", "--hf_dir", str(hf_dir), "--out", str(weights),
               "--config", str(ROOT / "configs/tiny_mixtral.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return hf_dir, weights


SHORT = ["--config.train.steps=1", "--config.train.global_batch=8", "--config.train.seq_len=32",
         "--config.train.eval_every=0", "--config.data.max_bytes=300000", "--config.optim.lr=0.0",
         "--config.optim.weight_decay=0.0"]


def test_training_starts_from_the_imported_weights(imported, tmp_path):
    from moejax.interop import load_hf
    from moejax.training.checkpoint import Checkpointer
    from moejax.program.optim import make_optimizer
    from moejax.program.state import abstract_state, state_shardings
    from moejax.parallel.mesh import make_mesh

    hf_dir, weights = imported
    workdir = tmp_path / "run"
    proc = run("-m", "moejax.train", "--config", str(weights / "train_config.py"), "--workdir", str(workdir), *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((workdir / "config.json").read_text())
    assert cfg["checkpoint"]["init_from"] == str(weights) and cfg["model"]["n_kv_heads"] == 2
    # lr 0: the step-1 checkpoint holds the imported parameters, restored here from the sharded run.
    model, mcfg = load_hf(hf_dir)
    tx = make_optimizer(mcfg.optim)
    abstract = abstract_state(mcfg, tx)
    mesh = make_mesh({"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}, jax.devices()[:1])
    with mcfg.unlocked():
        mcfg.checkpoint.every_steps = 0
    state, _ = Checkpointer(workdir / "checkpoints", mcfg.checkpoint).restore(1, abstract, state_shardings(abstract, mesh))
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    got = nnx.to_pure_dict(state.params)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_weights_that_do_not_fit_the_config_exit_2(imported, tmp_path):
    _, weights = imported
    proc = run("-m", "moejax.train", "--config", str(weights / "train_config.py"), "--workdir", str(tmp_path / "r"),
               "--config.model.rope_theta=10000.0", *SHORT)
    assert proc.returncode == 2
    assert "model.rope_theta is 1000000.0 in the weights, 10000.0 in the config" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "r" / "config.json").exists()


def test_convert_bad_input_exits_2(imported, tmp_path):
    hf_dir, weights = imported
    proc = run("-m", "moejax.cli.convert", "import", "--hf_dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no config.json" in proc.stderr and proc.stderr.count("\n") == 1
    proc = run("-m", "moejax.cli.convert", "import", "--hf_dir", str(hf_dir), "--out", str(weights))
    assert proc.returncode == 2 and "already holds weights" in proc.stderr
    out = tmp_path / "export"
    assert run("-m", "moejax.cli.convert", "export", "--from", str(weights), "--hf_dir", str(out)).returncode == 0
    proc = run("-m", "moejax.cli.convert", "export", "--from", str(weights), "--hf_dir", str(out))
    assert proc.returncode == 2 and "already holds safetensors" in proc.stderr
    proc = run("-m", "moejax.cli.convert", "check", "--hf_dir", str(out), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["format"] == "mixtral"
