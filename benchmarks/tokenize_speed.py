"""`moejax-data tokenize` throughput by worker count: MB of input text per second, whole command (start, read,
encode, write, checksums), for the byte tokenizer and a byte-level BPE tokenizer (vocabulary 8,192, trained here on
the corpus: nothing is downloaded). The corpus is the Python standard library's .py files as .jsonl documents,
repeated to --mb megabytes. Prints a table, writes JSON.

    python benchmarks/tokenize_speed.py [--mb 40] [--workers 1,2] [--json benchmarks/results/tokenize_speed.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moejax.data.corpus import stdlib_root  # noqa: E402


def corpus(directory: Path, megabytes: float) -> int:
    """.jsonl files of stdlib sources, repeated to `megabytes`; returns the text bytes written."""
    texts = [p.read_text(errors="replace") for p in sorted(stdlib_root().rglob("*.py"))[:2000]]
    written, part = 0, 0
    while written < megabytes * 1e6:
        with open(directory / f"part{part:04d}.jsonl", "w") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
                written += len(text.encode())
                if written >= megabytes * 1e6:
                    break
        part += 1
    return written


def bpe(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = [p.read_text(errors="replace") for p in sorted(stdlib_root().rglob("*.py"))[:300]]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=40.0)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="moejax-tokenize-bench-"))
    try:
        (work / "corpus").mkdir()
        n_bytes = corpus(work / "corpus", args.mb)
        tokenizers = {"byte": "byte", "bpe 8192": str(bpe(work))}
        rows = []
        for name, spec in tokenizers.items():
            outputs = []
            for workers in [int(w) for w in args.workers.split(",")]:
                out = work / f"out-{len(rows)}"
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "moejax.cli.data", "tokenize", str(work / "corpus"), "--output",
                                str(out), "--tokenizer", spec, "--workers", str(workers), "--no_progress", "--json"],
                               check=True, capture_output=True, cwd=ROOT)
                seconds = time.perf_counter() - start
                index = json.loads((out / "index.json").read_text())
                tokens = sum(s["n_tokens"] for shards in index["splits"].values() for s in shards)
                outputs.append(out)
                rows.append({"tokenizer": name, "workers": workers, "seconds": seconds, "mb_per_s": n_bytes / 1e6 / seconds,
                             "tokens": tokens, "same_as_one_worker": _same(outputs[0], out)})
        print(f"moejax-data tokenize, {n_bytes / 1e6:.1f} MB of .jsonl text (stdlib sources), whole command")
        print(f"{'tokenizer':<10} {'workers':>7} {'seconds':>8} {'MB/s':>6} {'tokens':>12} {'= 1 worker':>10}")
        for r in rows:
            print(f"{r['tokenizer']:<10} {r['workers']:>7} {r['seconds']:>8.1f} {r['mb_per_s']:>6.2f} {r['tokens']:>12,} "
                  f"{str(r['same_as_one_worker']):>10}")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"mb": n_bytes / 1e6, "rows": rows}, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _same(a: Path, b: Path) -> bool:
    """Token and document files byte for byte equal (the index records the same input paths too)."""
    return all((a / p.name).read_bytes() == p.read_bytes() for p in b.iterdir())


if __name__ == "__main__":
    sys.exit(main())
