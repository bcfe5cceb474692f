"""The embedded default corpus: the Python standard library's own source files, found at run time.

Real text that needs no download. Files are ordered by a hash of their path relative to the stdlib root,
so the order (and the train/eval split) does not depend on where Python is installed. Tokenisation is
bytewise: ids 0-255 are bytes, then BOS and EOS mark document boundaries.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB = 259  # ids a byte tokenizer can emit; model.vocab_size must be at least this


def encode_bytes(text: bytes) -> np.ndarray:
    return np.concatenate([[BOS_ID], np.frombuffer(text, dtype=np.uint8), [EOS_ID]]).astype(np.uint16)


def decode_bytes(tokens) -> str:
    return bytes(int(t) for t in tokens if int(t) < 256).decode("utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _ordered_sources(root: Path) -> list[tuple[str, Path]]:
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        files.append((hashlib.sha1(rel.encode()).hexdigest(), path))
    files.sort()
    return files


def stdlib_token_streams(max_bytes: int, eval_every_nth_file: int, root: Path | None = None):
    """(train_tokens, eval_tokens) as uint16 streams of BOS doc EOS ...; every nth file is held out."""
    root = stdlib_root() if root is None else root
    train, held_out, total = [], [], 0
    for i, (_, path) in enumerate(_ordered_sources(root)):
        try:
            text = path.read_bytes()
        except OSError:
            continue
        if not text:
            continue
        (held_out if i % eval_every_nth_file == 0 else train).append(encode_bytes(text))
        total += len(text)
        if total >= max_bytes:
            break
    if not train or not held_out:
        raise FileNotFoundError(f"too few Python source files under {root} to build the default corpus")
    return np.concatenate(train), np.concatenate(held_out)
