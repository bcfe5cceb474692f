"""`moejax-data`: turn text into the token directories `data.corpus` reads, and check them.

    moejax-data tokenize INPUT... --output DIR [--tokenizer byte|PATH/tokenizer.json] [--jsonl_key text]
                         [--shard_tokens N] [--eval_every_nth_doc 20] [--bos TOKEN] [--eos TOKEN]
    moejax-data inspect DIR [--json] [--no_verify]

INPUT is a file or a directory (every file under it, in path order). A `.jsonl` file holds one document per
line (the string field --jsonl_key); any other file is one UTF-8 document. Every --eval_every_nth_doc-th
document goes to the eval split (0: none). Exit codes: 0 done, 2 bad input (one line on stderr; nothing
is written, an existing output is never touched).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moejax.data.shards import DataError, open_token_dir, write_token_dir
from moejax.data.tokenizer import TokenizerError, load_tokenizer

PROG = "moejax-data"


def _input_files(inputs: list[str]) -> list[Path]:
    files = []
    for item in map(Path, inputs):
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.is_file())
        elif item.is_file():
            files.append(item)
        else:
            raise DataError(f"input {item} does not exist")
    if not files:
        raise DataError(f"no input files under {', '.join(inputs)}")
    return files


def _texts(files: list[Path], jsonl_key: str):
    """Every document's text, in input order."""
    for path in files:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
        if path.suffix != ".jsonl":
            if text:
                yield text
            continue
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            value = record.get(jsonl_key) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise DataError(f"{path}:{line_no}: no string field {jsonl_key!r}")
            if value:
                yield value


def tokenize(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer, args.bos, args.eos)
    files = _input_files(args.inputs)
    encoded = (tokenizer.encode_document(t) for t in _texts(files, args.jsonl_key))
    train, held_out = [], []
    for i, ids in enumerate(encoded):
        (held_out if args.eval_every_nth_doc and i % args.eval_every_nth_doc == args.eval_every_nth_doc - 1
         else train).append(ids)
    if not train:
        raise DataError("every document went to the eval split; raise --eval_every_nth_doc or add input")
    return write_token_dir(Path(args.output), {"train": train, "eval": held_out}, tokenizer,
                           shard_tokens=args.shard_tokens, sources=[str(f) for f in files])


def summary(index: dict) -> dict:
    out = {"tokenizer": index["tokenizer"], "vocab_size": index["vocab_size"], "dtype": index["dtype"]}
    for split, shards in index["splits"].items():
        out[split] = {"shards": len(shards), "documents": sum(s["n_docs"] for s in shards),
                      "tokens": sum(s["n_tokens"] for s in shards),
                      "max_id": max((s["max_id"] for s in shards), default=-1)}
    return out


def _print_summary(path, index, as_json: bool):
    s = summary(index)
    if as_json:
        print(json.dumps({"path": str(path), **s}))
        return
    print(f"{path}: tokenizer {s['tokenizer']} (vocab {s['vocab_size']}, {s['dtype']})")
    for split in ("train", "eval"):
        if split in s:
            x = s[split]
            print(f"  {split}: {x['documents']} documents, {x['tokens']} tokens in {x['shards']} shards, "
                  f"max id {x['max_id']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokenize", help="tokenise text/JSONL files into a token directory")
    t.add_argument("inputs", nargs="+", help="files or directories")
    t.add_argument("--output", required=True, help="the token directory to create (must not exist)")
    t.add_argument("--tokenizer", default="byte", help="'byte' (built in) or a Hugging Face tokenizer.json")
    t.add_argument("--bos", default=None, help="beginning-of-document token (default: the tokenizer's, if any)")
    t.add_argument("--eos", default=None, help="end-of-document token (default: the tokenizer's)")
    t.add_argument("--jsonl_key", default="text", help="the text field of .jsonl records")
    t.add_argument("--shard_tokens", type=int, default=50_000_000, help="start a new shard past this many tokens")
    t.add_argument("--eval_every_nth_doc", type=int, default=20, help="hold out every nth document (0: none)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    i = sub.add_parser("inspect", help="check a token directory (sizes, checksums, ids) and summarise it")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.add_argument("--no_verify", action="store_true", help="skip the CRC32 pass")
    args = parser.parse_args(argv)
    try:
        if args.command == "tokenize":
            if args.shard_tokens <= 0 or args.eval_every_nth_doc < 0:
                raise DataError("--shard_tokens must be positive and --eval_every_nth_doc >= 0")
            index = tokenize(args)
            _print_summary(args.output, index, args.json)
        else:
            opened = open_token_dir(Path(args.path), verify_checksums=not args.no_verify)
            _print_summary(args.path, opened.index, args.json)
    except (DataError, TokenizerError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
