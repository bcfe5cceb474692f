"""moejax-data: text and JSONL into checked token directories (byte-level and Hugging Face tokenizers),
and a run that trains on two of them mixed by weight."""

import json
from pathlib import Path

import numpy as np
import pytest

from moejax.cli.data import main as data_main
from moejax.data.corpus import BOS_ID, EOS_ID, decode_bytes
from moejax.data.shards import open_token_dir
from tests.test_resume import STEPS, run



def hf_tokenizer_json(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tok.save(str(path))
    return path


def write_inputs(d: Path, n_docs: int = 30) -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    docs = [f"document {i}: " + "def f(x): return x * %d\n" % i * (5 + i % 7) for i in range(n_docs)]
    (d / "a.txt").write_text(docs[0])
    with open(d / "b.jsonl", "w") as f:
        for text in docs[1:]:
            f.write(json.dumps({"text": text, "id": 1}) + "\n")
    return docs


def test_byte_tokenize_round_trips_documents_into_shards(tmp_path, capsys):
    docs = write_inputs(tmp_path / "in")
    out = tmp_path / "tok"
    assert data_main(["tokenize", str(tmp_path / "in"), "--output", str(out), "--shard_tokens", "500",
                      "--eval_every_nth_doc", "10"]) == 0
    opened = open_token_dir(out)
    train, held_out = opened.splits["train"], opened.splits["eval"]
    assert len(train) > 3 and len(held_out) == 1  # small shards: several of them
    decoded = []
    for shard in train + held_out:
        bounds = list(shard.doc_starts) + [len(shard.tokens)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            doc = np.asarray(shard.tokens[a:b])
            assert doc[0] == BOS_ID and doc[-1] == EOS_ID
            decoded.append(decode_bytes(doc))
    assert sorted(decoded) == sorted(docs)  # every document once, whole, in one shard
    assert data_main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["vocab_size"] == 259 and summary["train"]["documents"] == 27 and summary["eval"]["documents"] == 3


def test_hf_tokenizer_json(tmp_path):
    docs = write_inputs(tmp_path / "in")
    words = sorted({w for d in docs for w in d.replace(":", " ").replace("(", " ").replace(")", " ").split()})
    tok = hf_tokenizer_json(tmp_path / "tokenizer.json", words)
    out = tmp_path / "tok"
    assert data_main(["tokenize", str(tmp_path / "in" / "b.jsonl"), "--output", str(out), "--tokenizer", str(tok),
                      "--eval_every_nth_doc", "0"]) == 0
    opened = open_token_dir(out)
    index = opened.index
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tok))
    assert index["bos_id"] == hf.token_to_id("<s>") and index["eos_id"] == hf.token_to_id("</s>")
    shard = opened.splits["train"][0]
    first = np.asarray(shard.tokens[: shard.doc_starts[1]])
    assert list(first) == [index["bos_id"], *hf.encode(docs[1], add_special_tokens=False).ids, index["eos_id"]]
    assert index["vocab_size"] == hf.get_vocab_size() and opened.max_id("train") < index["vocab_size"]


@pytest.mark.parametrize("case,message", [
    ("missing input", "does not exist"),
    ("not utf-8", "not UTF-8 text (byte 1)"),
    ("bad jsonl", "b.jsonl:2: not valid JSON"),
    ("jsonl without text", "b.jsonl:1: no string field 'text'"),
    ("output exists", "already exists; choose a new directory"),
    ("missing tokenizer", "tokenizer file"),
])
def test_moejax_data_bad_input_exits_2_with_one_line(case, message, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    out = tmp_path / "out"
    args = ["tokenize", str(src), "--output", str(out)]
    if case == "missing input":
        args[1] = str(tmp_path / "nope")
    elif case == "not utf-8":
        (src / "a.txt").write_bytes(b"a\xff\xfe")
    elif case == "bad jsonl":
        (src / "b.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    elif case == "jsonl without text":
        (src / "b.jsonl").write_text('{"body": "ok"}\n')
    elif case == "output exists":
        (src / "a.txt").write_text("hello")
        out.mkdir()
        (out / "keep").write_text("mine")
    elif case == "missing tokenizer":
        (src / "a.txt").write_text("hello")
        args += ["--tokenizer", str(tmp_path / "tokenizer.json")]
    assert data_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moejax-data: error: ") and message in err[0], err
    if case == "output exists":
        assert [p.name for p in out.iterdir()] == ["keep"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no half-written directory left


def test_training_on_two_token_directories_mixed(tmp_path):
    write_inputs(tmp_path / "code")
    (tmp_path / "prose").mkdir()
    (tmp_path / "prose" / "p.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400)
    for name in ("code", "prose"):
        assert data_main(["tokenize", str(tmp_path / name), "--output", str(tmp_path / f"{name}.tok"),
                          "--eval_every_nth_doc", "3"]) == 0
    corpus = f"{tmp_path / 'code.tok'}:3,{tmp_path / 'prose.tok'}:1"
    # test_resume's settings: the same compiled step (the data source is not part of it) comes from the cache.
    proc = run(tmp_path / "run", f"--config.data.corpus={corpus}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["corpus"] == corpus
