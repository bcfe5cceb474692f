"""Prompts and the tokenizer for a saved model: the tokenizer its training data was written with, and prompts cut
from the start of its held-out documents (what `make train` samples from after training)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moejax.data.sources import open_sources, parse_corpus, recorded_tokenizer
from moejax.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer


def tokenizer_for(cfg, model_dir: Path | None = None, spec: str | None = None) -> Tokenizer:
    """`spec` ("byte" or a tokenizer.json) when given; else MODEL_DIR/tokenizer.json where there is one (a Hugging
    Face directory); else the tokenizer the training data names (its token directories' index, or bytes for the
    embedded corpus). Raises TokenizerError when none is found or its ids exceed the model's vocabulary."""
    if spec is None and model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        spec = str(Path(model_dir) / "tokenizer.json")
    if spec is None:
        names = {recorded_tokenizer(path) for path, _ in _corpus_or_empty(cfg)}  # '' for a Megatron dataset
        if len(names) != 1 or not (names == {"byte"} or Path(next(iter(names))).is_file()):
            raise TokenizerError("cannot tell which tokenizer this model was trained with; name one with --tokenizer "
                                 "(byte or a tokenizer.json)")
        spec = names.pop()
    tok = load_tokenizer(spec)
    vocab = int(cfg.model.vocab_size)
    if tok.vocab_size > vocab:
        raise TokenizerError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocabulary is {vocab}: "
                             "not the tokenizer this model was trained with")
    return tok


def _corpus_or_empty(cfg):
    try:
        return parse_corpus(cfg.data.corpus)
    except Exception:  # noqa: BLE001 - a config without usable data names no tokenizer
        return []


def corpus_prompts(cfg, n: int, tokens: int = 32) -> list[list[int]]:
    """The first `tokens` ids of the first n held-out documents of the model's training data (BOS included), so a
    sample shows what the model learned to continue."""
    prompts = []
    for source in open_sources(cfg.data, vocab_size=int(cfg.model.vocab_size)):
        for shard in source.eval:
            starts = np.asarray(shard.doc_starts)
            for start in starts:
                doc = np.asarray(shard.tokens[start:start + tokens]).astype(np.int64)
                if len(doc) == tokens:
                    prompts.append(doc.tolist())
                if len(prompts) == n:
                    return prompts
    if not prompts:
        raise TokenizerError("the model's training data has no held-out documents to take prompts from; give --prompt")
    return prompts
