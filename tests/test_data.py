"""The embedded corpus and the grain pipeline: real text, deterministic by seed, disjoint per process,
packed rows whose segment ids mark every document boundary, weighted mixing, and a resumable iterator."""

import numpy as np
import pytest

from moejax.data.corpus import BOS_ID, EOS_ID, decode_bytes, stdlib_token_streams
from moejax.data.packing import PackedWindows, bos_doc_starts
from moejax.data.pipeline import BatchIterator, eval_batches, train_batches
from moejax.data.shards import DataError, TokenShard
from moejax.data.sources import Source, parse_corpus


def source(tokens, doc_starts=None, *, weight=1.0, name="s", eval_tokens=None):
    tokens = np.asarray(tokens)
    starts = np.array([0]) if doc_starts is None else np.asarray(doc_starts)
    held_out = [] if eval_tokens is None else [TokenShard(eval_tokens, np.array([0]))]
    return Source(name, weight, [TokenShard(tokens, starts)], held_out, 1 << 16, int(tokens.max()), name)


KW = dict(seq_len=16, global_batch=8, steps=20, seed=3, vocab_size=1 << 16)


def test_corpus_is_python_source_with_document_markers():
    train, held_out = stdlib_token_streams(max_bytes=300_000, eval_every_nth_file=5)
    assert train.dtype == np.uint16 and train.max() <= EOS_ID
    assert train[0] == BOS_ID and train[-1] == EOS_ID
    text = decode_bytes(train[:20000])
    assert "def " in text and "import " in text
    # Held-out documents are whole files that never appear in the training stream.
    first_doc = held_out[1 : np.argmax(held_out == EOS_ID)].tobytes()
    assert first_doc and first_doc not in train.tobytes()


def test_train_batches_deterministic_and_shards_disjoint():
    src = [source(np.arange(10_000, dtype=np.uint16))]
    a, b = train_batches(src, **KW), train_batches(src, **KW)
    np.testing.assert_array_equal(a[7]["tokens"], b[7]["tokens"])
    assert a[7]["tokens"].shape == a[7]["segment_ids"].shape == (8, 17)
    assert not np.array_equal(a[7]["tokens"], train_batches(src, **{**KW, "seed": 4})[7]["tokens"])
    p0 = train_batches(src, **KW, process_index=0, process_count=2)
    p1 = train_batches(src, **KW, process_index=1, process_count=2)
    starts0 = {int(w[0]) for i in range(10) for w in p0[i]["tokens"]}
    starts1 = {int(w[0]) for i in range(10) for w in p1[i]["tokens"]}
    assert p0[0]["tokens"].shape == (4, 17) and not starts0 & starts1
    # Together the two processes read exactly the one-process global batch, in order.
    np.testing.assert_array_equal(np.concatenate([p0[7]["tokens"], p1[7]["tokens"]]), a[7]["tokens"])
    # Windows are consecutive tokens: targets are inputs shifted by one.
    np.testing.assert_array_equal(np.diff(a[0]["tokens"][0]), 1)


def test_every_window_once_per_epoch():
    tokens = np.arange(16 * 80 + 1, dtype=np.uint16)  # exactly 80 windows of 16 (+1)
    batches = train_batches([source(tokens)], **{**KW, "steps": 10})  # 10 x 8 = one epoch
    starts = [int(w[0]) for i in range(10) for w in batches[i]["tokens"]]
    assert sorted(starts) == list(range(0, 16 * 80, 16))


