"""`moejax-eval PATH [--data DIR ...]`: the loss per token and perplexity of a saved model, per source and overall.

  moejax-eval runs/tiny                                  # the run's newest checkpoint on its own held-out data
  moejax-eval runs/tiny/checkpoints/250 --data data/code data/prose --max_batches 0 --json eval.json
  moejax-eval W --data data/mine --split train --seq_len 512 --global_batch 16 --config.mesh.expert=2

PATH: a run's WORKDIR (its newest complete checkpoint), WORKDIR/checkpoints/STEP, a weights directory
(`moejax-convert import`) or a Hugging Face directory (config.json + *.safetensors). --data: token directories
(`moejax-data tokenize`) or `stdlib`, each evaluated on its own; without it, the data the model's config names.
--split eval (default): each source's held-out split, as the training loop evaluates; train: its train split in
order. --seq_len, --global_batch and --max_batches (per source; 0: all) default to the config's train.seq_len,
train.global_batch and train.eval_batches. --config.GROUP.FIELD=VALUE overrides a field of the model's config
(mesh axes, kernels, data.max_bytes, ...; not the model's shape). The loss per token weights each batch by its
predicted tokens; the overall line combines the sources by their tokens (docs/evaluation.md).

Exit codes: 0 done; 2 bad input (a path that names no saved model, a checkpoint that does not restore, missing or
empty data, a vocabulary larger than the model's, a batch the mesh does not fit: one line on stderr); 4 could not
join the multi-process job. Multi-process jobs: --coordinator HOST:PORT --num_processes N --process_id I, the
JAX_* variables, SLURM or Open MPI, as moejax-train; every process reads its rows of every batch.
"""

from __future__ import annotations

import argparse
import sys

from moejax.cli.config_flag import split_config_overrides, typed_overrides
from moejax.cli.inference_command import add_job_flags, job_flags, run_inference_command

PROG = "moejax-eval"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("path", help="WORKDIR, WORKDIR/checkpoints/STEP, a weights directory or a Hugging Face directory")
    p.add_argument("--data", nargs="+", action="extend", metavar="DIR",
                   help="token directories (or stdlib), each evaluated on its own (default: the config's data)")
    p.add_argument("--split", default="eval", choices=("eval", "train"))
    p.add_argument("--seq_len", type=int, help="tokens per row (default: the config's train.seq_len)")
    p.add_argument("--global_batch", type=int, help="rows per batch, all processes (default: train.global_batch)")
    p.add_argument("--max_batches", type=int, help="batches per source, 0: all (default: train.eval_batches)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    add_job_flags(p)
    return p


def format_table(result: dict) -> str:
    """What moejax-eval prints: a line saying what was evaluated, then source | tokens | loss/token | perplexity."""
    batches = f"at most {result['max_batches']}" if result["max_batches"] else "every batch"
    lines = [f"{result['model']} | mesh {result['mesh']} | {result['split']} split, batches of {result['global_batch']} "
             f"x {result['seq_len']} tokens, {batches} per source | {result['seconds']:.1f}s"]
    width = max(len("overall"), *(len(s["source"]) for s in result["sources"]))
    lines.append(f"{'source':<{width}}  {'tokens':>10}  {'loss/token':>10}  {'perplexity':>10}")
    for row in [*result["sources"], {"source": "overall", **result["overall"]}]:
        lines.append(f"{row['source']:<{width}}  {row['tokens']:>10,}  {row['loss']:>10.4f}  {row['perplexity']:>10.2f}")
    if "training_eval_loss" in result:
        lines.append(f"as the training loop's eval_loss (mean of batch means): {result['training_eval_loss']:.6f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv, texts = split_config_overrides(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(argv)
    from moejax import api

    def call() -> dict:
        return api.evaluate(args.path, args.data, split=args.split, seq_len=args.seq_len,
                            global_batch=args.global_batch, max_batches=args.max_batches,
                            overrides=typed_overrides(texts), **job_flags(args))

    return run_inference_command(PROG, call, format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
