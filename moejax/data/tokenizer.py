"""Tokenizers for `moejax-data`: the built-in byte tokenizer, or any local Hugging Face `tokenizer.json`.

A tokenizer here turns one document's text into ids and names the ids that mark document boundaries.
Documents are written as `[BOS] ids EOS` (BOS only where the tokenizer has one), so packed rows carry
their boundaries in the token stream as well as in the shard index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moejax.data.corpus import BOS_ID, BYTE_VOCAB, EOS_ID, decode_bytes
from moejax.errors import InputError

# Special-token spellings of common Hugging Face tokenizers, tried in order when none is named.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<｜begin▁of▁sentence｜>")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<｜end▁of▁sentence｜>")


class TokenizerError(InputError, ValueError):
    """The tokenizer cannot be loaded or lacks what documents need (an end-of-document id)."""


@dataclass(frozen=True)
class Tokenizer:
    name: str  # "byte" or the tokenizer.json path, recorded in the shard index
    vocab_size: int
    bos_id: int | None
    eos_id: int
    _encode: object  # str -> list[int] | np.ndarray
    _decode: object = None  # list[int] -> str, special tokens left out

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text`, no special tokens."""
        return np.asarray(self._encode(text), dtype=np.int64)

    def encode_document(self, text: str) -> np.ndarray:
        """[BOS] ids EOS of one document."""
        ids = self.encode(text)
        parts = ([[self.bos_id]] if self.bos_id is not None else []) + [ids, [self.eos_id]]
        return np.concatenate(parts).astype(np.int64)

    def encode_prompt(self, text: str) -> np.ndarray:
        """[BOS] ids of a prompt: the start of a document as training saw it, no end."""
        ids = self.encode(text)
        return np.concatenate(([[self.bos_id]] if self.bos_id is not None else []) + [ids]).astype(np.int64)

    def decode(self, ids) -> str:
        """Text of generated ids (special tokens left out)."""
        return self._decode([int(i) for i in ids])


def byte_tokenizer() -> Tokenizer:
    def encode(text: str):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    return Tokenizer("byte", BYTE_VOCAB, BOS_ID, EOS_ID, encode, decode_bytes)


def hf_tokenizer(path: str | Path, bos: str | None = None, eos: str | None = None) -> Tokenizer:
    """A local `tokenizer.json` through the `tokenizers` library (no network, no transformers)."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exceptions for malformed JSON
        raise TokenizerError(f"cannot load tokenizer {path}: {str(e).splitlines()[0]}") from None

    def find(name, candidates, what):
        if name is not None:
            i = tok.token_to_id(name)
            if i is None:
                raise TokenizerError(f"tokenizer {path} has no token {name!r} for {what}")
            return i
        for c in candidates:
            if (i := tok.token_to_id(c)) is not None:
                return i
        return None

    eos_id = find(eos, _EOS_NAMES, "end of document")
    if eos_id is None:
        raise TokenizerError(f"tokenizer {path} has no known end-of-document token; name one with --eos")
    bos_id = find(bos, _BOS_NAMES, "beginning of document")

    def encode(text: str):
        return tok.encode(text, add_special_tokens=False).ids

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    return Tokenizer(str(path.resolve()), tok.get_vocab_size(with_added_tokens=True), bos_id, eos_id, encode, decode)


def load_tokenizer(spec: str, bos: str | None = None, eos: str | None = None) -> Tokenizer:
    """'byte' or a path to a Hugging Face tokenizer.json."""
    return byte_tokenizer() if spec == "byte" else hf_tokenizer(spec, bos, eos)
