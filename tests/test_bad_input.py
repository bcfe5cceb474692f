"""The README's bad-input table, row by row: `moejax-train` on bad data or settings exits 2 with one line on
stderr, before anything compiles, and leaves the workdir as it was. (Mesh, divisibility, dtype and sequence
length rows are in test_cli.py; incompatible workdirs in test_resume.py, damaged checkpoints in
test_checkpoint_integrity.py; NaN batches in test_guards.py.)"""

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from moejax.cli.data import main as data_main
from tests.test_data_files import hf_tokenizer_json
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]


def byte_dir(tmp: Path, name="tok") -> Path:
    (tmp / "in").mkdir(exist_ok=True)
    (tmp / "in" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    assert data_main(["tokenize", str(tmp / "in"), "--output", str(tmp / name), "--eval_every_nth_doc", "0"]) == 0
    return tmp / name


def rewrite_tokens(d: Path, edit, fix_index: bool):
    """Edits the first shard's tokens; with fix_index the index's CRC and max id follow (a consistent
    directory whose ids are wrong), without it the file no longer matches its index (corruption)."""
    index = json.loads((d / "index.json").read_text())
    shard = index["splits"]["train"][0]
    path = d / shard["tokens"]
    tokens = np.fromfile(path, dtype="<u2")
    tokens = edit(tokens)
    tokens.astype("<u2").tofile(path)
    if fix_index:
        shard["crc32_tokens"] = zlib.crc32(path.read_bytes())
        shard["max_id"] = int(tokens.max())
        (d / "index.json").write_text(json.dumps(index))


def corrupt(tmp):
    d = byte_dir(tmp)
    rewrite_tokens(d, lambda t: np.where(np.arange(len(t)) == 100, t ^ 1, t), fix_index=False)
    return [f"--config.data.corpus={d}"]


def truncated(tmp):
    d = byte_dir(tmp)
    path = next(d.glob("train-*.bin"))
    path.write_bytes(path.read_bytes()[:-10])
    return [f"--config.data.corpus={d}"]


def ids_beyond_vocab(tmp):
    d = byte_dir(tmp)
    rewrite_tokens(d, lambda t: np.where(np.arange(len(t)) == 100, 300, t), fix_index=True)
    return [f"--config.data.corpus={d}"]


def tokenizer_vocab_too_large(tmp):
    (tmp / "in").mkdir()
    words = [f"w{i}" for i in range(400)]
    (tmp / "in" / "a.txt").write_text(" ".join(words))
    tok = hf_tokenizer_json(tmp / "tokenizer.json", words)
    assert data_main(["tokenize", str(tmp / "in"), "--output", str(tmp / "tok"), "--tokenizer", str(tok),
                      "--eval_every_nth_doc", "0"]) == 0
    return [f"--config.data.corpus={tmp / 'tok'}"]


def index_not_json(tmp):
    d = byte_dir(tmp)
    (d / "index.json").write_text('{"format": "moejax-tokens/1", ')
    return [f"--config.data.corpus={d}"]


# (row id, setup(tmp) -> extra args, message); the README table lists the same rows.
ROWS = [
    ("corrupt token file", corrupt, "is corrupt: its CRC32 does not match"),
    ("truncated token file", truncated, "is truncated or padded"),
    ("token ids beyond the vocab", ids_beyond_vocab, "holds token id 300, beyond model.vocab_size=264"),
    ("tokenizer larger than the model", tokenizer_vocab_too_large,
     "was tokenised with 403 ids but model.vocab_size=264"),
    ("missing data path", lambda tmp: [f"--config.data.corpus={tmp / 'nowhere'}"], "does not exist (write one"),
    ("broken index", index_not_json, "is not valid JSON"),
    ("bad mixing weight", lambda tmp: [f"--config.data.corpus={byte_dir(tmp)}:heavy"], "is not a number"),
    ("keep 0 checkpoints", lambda tmp: ["--config.checkpoint.keep=0"], "checkpoint.keep=0: must be an integer >= 1"),
    ("guard off", lambda tmp: ["--config.guards.max_bad_steps=0"], "guards.max_bad_steps=0: must be an integer >= 1"),
    ("negative save interval", lambda tmp: ["--config.checkpoint.every_minutes=-1"],
     "checkpoint.every_minutes=-1.0: must be a finite number >= 0"),
    # every numeric field's range: tests/test_config_ranges.py (no subprocess); this row: NaN from the command line
    ("non-finite learning rate", lambda tmp: ["--config.optim.lr=nan"], "optim.lr=nan: must be a finite number >= 0"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every row's moejax-train run, started together (each exits before compiling)."""
    env = cpu_env(8)
    started = {}
    for name, setup, _ in ROWS:
        tmp = tmp_path_factory.mktemp(name.replace(" ", "_"))
        workdir = tmp / "run"
        workdir.mkdir()
        (workdir / "config.json").write_text("an earlier run's config\n")
        cmd = [sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
               "--workdir", str(workdir), *setup(tmp)]
        started[name] = (workdir, subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True))
    done = {}
    for name, (workdir, p) in started.items():
        out, err = p.communicate(timeout=300)
        done[name] = (workdir, p.returncode, out, err)
    return done


@pytest.mark.parametrize("name,message", [(r[0], r[2]) for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(outcomes, name, message):
    workdir, rc, _, err = outcomes[name]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("moejax-train: error: ") and message in lines[0], lines[0]
    assert rc == 2
    assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]
    assert (workdir / "config.json").read_text() == "an earlier run's config\n"
