"""Packed rows from the data pipeline never let a token see another document: in a real packed row of the
default corpus, replacing every token outside one document leaves that document's logits unchanged."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.tiny import get_config
from moejax.data.sources import open_sources
from moejax.data.packing import PackedWindows
from moejax.program.state import create_model


def test_pipeline_rows_do_not_attend_across_documents():
    cfg = get_config()
    cfg.model.n_layers = 2
    cfg.data.max_bytes = 200_000
    # Attention is what is under test. With a capacity limit, documents (and rows) also meet through expert
    # capacity: which tokens an over-full expert drops depends on the others. Never drop here.
    cfg.moe.capacity_factor = 0.0
    source = open_sources(cfg.data, vocab_size=cfg.model.vocab_size)[0]
    windows = PackedWindows(source.train, 64)
    # A row holding the end of one file and the start of the next (at least 3 segments when possible).
    row = next(w for w in (windows[i] for i in range(len(windows))) if w["segment_ids"].max() >= 1)
    tokens, segments = jnp.asarray(row["tokens"][None, :-1]), jnp.asarray(row["segment_ids"][None, :-1])
    assert int(segments.max()) >= 1
    model = create_model(cfg, 0)
    logits = nnx.jit(lambda m, t, s: m(t, s).logits_BxLxV)
    out = logits(model, tokens, segments)
    rng = np.random.default_rng(0)
    for seg in range(int(segments.max()) + 1):
        inside = np.asarray(segments[0] == seg)
        noise = jnp.asarray(rng.integers(0, 256, size=tokens.shape), dtype=tokens.dtype)
        changed = jnp.where(inside[None, :], tokens, noise)
        other = logits(model, changed, segments)
        np.testing.assert_allclose(other[0, inside], out[0, inside], atol=2e-5, err_msg=f"segment {seg}")
        if (~inside).any():  # the other documents did change: the comparison is not vacuous
            assert np.abs(np.asarray(other[0, ~inside] - out[0, ~inside])).max() > 1e-3
