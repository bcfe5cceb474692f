"""Megatron-LM indexed datasets as `data.corpus`, against the reference: every dataset here is written by
megatron-core's own `IndexedDatasetBuilder` (the `megatron` extra; the module skips without it), the way
Megatron-LM's tools/preprocess_data.py calls it (`add_document(ids, sentence_lengths)`, then `finalize`), and read
by moejax: tokens, document offsets (documents of several sequences, an empty one), both blend syntaxes, the
checks before compile through `moejax-train` (exit 2, one line), the same batches as a token directory holding
the same documents, and a short training run on a prefix."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from moejax.config.schema import default_config
from moejax.data.megatron_indexed import read_megatron_index
from moejax.data.pipeline import eval_batches, train_batches
from moejax.data.shards import DataError, write_token_dir
from moejax.data.sources import check_data_config, open_sources, parse_corpus
from moejax.data.tokenizer import TokenizerError, byte_tokenizer
from moejax.inference.prompts import corpus_prompts, tokenizer_for
from tests.test_resume import STEPS, run
from cpu_env import cpu_env

with warnings.catch_warnings():  # megatron.core warns that Transformer Engine and Apex are absent (not needed here)
    warnings.simplefilter("ignore")
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")

# megatron.core's builder asks torch.distributed for a rank to log with; one process has none
pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning")
ROOT = Path(__file__).resolve().parents[1]
VOCAB = 264  # configs/tiny.py's model.vocab_size
SHAPE = dict(seq_len=32, global_batch=8)


def documents(n: int, seed: int = 0) -> list[np.ndarray]:
    """n byte-tokenised documents ([BOS] bytes EOS) of 5 to 300 tokens: many document ends inside a 33-token row."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "x", "the", "import", "moe", "expert", "(", ")", ":", "\n"]
    tok = byte_tokenizer()
    return [tok.encode_document(" ".join(rng.choice(words, size=int(rng.integers(1, 60)))))[:300] for _ in range(n)]


def write_megatron(prefix: Path, docs: list, dtype=np.uint16, seed: int = 0) -> str:
    """docs through megatron-core's builder, as preprocess_data.py --split-sentences does: each document split at
    random points into 1-3 sentences (sequences). An empty list is an empty document."""
    rng = np.random.default_rng(seed)
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        cuts = sorted(rng.choice(np.arange(1, len(doc)), size=min(len(doc) - 1, int(rng.integers(0, 3))),
                                 replace=False).tolist()) if len(doc) > 1 else []
        lengths = np.diff([0, *cuts, len(doc)]).tolist() if len(doc) else []
        builder.add_document([int(t) for t in doc], lengths)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def write_token_dir_split(path: Path, docs: list, every: int) -> str:
    """The same documents as `moejax-data tokenize --eval_every_nth_doc every` splits them, in one shard per split."""
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    held_out = [d for i, d in enumerate(docs) if i % every == every - 1]
    write_token_dir(path, {"train": train, "eval": held_out}, byte_tokenizer(), shard_tokens=1 << 40, sources=[])
    return str(path)


def data_config(corpus: str, **fields):
    cfg = default_config().data
    cfg.corpus = corpus
    for k, v in fields.items():
        cfg[k] = v
    return cfg


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_tokens_and_document_offsets_equal_what_was_written(tmp_path, dtype):
    docs = documents(40)
    docs[7] = np.zeros(0, np.int64)  # an empty document: no tokens, dropped
    prefix = write_megatron(tmp_path / "ds", docs, dtype)
    index = read_megatron_index(prefix)
    kept = [d for d in docs if len(d)]
    assert index.dtype == np.dtype(dtype).newbyteorder("<") and index.n_tokens == sum(map(len, kept))
    np.testing.assert_array_equal(index.doc_starts, np.cumsum([0] + [len(d) for d in kept[:-1]]))
    # Megatron's own reader sees sentence boundaries inside documents; moejax's offsets are the documents'.
    reference = indexed_dataset.IndexedDataset(prefix)
    assert len(reference.sequence_lengths) > len(kept) and len(reference.document_indices) == len(docs) + 1

    (source,) = open_sources(data_config(prefix, eval_every_nth_doc=0), vocab_size=VOCAB)
    (shard,) = source.train
    assert isinstance(shard.tokens, np.memmap) and shard.tokens.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(shard.tokens, np.concatenate(kept))
    np.testing.assert_array_equal(shard.doc_starts, index.doc_starts)
    assert source.eval == [] and source.max_id == max(int(d.max()) for d in kept)


