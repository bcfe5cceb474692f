"""`moejax-eval` and `moejax.evaluate`: a saved model's loss per token and perplexity. A run's WORKDIR reproduces the
training loop's own last held-out loss; the loss per token is the mean cross-entropy over every predicted token
(checked against a plain forward pass); the overall line combines sources by their tokens; a weights directory and a
Hugging Face directory give the loss of the weights they hold; bad input exits 2 with one line."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from cpu_env import cpu_env
from flax import nnx

import moejax
from moejax.cli.data import main as data_main
from tests.test_bad_input import byte_dir, tokenizer_vocab_too_large

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
SMALL = ["--config.train.global_batch=8", "--config.train.seq_len=32", "--config.train.log_every=4",
         f"--config.train.eval_every={STEPS}", "--config.train.eval_batches=3", "--config.optim.warmup_steps=2",
         "--config.data.max_bytes=300000", "--config.model.n_layers=2", "--config.model.d_model=64",
         "--config.model.head_dim=16", "--config.model.d_ff=128", "--config.moe.d_ff_expert=32",
         f"--config.train.steps={STEPS}", "--config.hardware.peak_tflops=1"]
# The batch shape every comparison below evaluates with (the run's own).
SHAPE = dict(seq_len=32, global_batch=8)


def python(*args, **popen):
    return subprocess.Popen([sys.executable, *args], env=cpu_env(8), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finished(proc) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """configs/tiny.py, shrunk, trained STEPS steps with a held-out eval after the last (its checkpoint too)."""
    workdir = tmp_path_factory.mktemp("eval") / "run"
    rc, _, err = finished(python("-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"), "--workdir",
                                 str(workdir), *SMALL))
    assert rc == 0, err[-3000:]
    return workdir


@pytest.fixture(scope="module")
def token_dirs(tmp_path_factory):
    """Two byte-tokenised directories unlike each other: Python-like code (what the run trained on) in long
    documents, and short documents of random words (many document ends inside a row: unequal token counts)."""
    tmp = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    (tmp / "code").mkdir()
    for i in range(40):
        lines = [f"def f{i}_{j}(x, y):\n    return x * {j} + y  # {i}\n" for j in range(int(rng.integers(4, 20)))]
        (tmp / "code" / f"m{i}.py").write_text("".join(lines))
    words = ["zq", "xv", "jjk", "wub", "qop", "vex", "kri"]
    with open(tmp / "words.jsonl", "w") as f:
        for _ in range(600):
            f.write(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(2, 8))))}) + "\n")
    for name, source in (("code", tmp / "code"), ("words", tmp / "words.jsonl")):
        assert data_main(["tokenize", str(source), "--output", str(tmp / f"tok_{name}"),
                          "--eval_every_nth_doc", "4"]) == 0
    return tmp / "tok_code", tmp / "tok_words"


def last_eval_loss(workdir) -> tuple[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in records if "eval_loss" in r][-1]
    return last["step"], last["eval_loss"]


def test_workdir_reproduces_the_loops_last_held_out_loss(run):
    step, eval_loss = last_eval_loss(run)
    result = moejax.evaluate(run)
    assert step == STEPS and result["step"] == STEPS and result["model"] == f"checkpoint {STEPS} of {run}"
    assert result["split"] == "eval" and result["max_batches"] == 3 and result["sources"][0]["batches"] == 3
    assert result["training_eval_loss"] == pytest.approx(eval_loss, rel=1e-5, abs=0)
    # The run learnt something, so the comparison is not one of two untrained models' ln(vocab).
    assert eval_loss < math.log(264) - 0.3
    # One source: its batches are the loop's, and the token-weighted loss is near the batch mean.
    assert result["sources"][0]["batch_mean_loss"] == result["training_eval_loss"]
    assert result["overall"]["loss"] == pytest.approx(eval_loss, rel=1e-3)
    assert result["overall"]["perplexity"] == pytest.approx(math.exp(result["overall"]["loss"]))


def test_loss_per_token_is_the_mean_over_every_predicted_token(run, token_dirs):
    """Against a plain forward pass: log-softmax of the logits at every target inside its row and document."""
    from moejax.data.pipeline import eval_batches
    from moejax.data.sources import open_sources
    from moejax.inference.evaluate import evaluate_model
    from moejax.inference.load import load_model

    loaded = load_model(run)
    words = str(token_dirs[1])
    result = evaluate_model(loaded, [words], max_batches=3, **SHAPE)
    data_cfg = loaded.cfg.data.copy_and_resolve_references()
    with data_cfg.unlocked():
        data_cfg.corpus = words
    batches = eval_batches(open_sources(data_cfg, vocab_size=264), n_batches=3, vocab_size=264, **SHAPE)
    forward = nnx.jit(lambda model, tokens, segments: model(tokens, segments).logits_BxLxV)
    nll, mask = [], []
    for batch in batches:
        tokens, segments = batch["tokens"], batch["segment_ids"]
        with jax.set_mesh(loaded.mesh):
            logits = forward(loaded.model, tokens[:, :-1], segments[:, :-1])
        logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
        nll.append(-np.take_along_axis(np.asarray(logp), tokens[:, 1:, None], axis=-1)[..., 0])
        mask.append(segments[:, 1:] == segments[:, :-1])
    nll, mask = np.stack(nll), np.stack(mask)
    per_batch = mask.sum(axis=(1, 2))
    assert len(set(per_batch.tolist())) > 1, per_batch  # the document ends make the batches' weights differ
    assert result["sources"][0]["tokens"] == mask.sum()
    assert result["sources"][0]["loss"] == pytest.approx(nll[mask].mean(), rel=2e-6)  # a plain mean of the batch means: 1.4e-5 off
    # The train split: other rows of the same source, so another loss.
    on_train = evaluate_model(loaded, [words], split="train", max_batches=3, **SHAPE)
    assert on_train["split"] == "train" and on_train["sources"][0]["tokens"] > 0
    assert on_train["sources"][0]["loss"] != result["sources"][0]["loss"]


def test_cli_prints_and_writes_per_source_and_token_weighted_overall(run, token_dirs, tmp_path):
    out = tmp_path / "eval.json"
    rc, stdout, err = finished(python("-m", "moejax.cli.eval", str(run), "--data", *map(str, token_dirs),
                                      "--max_batches", "4", "--json", str(out), "--config.mesh.expert=2"))
    assert rc == 0, err[-3000:]
    result = json.loads(out.read_text())
    assert result["mesh"]["expert"] == 2 and result["mesh"]["data"] == 4  # the override: another mesh
    sources = result["sources"]
    assert [s["source"] for s in sources] == [str(d) for d in token_dirs] and "training_eval_loss" not in result
    assert all(s["batches"] == 4 and 0 < s["tokens"] <= 4 * 8 * 32 for s in sources)
    # The sources differ in loss and in tokens, so a plain mean of the two would not pass.
    assert abs(sources[0]["loss"] - sources[1]["loss"]) > 0.05 and sources[0]["tokens"] != sources[1]["tokens"]
    tokens = sum(s["tokens"] for s in sources)
    assert result["overall"]["tokens"] == tokens and result["overall"]["batches"] == 8
    assert result["overall"]["loss"] == pytest.approx(sum(s["loss"] * s["tokens"] for s in sources) / tokens,
                                                      rel=1e-12)
    table = stdout.splitlines()
    assert table[0].startswith(f"checkpoint {STEPS} of {run}") and table[1].split() == ["source", "tokens",
                                                                                         "loss/token", "perplexity"]
    for line, row in zip(table[2:], [*sources, {"source": "overall", **result["overall"]}]):
        assert line.split() == [row["source"], f"{row['tokens']:,}", f"{row['loss']:.4f}", f"{row['perplexity']:.2f}"]


def test_weights_directory_gives_the_checkpoints_loss(run, token_dirs, tmp_path):
    from moejax.inference.load import load_model
    from moejax.interop.weights_dir import save_weights

    checkpoint = run / "checkpoints" / str(STEPS)
    loaded = load_model(checkpoint)
    _, params, model_state = nnx.split(loaded.model, nnx.Param, ...)
    save_weights(tmp_path / "weights", loaded.cfg, params, model_state)
    data = str(token_dirs[0])
    from_checkpoint = moejax.evaluate(checkpoint, data, max_batches=3, **SHAPE)
    from_weights = moejax.evaluate(tmp_path / "weights", data, max_batches=3, **SHAPE)
    assert from_weights["model"] == f"weights directory {tmp_path / 'weights'}" and from_weights["step"] is None
    assert from_weights["overall"]["tokens"] == from_checkpoint["overall"]["tokens"] > 0
    assert from_weights["overall"]["loss"] == pytest.approx(from_checkpoint["overall"]["loss"], rel=1e-6)


def test_hugging_face_directory_gives_the_loss_of_the_weights_it_was_exported_from(token_dirs, tmp_path):
    """The tiny run's shared experts have no HF format: a Qwen3-MoE-style model, saved as moejax weights and as
    safetensors (save_hf needs no torch), each loaded onto its own config's mesh."""
    from moejax.interop.hf_checkpoint import save_hf
    from moejax.interop.weights_dir import save_weights
    from moejax.program.state import create_model

    cfg = moejax.load_config(ROOT / "configs/tiny_qwen3_moe.py", {
        "model.n_layers": 2, "model.first_k_dense": 1, "model.d_model": 64, "model.head_dim": 16,
        "model.d_ff": 128, "moe.d_ff_expert": 32})
    model = create_model(cfg, 3)
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    save_weights(tmp_path / "weights", cfg, params, model_state)
    save_hf(model, cfg, tmp_path / "hf")
    data = str(token_dirs[0])
    from_weights = moejax.evaluate(tmp_path / "weights", data, max_batches=2, **SHAPE)
    from_hf = moejax.evaluate(tmp_path / "hf", data, max_batches=2, **SHAPE)
    assert from_hf["model"] == f"Hugging Face directory {tmp_path / 'hf'}"
    assert from_hf["mesh"] != from_weights["mesh"]  # the HF config's default mesh: data over all devices
    assert from_hf["overall"]["tokens"] == from_weights["overall"]["tokens"] > 0
    assert from_hf["overall"]["loss"] == pytest.approx(from_weights["overall"]["loss"], rel=1e-5)


