"""`moejax-data tokenize` on the formats Hugging Face users bring (parquet, `datasets.save_to_disk` directories, an
already tokenized `input_ids` column) and in parallel workers: the token directory is byte for byte the one the
same documents give from .jsonl in one process; bad input is one line and exit 2 with nothing left behind."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu_env import cpu_env
from moejax.cli.data import main as data_main
from moejax.data.shards import open_token_dir

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 7 + 1) for i in range(60)]


def _same_directory(a: Path, b: Path):
    """Every token and document file equal byte for byte; the index equal except the input paths it records."""
    files_a, files_b = sorted(p.name for p in a.iterdir()), sorted(p.name for p in b.iterdir())
    assert files_a == files_b
    for name in files_a:
        if name == "index.json":
            ia, ib = (json.loads((d / name).read_text()) for d in (a, b))
            ia.pop("sources"), ib.pop("sources")
            assert ia == ib
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _tokenize(*args) -> int:
    return data_main(["tokenize", "--shard_tokens", "2000", "--eval_every_nth_doc", "5", *map(str, args)])


@pytest.fixture(scope="module")
def jsonl_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert _tokenize(root / "docs.jsonl", "--output", root / "tokens") == 0
    return root


def test_parquet_and_datasets_directories_give_the_jsonl_tokens(jsonl_reference, tmp_path):
    from datasets import Dataset, DatasetDict

    reference = jsonl_reference / "tokens"
    table = pa.table({"id": list(range(len(TEXTS))), "body": TEXTS})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=7)  # several row groups
    assert _tokenize(tmp_path / "docs.parquet", "--text_key", "body", "--output", tmp_path / "from_parquet") == 0
    _same_directory(tmp_path / "from_parquet", reference)
    Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved", num_shards=3)
    assert _tokenize(tmp_path / "saved", "--output", tmp_path / "from_saved") == 0
    _same_directory(tmp_path / "from_saved", reference)
    # A DatasetDict: its splits in the listed order, one input.
    DatasetDict({"a": Dataset.from_dict({"text": TEXTS[:25]}), "b": Dataset.from_dict({"text": TEXTS[25:]})}).save_to_disk(
        tmp_path / "dict")
    assert _tokenize(tmp_path / "dict", "--output", tmp_path / "from_dict") == 0
    _same_directory(tmp_path / "from_dict", reference)


def test_input_ids_column_is_taken_as_is(tmp_path):
    rs = np.random.RandomState(0)
    docs = [rs.randint(0, 259, rs.randint(5, 40)).tolist() for _ in range(30)]
    pq.write_table(pa.table({"input_ids": docs, "text": ["ignored"] * 30}), tmp_path / "ids.parquet")
    assert _tokenize(tmp_path / "ids.parquet", "--output", tmp_path / "tokens", "--eval_every_nth_doc", "0") == 0
    opened = open_token_dir(tmp_path / "tokens")
    shard, = opened.splits["train"]
    assert np.array_equal(np.asarray(shard.tokens), np.concatenate(docs))
    assert np.array_equal(np.asarray(shard.doc_starts), np.cumsum([0] + [len(d) for d in docs[:-1]]))


def test_two_workers_write_what_one_writes(tmp_path):
    """With a Hugging Face tokenizer.json (the tokenizer the workers rebuild) and the byte tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(0, len(TEXTS), 10):  # several files, a directory walked in path order
        (corpus / f"part{i:03d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[i:i + 10]))
    for spec in (str(tmp_path / "tokenizer.json"), "byte"):
        outs = []
        for workers in (1, 2):
            out = tmp_path / f"w{workers}-{Path(spec).stem}"
            assert _tokenize(corpus, "--output", out, "--tokenizer", spec, "--workers", workers) == 0
            outs.append(out)
        _same_directory(*outs)


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_text.parquet")
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"input_ids": [[1, 2, 300]]}), tmp_path / "big_ids.parquet")
    (tmp_path / "broken.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" * 2 + "{not json\n")
    cases = [
        (tmp_path / "no_text.parquet", "no column 'text' (nor 'input_ids'); its columns: body"),
        (tmp_path / "fake.parquet", "not a parquet file"),
        (tmp_path / "big_ids.parquet", "token id 300, beyond the tokenizer's vocabulary of 259"),
        (tmp_path / "broken.jsonl", "broken.jsonl:3: not valid JSON"),  # found after a document was written
    ]
    for i, (source, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert _tokenize(source, "--output", out, "--workers", "1") == 2, source
        err = capsys.readouterr().err.strip().splitlines()
        assert [line for line in err if "error" in line] == [err[-1]] and message in err[-1], (source, err)
        assert not out.exists() and not list(tmp_path.glob(f".out{i}.tmp-*")), source


def test_a_parquet_dataset_trains_the_tiny_config(jsonl_reference, tmp_path):
    """The token directory a parquet file gives trains from the command line (its batches are those of the jsonl
    one: the directories are byte for byte the same, test above)."""
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "docs.parquet")
    assert _tokenize(tmp_path / "docs.parquet", "--output", tmp_path / "tokens") == 0
    run = subprocess.run(
        [sys.executable, "-m", "moejax.cli.train", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"),
         f"--config.data.corpus={tmp_path / 'tokens'}", "--config.train.steps=2", "--config.train.seq_len=32",
         "--config.train.global_batch=8", "--config.model.n_layers=2", "--config.model.d_model=64",
         "--config.model.head_dim=16", "--config.model.d_ff=128", "--config.moe.d_ff_expert=32",
         "--config.train.log_every=1", "--config.train.eval_every=0", "--config.checkpoint.every_steps=0"],
        cwd=ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2] and all(np.isfinite(r["loss"]) for r in lines if "loss" in r)