def test_every_nth_document_is_held_out_and_the_fingerprint_follows_the_index(tmp_path):
    docs = documents(30)
    prefix = write_megatron(tmp_path / "ds", docs)
    (source,) = open_sources(data_config(prefix, eval_every_nth_doc=4), vocab_size=VOCAB)
    held_out = [d for i, d in enumerate(docs) if i % 4 == 3]
    train = [d for i, d in enumerate(docs) if i % 4 != 3]
    for (shard,), split in ((source.train, train), (source.eval, held_out)):
        np.testing.assert_array_equal(shard.tokens[0:len(shard.tokens)], np.concatenate(split))
        np.testing.assert_array_equal(shard.doc_starts, np.cumsum([0] + [len(d) for d in split[:-1]]))
        # Every slice (gathered across the held-out gaps) is the concatenated stream's slice.
        whole = np.concatenate(split)
        for a, b in ((0, 33), (5, 400), (len(whole) - 40, len(whole) + 10), (17, 17)):
            np.testing.assert_array_equal(shard.tokens[a:b], whole[a:b])
    # The same documents written again (a new mtime) keep the fingerprint; other documents, or another split, change it.
    again = write_megatron(tmp_path / "again", docs)
    other = write_megatron(tmp_path / "other", documents(30, seed=1))
    fingerprint = {name: open_sources(data_config(p, eval_every_nth_doc=n), vocab_size=VOCAB)[0].fingerprint
                   for name, p, n in (("again", again, 4), ("other", other, 4), ("split", prefix, 5))}
    assert fingerprint["again"] == source.fingerprint
    assert fingerprint["other"] != source.fingerprint and fingerprint["split"] != source.fingerprint


def test_the_same_batches_as_a_token_directory_of_the_same_documents(tmp_path):
    """The issue's acceptance, without training twice: train_batches and eval_batches of a Megatron dataset and of
    the token directory `moejax-data tokenize` would write from the same documents are equal, tokens and segment
    ids, for one source and for a blend of two (Megatron's syntax against moejax's)."""
    docs_a, docs_b = documents(60, seed=2), documents(50, seed=3)
    meg_a = write_megatron(tmp_path / "a", docs_a[:10] + [[]] + docs_a[10:])  # the empty document is not counted
    meg_b = write_megatron(tmp_path / "b", docs_b, np.int32)
    tok_a = write_token_dir_split(tmp_path / "a.tok", docs_a, 5)
    tok_b = write_token_dir_split(tmp_path / "b.tok", docs_b, 5)
    for megatron, tokens in ((meg_a, tok_a), (f"0.75 {meg_a} 0.25 {meg_b}", f"{tok_a}:0.75,{tok_b}:0.25")):
        opened = [open_sources(data_config(c, eval_every_nth_doc=5), vocab_size=VOCAB) for c in (megatron, tokens)]
        assert [s.weight for s in opened[0]] == [s.weight for s in opened[1]]
        train = [train_batches(s, **SHAPE, steps=40, seed=7, vocab_size=VOCAB) for s in opened]
        held_out = [eval_batches(s, **SHAPE, n_batches=4, vocab_size=VOCAB) for s in opened]
        assert len(train[0]) == len(train[1]) and len(held_out[0]) == len(held_out[1]) >= 2
        for i in range(40):
            for key in ("tokens", "segment_ids"):
                np.testing.assert_array_equal(train[0][i][key], train[1][i][key])
        for a, b in zip(*held_out):
            for key in ("tokens", "segment_ids"):
                np.testing.assert_array_equal(a[key], b[key])
        assert any(train[0][i]["segment_ids"].max() > 0 for i in range(40))  # rows do cross document ends


def test_sampling_prompts_come_from_held_out_documents_and_the_tokenizer_must_be_named(tmp_path):
    """The index records no tokenizer: moejax-generate asks for --tokenizer rather than guessing one."""
    docs = documents(40)
    cfg = default_config()
    cfg.data.corpus = write_megatron(tmp_path / "ds", docs)
    with pytest.raises(TokenizerError, match="cannot tell which tokenizer"):
        tokenizer_for(cfg)
    assert tokenizer_for(cfg, spec="byte").name == "byte"
    held_out = [d for i, d in enumerate(docs) if i % 20 == 19]
    assert corpus_prompts(cfg, 2, tokens=5) == [d[:5].tolist() for d in held_out]