def test_a_checkpoint_saved_with_pipeline_stages_loads_in_layer_order(tmp_path):
    """3 MoE layers over 2 stages: stored in padded chunk slots (one identity slot). Loaded for inference (no stages),
    every parameter and router bias equals the layer-order model the checkpoint was made from."""
    from moejax.config import validate
    from moejax.inference.load import load_model
    from moejax.parallel.mesh import mesh_from_config
    from moejax.program.state import create_model, restack, state_shardings
    from moejax.training.checkpoint import Checkpointer

    shrunk = {"model.n_layers": 4, "model.d_model": 64, "model.head_dim": 16, "model.d_ff": 128,
              "moe.d_ff_expert": 32, "train.global_batch": 16}
    layered = moejax.load_config(ROOT / "configs/tiny.py", shrunk)
    piped = moejax.load_config(ROOT / "configs/tiny.py", {**shrunk, "mesh.stage": 2, "train.micro_batches": 2})
    model = create_model(layered, 5)
    with jax.set_mesh(mesh := mesh_from_config(piped, validate(piped, 8))):
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        _, a_params, a_state = nnx.split(nnx.eval_shape(lambda: create_model(piped, 0)), nnx.Param, ...)
        abstract = {"params": a_params, "model_state": a_state}
        in_slots = restack({"params": params, "model_state": model_state}, abstract, state_shardings(abstract, mesh),
                           mesh, layered, piped)
    slots = in_slots["params"]["moe_layers"]["ffn"]["w_up_ExDxF"].shape[0]
    assert (params["moe_layers"]["ffn"]["w_up_ExDxF"].shape[0], slots) == (3, 4)  # 3 layers in 4 slots
    saver = Checkpointer(tmp_path / "run" / "checkpoints", piped.checkpoint)
    saver.save(3, in_slots, meta={"step": 3}, config_json=piped.to_json_best_effort(sort_keys=True))
    saver.close()
    loaded = load_model(tmp_path / "run")
    assert loaded.step == 3 and loaded.mesh.shape["stage"] == 1 and loaded.cfg.mesh.stage == 1
    expected, got = nnx.state(model), nnx.state(loaded.model)
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for path, want in jax.tree.leaves_with_path(expected):
        np.testing.assert_array_equal(np.asarray(dict(jax.tree.leaves_with_path(got))[path]), np.asarray(want),
                                      err_msg=jax.tree_util.keystr(path))


