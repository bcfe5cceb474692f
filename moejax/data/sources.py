"""What `data.corpus` names, opened and checked: the embedded stdlib corpus, or token directories and Megatron
indexed datasets with weights.

`data.corpus` is `stdlib` (the default: the Python standard library's sources, tokenised bytewise at run
time) or a list of sources mixed in proportion to their weights: moejax's comma-separated `PATH[:WEIGHT]` (default
weight 1) or Megatron's space-separated `WEIGHT PATH WEIGHT PATH ...` (its --data-path blend). A PATH is a
directory written by `moejax-data tokenize` or a Megatron prefix (PATH.bin + PATH.idx). Every check that can
fail on bad input runs here, before compile.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from moejax.data.corpus import BOS_ID, BYTE_VOCAB, stdlib_token_streams
from moejax.data.document_runs import split_every_nth_document
from moejax.data.megatron_indexed import (is_megatron_prefix, largest_token_id, open_megatron_tokens,
                                          read_megatron_index)
from moejax.data.packing import bos_doc_starts
from moejax.data.shards import DataError, TokenShard, open_token_dir, read_index


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    train: list[TokenShard]
    eval: list[TokenShard]
    vocab_size: int  # of the tokenizer that wrote it; 0: not recorded (a Megatron dataset)
    max_id: int  # the largest id in the data; -1: not scanned (a Megatron dataset with data.verify_checksums off)
    fingerprint: str  # changes when the data changes; a resumed run must read the same data


def parse_corpus(spec: str) -> list[tuple[str, float]]:
    """'stdlib' -> [('stdlib', 1.0)]; 'a:0.7,b:0.3' and Megatron's '0.7 a 0.3 b' -> [('a', 0.7), ('b', 0.3)]."""
    words = str(spec).split()
    if "," not in str(spec) and len(words) > 1 and _is_number(words[0]):
        return _megatron_blend(spec, words)
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
        entries.append((path, _positive(w, weight, path)))
    return _no_stdlib_in_a_mix(entries)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _positive(w: float, shown: str, path: str) -> float:
    if not w > 0:
        raise DataError(f"data.corpus: weight {shown} of {path} must be positive")
    return w


def _no_stdlib_in_a_mix(entries: list[tuple[str, float]]) -> list[tuple[str, float]]:
    if len(entries) > 1 and any(p == "stdlib" for p, _ in entries):
        raise DataError("data.corpus: 'stdlib' cannot be mixed with token directories")
    return entries


def _megatron_blend(spec: str, words: list[str]) -> list[tuple[str, float]]:
    """Megatron's --data-path blend, 'W1 PATH1 W2 PATH2 ...'. Megatron's weightless list of paths (mixed in
    proportion to their sizes) is refused rather than read with other weights."""
    if len(words) % 2 or not all(_is_number(w) for w in words[::2]) or any(_is_number(p) for p in words[1::2]):
        raise DataError(f"data.corpus={spec!r}: Megatron's blend syntax pairs a weight with each path, "
                        "'0.3 PATH_A 0.7 PATH_B'; or use PATH_A:0.3,PATH_B:0.7")
    return _no_stdlib_in_a_mix([(p, _positive(float(w), w, p)) for w, p in zip(words[::2], words[1::2])])


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


def _megatron_source(prefix: str, weight: float, data_cfg) -> Source:
    """A Megatron dataset, memory-mapped; every data.eval_every_nth_doc-th document held out (it has no eval split),
    its ids scanned once when data.verify_checksums (its index records no largest id)."""
    index = read_megatron_index(prefix)
    if not len(index.doc_starts):
        raise DataError(f"Megatron dataset {prefix} holds no tokens")
    tokens = open_megatron_tokens(index)
    n = int(data_cfg.get("eval_every_nth_doc", 20))  # a run's config saved before the field existed: its default
    train, held_out = split_every_nth_document(tokens, index.doc_starts, n)
    max_id = largest_token_id(tokens, f"Megatron dataset {prefix}") if data_cfg.verify_checksums else -1
    # The .idx holds every sequence's length and every document boundary: a cheap hash that changes with them.
    fingerprint = f"megatron:{index.sha256[:16]}:{index.n_tokens}:{n}"
    return Source(prefix, weight, [train], [held_out] if held_out else [], 0, max_id, fingerprint)


def _is_token_dir(path: str) -> bool:
    """A token directory, or else a Megatron prefix; neither: DataError."""
    if Path(path).is_dir():
        return True
    if is_megatron_prefix(path):
        return False
    raise DataError(f"data source {path} does not exist (write one with `moejax-data tokenize`, or name a Megatron "
                    f"dataset's prefix: {path}.bin + {path}.idx)")


def open_sources(data_cfg, *, vocab_size: int) -> list[Source]:
    """Opens every source of data.corpus and checks its ids fit model.vocab_size."""
    entries = parse_corpus(data_cfg.corpus)
    if entries == [("stdlib", 1.0)]:
        sources = [_stdlib_source(data_cfg)]
    else:
        sources = [_token_dir_source(p, w, bool(data_cfg.verify_checksums)) if _is_token_dir(p)
                   else _megatron_source(p, w, data_cfg) for p, w in entries]
    for s in sources:
        if s.vocab_size > vocab_size:
            raise DataError(f"data source {s.name} was tokenised with {s.vocab_size} ids but model.vocab_size="
                            f"{vocab_size}; use the tokenizer's vocabulary size (or larger)")
        if s.max_id >= vocab_size:
            raise DataError(f"data source {s.name} holds token id {s.max_id}, beyond model.vocab_size={vocab_size}")
    return sources


def check_data_config(data_cfg, *, vocab_size: int):
    """The cheap part of open_sources, for validation before anything compiles: data.corpus parses, its
    directories and indexes exist (a Megatron index is read whole and checked against its .bin's size), and the
    byte tokenizer's ids fit the model's vocabulary. (The token files themselves are opened and checked against
    the vocabulary by open_sources.)"""
    for path, _ in parse_corpus(data_cfg.corpus):
        if path == "stdlib":
            if vocab_size < BYTE_VOCAB:
                raise DataError(f"model.vocab_size={vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB} ids")
        elif _is_token_dir(path):
            read_index(Path(path))
        else:
            read_megatron_index(path)


def recorded_tokenizer(path: str) -> str:
    """The tokenizer a source of data.corpus was written with: 'byte' for stdlib, a token directory's index's
    entry, '' for a Megatron dataset (its index records none)."""
    if path == "stdlib":
        return "byte"
    return str(read_index(Path(path)).get("tokenizer", "")) if _is_token_dir(path) else ""


def data_fingerprint(sources: list[Source]) -> str:
    return ",".join(f"{s.fingerprint}@{s.weight:g}" for s in sources)