def test_blend_syntax_both_spellings():
    assert parse_corpus("0.3 data/a 0.7 /x/b") == parse_corpus("data/a:0.3,/x/b:0.7") == [("data/a", 0.3),
                                                                                          ("/x/b", 0.7)]
    assert parse_corpus("30  a\t70 b") == [("a", 30.0), ("b", 70.0)]
    for bad, message in (("0.3 a 0.7", "pairs a weight with each path"), ("a b", "does not exist"),
                         ("0.3 a b 0.7", "pairs a weight with each path"), ("0 a 1 b", "must be positive")):
        with pytest.raises(DataError, match=message):
            check_data_config(data_config(bad), vocab_size=VOCAB)


def test_bad_index_files_are_one_line_errors(tmp_path):
    prefix = write_megatron(tmp_path / "ds", documents(5))
    idx = Path(f"{prefix}.idx")
    good = idx.read_bytes()
    n_seq = int.from_bytes(good[18:26], "little")
    cases = [(good[:9] + (2).to_bytes(8, "little") + good[17:], "index version 2"),
             (good + bytes(n_seq), "a multimodal dataset's sequence modes follow"),
             (good[:17] + bytes([7]) + good[18:], "declares float32 tokens"),
             (good + bytes(1), "is truncated or padded"),
             (good[:40], "is truncated or padded"),
             (good[:30], "shorter than the 34-byte header")]
    for content, message in cases:
        idx.write_bytes(content)
        with pytest.raises(DataError, match=message) as e:
            check_data_config(data_config(prefix), vocab_size=VOCAB)
        assert "\n" not in str(e.value)


def truncated_bin(tmp):
    prefix = write_megatron(tmp / "ds", documents(20))
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-6])
    return prefix


def wrong_magic(tmp):
    prefix = write_megatron(tmp / "ds", documents(20))
    Path(f"{prefix}.idx").write_bytes(b"TNTIDX\x00\x00" + Path(f"{prefix}.idx").read_bytes()[8:])
    return prefix


def ids_beyond_vocab(tmp):
    docs = documents(20)
    docs[3] = np.concatenate([docs[3], [300]])
    return write_megatron(tmp / "ds", docs)


def missing_idx(tmp):
    prefix = write_megatron(tmp / "ds", documents(20))
    Path(f"{prefix}.idx").unlink()
    return prefix


BAD_FILES = [("truncated .bin", truncated_bin, "ds.bin is truncated or padded"),
             ("wrong magic", wrong_magic, "ds.idx is not a Megatron index: it starts with b'TNTIDX"),
             ("ids beyond the vocabulary", ids_beyond_vocab, "holds token id 300, beyond model.vocab_size=264"),
             ("missing .idx", missing_idx, "ds.idx is missing")]


def test_bad_files_exit_2_with_one_line_before_compiling(tmp_path):
    started = {}
    for name, setup, _ in BAD_FILES:  # every row's moejax-train at once: each exits before compiling
        tmp = tmp_path / name.replace(" ", "_")
        tmp.mkdir()
        cmd = [sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/tiny.py"),
               "--workdir", str(tmp / "run"), f"--config.data.corpus={setup(tmp)}"]
        started[name] = (tmp / "run", subprocess.Popen(cmd, env=cpu_env(8), cwd=ROOT, stdout=subprocess.PIPE,
                                                       stderr=subprocess.PIPE, text=True))
    for (name, _, message), (workdir, proc) in zip(BAD_FILES, started.values()):
        _, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (name, err[-3000:])
        assert lines[0].startswith("moejax-train: error: ") and message in lines[0], (name, lines[0])
        assert not workdir.exists()


def test_a_megatron_dataset_trains_from_the_cli(tmp_path):
    """moejax-train on a prefix: test_resume's settings (their compiled step comes from the shared cache), the
    loss falls and the held-out documents are evaluated."""
    prefix = write_megatron(tmp_path / "corpus_text_document", documents(400, seed=4))
    proc = run(tmp_path / "run", f"--config.data.corpus={prefix}", "--config.train.eval_every=15",
               "--config.train.eval_batches=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] and "eval_loss" in records[14] and "eval_loss" in records[-1]