def vocab_too_large(run, tmp):
    tokenizer_vocab_too_large(tmp)  # test_bad_input's row: 403 ids into tmp/tok
    return [str(run), "--data", str(tmp / "tok")]


def not_a_model(run, tmp):
    (tmp / "notes").mkdir()
    (tmp / "notes" / "config.json").write_text("{}")
    return [str(tmp / "notes")]


def no_checkpoint(run, tmp):
    (tmp / "started" / "checkpoints" / "10.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save cut short
    return [str(tmp / "started")]


def corrupt_checkpoint(run, tmp, manifest=True):
    """The run's checkpoint with its largest array file cut in half (its integrity manifest finds it; without one,
    as saved before moejax wrote them, orbax's restore does)."""
    copy = tmp / str(STEPS)
    shutil.copytree(run / "checkpoints" / str(STEPS), copy)
    biggest = max((copy / "state" / "d").iterdir(), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    if not manifest:
        (copy / "integrity.json").unlink()
    return [str(copy)]


def empty_data(run, tmp):
    (tmp / "empty").mkdir()
    return [str(run), "--data", str(tmp / "empty")]


# (row id, setup(run, tmp) -> arguments, what the one line says)
BAD = [
    ("missing path", lambda run, tmp: [str(tmp / "nowhere")], "nowhere does not exist"),
    ("not a model", not_a_model, "is not a training run (WORKDIR with checkpoints/), a checkpoint"),
    ("run without checkpoints", no_checkpoint, "holds no complete checkpoint"),
    ("corrupt checkpoint", corrupt_checkpoint, "is incomplete or corrupt (state/d/"),
    ("corrupt checkpoint without a manifest", lambda run, tmp: corrupt_checkpoint(run, tmp, manifest=False),
     "does not restore ("),
    ("missing data", lambda run, tmp: [str(run), "--data", str(tmp / "nodata")], "nodata does not exist"),
    ("empty data directory", empty_data, "empty has no index.json"),
    ("data without a held-out split", lambda run, tmp: [str(run), "--data", str(byte_dir(tmp))],
     "has no full batch in its eval split (8 rows of 33 tokens); try split 'train'"),
    ("vocabulary larger than the model's", vocab_too_large, "was tokenised with 403 ids but model.vocab_size=264"),
    ("an override of the model's shape", lambda run, tmp: [str(run), "--config.model.d_model=32"],
     "the override model.d_model changes the model"),
    ("a batch the mesh does not fit", lambda run, tmp: [str(run), "--global_batch", "12"],
     "train.global_batch=12 is not divisible by the batch-parallel size"),
]


def test_bad_input_exits_2_with_one_line(run, tmp_path):
    started = {}
    for name, setup, _ in BAD:
        tmp = tmp_path / name.replace(" ", "_").replace("'", "")
        tmp.mkdir()
        started[name] = python("-m", "moejax.cli.eval", *setup(run, tmp))
    for name, _, message in BAD:
        rc, _, err = finished(started[name])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, f"{name}: {err[-3000:]}"
        assert lines[0].startswith("moejax-eval: error: ") and message in lines[0], f"{name}: {lines[0]}"
        assert rc == 2, name
