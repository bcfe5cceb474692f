"""What `data.corpus` names, opened and checked: the embedded stdlib corpus, or token directories with weights.

`data.corpus` is `stdlib` (the default: the Python standard library's sources, tokenised bytewise at run
time) or a comma-separated list `DIR[:WEIGHT]` of directories written by `moejax-data tokenize`, mixed in
proportion to their weights (default 1). Every check that can fail on bad input runs here, before compile.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from moejax.data.corpus import BOS_ID, BYTE_VOCAB, stdlib_token_streams
from moejax.data.packing import bos_doc_starts
from moejax.data.shards import DataError, TokenShard, open_token_dir, read_index


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    train: list[TokenShard]
    eval: list[TokenShard]
    vocab_size: int  # of the tokenizer that wrote it
    max_id: int  # the largest id in the data
    fingerprint: str  # changes when the data changes; a resumed run must read the same data


def parse_corpus(spec: str) -> list[tuple[str, float]]:
    """'stdlib' -> [('stdlib', 1.0)]; 'a:0.7,b:0.3' -> [('a', 0.7), ('b', 0.3)]."""
    entries = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            raise DataError(f"data.corpus={spec!r}: empty entry; use 'stdlib' or DIR[:WEIGHT],DIR[:WEIGHT]")
        path, sep, weight = part.rpartition(":")
        if not sep or "/" in weight:  # no weight given (or a ':' inside the path)
            path, weight = part, "1"
        try:
            w = float(weight)
        except ValueError:
            raise DataError(f"data.corpus: weight {weight!r} of {path} is not a number") from None
        if not w > 0:
            raise DataError(f"data.corpus: weight {weight} of {path} must be positive")
        entries.append((path, w))
    if len(entries) > 1 and any(p == "stdlib" for p, _ in entries):
        raise DataError("data.corpus: 'stdlib' cannot be mixed with token directories")
    return entries


def _stdlib_source(data_cfg) -> Source:
    train, held_out = stdlib_token_streams(data_cfg.max_bytes, data_cfg.eval_every_nth_file)
    fingerprint = f"stdlib:{data_cfg.max_bytes}:{data_cfg.eval_every_nth_file}:{len(train)}"
    return Source("stdlib", 1.0, [TokenShard(train, bos_doc_starts(train, BOS_ID))],
                  [TokenShard(held_out, bos_doc_starts(held_out, BOS_ID))], BYTE_VOCAB, int(train.max()),
                  fingerprint)


def _token_dir_source(path: str, weight: float, verify_checksums: bool) -> Source:
    opened = open_token_dir(Path(path), verify_checksums=verify_checksums)
    if not opened.splits.get("train"):
        raise DataError(f"data source {path} has no train split")
    index_text = json.dumps(opened.index, sort_keys=True)
    return Source(str(Path(path)), weight, opened.splits["train"], opened.splits.get("eval", []),
                  opened.vocab_size, max(opened.max_id("train"), opened.max_id("eval")),
                  "tokens:" + hashlib.sha256(index_text.encode()).hexdigest()[:16])


def open_sources(data_cfg, *, vocab_size: int) -> list[Source]:
    """Opens every source of data.corpus and checks its ids fit model.vocab_size."""
    entries = parse_corpus(data_cfg.corpus)
    if entries == [("stdlib", 1.0)]:
        sources = [_stdlib_source(data_cfg)]
    else:
        sources = [_token_dir_source(p, w, bool(data_cfg.verify_checksums)) for p, w in entries]
    for s in sources:
        if s.vocab_size > vocab_size:
            raise DataError(f"data source {s.name} was tokenised with {s.vocab_size} ids but model.vocab_size="
                            f"{vocab_size}; use the tokenizer's vocabulary size (or larger)")
        if s.max_id >= vocab_size:
            raise DataError(f"data source {s.name} holds token id {s.max_id}, beyond model.vocab_size={vocab_size}")
    return sources


def check_data_config(data_cfg, *, vocab_size: int):
    """The cheap part of open_sources, for validation before anything compiles: data.corpus parses, its
    directories and indexes exist, and the byte tokenizer's ids fit the model's vocabulary. (The token files
    themselves are opened and checked against the vocabulary by open_sources.)"""
    for path, _ in parse_corpus(data_cfg.corpus):
        if path == "stdlib" and vocab_size < BYTE_VOCAB:
            raise DataError(f"model.vocab_size={vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB} ids")
        if path != "stdlib":
            read_index(Path(path))


def data_fingerprint(sources: list[Source]) -> str:
    return ",".join(f"{s.fingerprint}@{s.weight:g}" for s in sources)
