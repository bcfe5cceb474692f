"""`moejax-data`: turn text into the token directories `data.corpus` reads, and check them.

    moejax-data tokenize INPUT... --output DIR [--tokenizer byte|PATH/tokenizer.json] [--text_key text]
                         [--workers N] [--shard_tokens N] [--eval_every_nth_doc 20] [--bos TOKEN] [--eos TOKEN]
    moejax-data inspect DIR [--json] [--no_verify]

INPUT is a file or a directory (every file under it, in path order). A `.jsonl` file holds one document per
line (the string field --text_key); a `.parquet` file and a Hugging Face `datasets` directory (save_to_disk) one
per row (the text column --text_key, or an already tokenized `input_ids` column taken as is; needs pyarrow: the
`data` extra); any other file is one UTF-8 document. Every --eval_every_nth_doc-th document goes to the eval split
(0: none). --workers N encodes in N processes with the same output as one. A progress line (documents, tokens,
MB/s) goes to stderr. Exit codes: 0 done, 2 bad input (one line on stderr; nothing is written, an existing output
is never touched, an interrupted run leaves nothing behind).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moejax.data.documents import documents, input_files
from moejax.data.encode import encode_documents
from moejax.data.progress import Progress
from moejax.data.shards import DataError, open_token_dir, write_token_dir_stream
from moejax.data.tokenizer import TokenizerError, load_tokenizer

PROG = "moejax-data"


def tokenize(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer, args.bos, args.eos)
    files = input_files(args.inputs)
    progress = Progress("tokenize") if args.progress else None
    encoded = encode_documents(documents(files, args.text_key), tokenizer, (args.tokenizer, args.bos, args.eos),
                               workers=args.workers, progress=progress)
    nth = args.eval_every_nth_doc

    def split_of_each():
        for i, ids in enumerate(encoded):
            yield ("eval" if nth and i % nth == nth - 1 else "train"), ids

    index = write_token_dir_stream(Path(args.output), split_of_each(), ("train", "eval"), tokenizer,
                                   shard_tokens=args.shard_tokens, sources=[str(f) for f in files],
                                   required=("train", "every document went to the eval split; raise "
                                                      "--eval_every_nth_doc or add input"))
    if progress is not None:
        progress.finish()
    return index


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
    t.add_argument("--text_key", "--jsonl_key", dest="text_key", default="text",
                   help="the text field of .jsonl records and the text column of parquet / arrow data")
    t.add_argument("--workers", type=int, default=1, help="processes that encode text (same output for any count)")
    t.add_argument("--no_progress", dest="progress", action="store_false",
                   help="no progress line on stderr (documents, tokens, MB/s)")
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
            if args.shard_tokens <= 0 or args.eval_every_nth_doc < 0 or args.workers < 1:
                raise DataError("--shard_tokens and --workers must be positive and --eval_every_nth_doc >= 0")
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