def test_segment_ids_mark_every_document_boundary():
    # Documents of lengths 5, 30, 3, 40: BOS-led, as the corpus and moejax-data write them.
    lengths = [5, 30, 3, 40]
    docs = [np.concatenate([[BOS_ID], np.full(n - 2, 7 + i), [EOS_ID]]) for i, n in enumerate(lengths)]
    tokens = np.concatenate(docs).astype(np.uint16)
    starts = bos_doc_starts(tokens, BOS_ID)
    np.testing.assert_array_equal(starts, np.cumsum([0] + lengths[:-1]))
    windows = PackedWindows([TokenShard(tokens, starts)], 16)
    doc_of = np.searchsorted(starts, np.arange(len(tokens)), side="right")
    for i in range(len(windows)):
        w = windows[i]
        pos = np.arange(i * 16, i * 16 + 17)
        # Same segment id <=> same document, and ids start at 0 and only step up at a document start.
        same = w["segment_ids"][:, None] == w["segment_ids"][None, :]
        np.testing.assert_array_equal(same, doc_of[pos][:, None] == doc_of[pos][None, :])
        assert w["segment_ids"][0] == 0
        assert np.all((np.diff(w["segment_ids"]) == 1) == (w["tokens"][1:] == BOS_ID))


def test_mixing_follows_weights_and_is_deterministic():
    a = source(np.full(16 * 200 + 1, 1, np.uint16), name="a", weight=3.0)
    b = source(np.full(16 * 200 + 1, 2, np.uint16), name="b", weight=1.0)
    batches = train_batches([a, b], **{**KW, "steps": 50})
    firsts = np.array([w[0] for i in range(50) for w in batches[i]["tokens"]])
    assert abs(np.mean(firsts == 1) - 0.75) < 0.02
    again = train_batches([a, b], **{**KW, "steps": 50})
    np.testing.assert_array_equal(again[31]["tokens"], batches[31]["tokens"])


def test_iterator_state_resumes_without_repeats_or_gaps():
    src = [source(np.arange(16 * 100 + 1, dtype=np.uint16))]
    batches = train_batches(src, **{**KW, "steps": 12})
    it = BatchIterator(batches)
    straight = [next(it)["tokens"] for _ in range(12)]
    first = BatchIterator(batches)
    seen = [next(first)["tokens"] for _ in range(5)]
    state = first.get_state()
    assert state == {"next_batch": 5}
    resumed = BatchIterator(batches, **state)
    seen += [next(resumed)["tokens"] for _ in range(7)]
    for x, y in zip(straight, seen):
        np.testing.assert_array_equal(x, y)
    rows = [tuple(r) for b in seen for r in b]
    assert len(rows) == len(set(rows)) == 12 * 8  # 96 of the 100 windows: none twice, none skipped


def test_token_ids_beyond_the_vocab_are_refused():
    src = [source(np.full(16 * 10 + 1, 300, np.uint16))]
    batches = train_batches(src, **{**KW, "vocab_size": 264, "steps": 1})
    with pytest.raises(DataError, match="token id 300, outside model.vocab_size=264"):
        batches[0]
    with pytest.raises(DataError, match="token id 300"):  # also through the read-ahead threads
        next(BatchIterator(batches))


def test_why_ids_are_checked_an_id_beyond_the_table_embeds_as_nan():
    import jax.numpy as jnp
    from flax import nnx

    from moejax.model.layers import Embed

    embed = Embed(264, 8, rngs=nnx.Rngs(0), std=0.02)
    out = np.asarray(embed(jnp.array([[5, 300]]), jnp.float32))
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1]).all()


def test_eval_batches_fixed():
    src = [source(np.arange(1000, dtype=np.uint16), eval_tokens=np.arange(1000, dtype=np.uint16))]
    kw = dict(seq_len=10, global_batch=4, n_batches=3, vocab_size=1 << 16)
    e1, e2 = eval_batches(src, **kw), eval_batches(src, **kw)
    assert len(e1) == 3 and all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(e1, e2))
    np.testing.assert_array_equal(e1[0]["tokens"][0], np.arange(11))


def test_parse_corpus():
    assert parse_corpus("stdlib") == [("stdlib", 1.0)]
    assert parse_corpus("/d/a:0.7,/d/b") == [("/d/a", 0.7), ("/d/b", 1.0)]
    for bad, msg in (("a:x", "not a number"), ("a:0", "must be positive"), ("a,,b", "empty entry"),
                     ("stdlib,a", "cannot be mixed")):
        with pytest.raises(DataError, match=msg):
            parse_corpus(bad)
