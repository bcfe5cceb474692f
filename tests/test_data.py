"""The embedded corpus and the grain pipeline: real text, deterministic by seed, disjoint per process."""

import numpy as np

from moejax.data.corpus import BOS_ID, EOS_ID, decode_bytes, stdlib_token_streams
from moejax.data.pipeline import TokenWindows, eval_batches, train_batches


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
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(seq_len=16, global_batch=8, steps=20, seed=3)
    a, b = train_batches(tokens, **kw), train_batches(tokens, **kw)
    np.testing.assert_array_equal(a[7], b[7])
    assert a[7].shape == (8, 17)
    assert not np.array_equal(a[7], train_batches(tokens, **{**kw, "seed": 4})[7])
    p0 = train_batches(tokens, **kw, process_index=0, process_count=2)
    p1 = train_batches(tokens, **kw, process_index=1, process_count=2)
    starts0 = {int(w[0]) for i in range(10) for w in p0[i]}
    starts1 = {int(w[0]) for i in range(10) for w in p1[i]}
    assert p0[0].shape == (4, 17) and not starts0 & starts1
    # Together the two processes read exactly the one-process global batch, in order.
    np.testing.assert_array_equal(np.concatenate([p0[7], p1[7]]), a[7])
    # Windows are consecutive tokens: targets are inputs shifted by one.
    w = a[0][0]
    np.testing.assert_array_equal(np.diff(w), 1)


def test_eval_batches_fixed_and_window_count():
    tokens = np.arange(1000, dtype=np.uint16)
    assert len(TokenWindows(tokens, 10)) == 99
    e1 = eval_batches(tokens, seq_len=10, global_batch=4, n_batches=3)
    e2 = eval_batches(tokens, seq_len=10, global_batch=4, n_batches=3)
    assert len(e1) == 3 and all(np.array_equal(x, y) for x, y in zip(e1, e2))
