"""`moejax-generate PATH --prompt TEXT ...`: text from a saved model, batched, with a KV cache.

  moejax-generate runs/tiny --prompt "def parse(" --prompt "import "          # greedy, 128 new tokens each
  moejax-generate runs/tiny --corpus_prompts 2 --max_new_tokens 96            # prompts from its held-out data
  moejax-generate hf/ --prompt_file prompts.txt --temperature 0.8 --top_p 0.95 --seed 1 --json out.json
  moejax-generate W --prompt "x" --config.mesh.expert=4 --config.mesh.data=2  # expert-parallel decode

PATH: a run's WORKDIR (its newest complete checkpoint), WORKDIR/checkpoints/STEP, a weights directory
(`moejax-convert import`) or a Hugging Face directory (config.json + *.safetensors). Prompts: --prompt (repeatable),
--prompt_file (one prompt per line; a .jsonl file: a "prompt" field per line), --corpus_prompts N (the start of the
first N held-out documents of the model's training data). All prompts run as one batch of different lengths.
--tokenizer: byte or a tokenizer.json (default: PATH/tokenizer.json where there is one, else the one the training
data was written with). Greedy unless --temperature > 0 (then --top_k, --top_p filter); a row ends at the
tokenizer's end token, a --stop_id, --max_new_tokens or the model's positions (model.max_seq_len).
--config.GROUP.FIELD=VALUE overrides a field of the model's config (mesh axes, kernels; not the model's shape).

Exit codes: 0 done; 2 bad input (a path that names no saved model, a tokenizer that does not match the
vocabulary, no prompt or an empty one, a prompt longer than the model's positions: one line on stderr); 4 could
not join the multi-process job (--coordinator, --num_processes, --process_id as moejax-train).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moejax.cli.config_flag import split_config_overrides, typed_overrides
from moejax.cli.inference_command import add_job_flags, job_flags, run_inference_command

PROG = "moejax-generate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("path", help="WORKDIR, WORKDIR/checkpoints/STEP, a weights directory or a Hugging Face directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt_file", help="one prompt per line (.jsonl: a 'prompt' field per line)")
    p.add_argument("--corpus_prompts", type=int, default=0, metavar="N",
                   help="also the start of the first N held-out documents of the training data")
    p.add_argument("--tokenizer", help="byte or a tokenizer.json (default: the model's)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="0: off")
    p.add_argument("--top_p", type=float, default=1.0, help="1: off")
    p.add_argument("--stop_id", type=int, action="append", default=[], help="a token id that ends a row (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write prompts, completions and timings as JSON")
    add_job_flags(p)
    return p


def _file_prompts(path: str) -> list[str]:
    from moejax.errors import InputError

    file = Path(path)
    if not file.is_file():
        raise InputError(f"prompt file {file} does not exist")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if file.suffix == ".jsonl":
        try:
            lines = [json.loads(line)["prompt"] for line in lines]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"prompt file {file}: every line must be a JSON object with a 'prompt' ({e})") from None
    if not lines:
        raise InputError(f"prompt file {file} holds no prompt")
    return lines


def format_samples(result: dict) -> str:
    lines = [f"{result['model']} | mesh {result['mesh']} | {result['prompts']} prompts, {result['new_tokens']} new "
             f"tokens | prefill {result['prefill_tokens_per_s']:,.0f} tokens/s, decode "
             f"{result['decode_tokens_per_s']:,.0f} tokens/s"]
    for s in result["samples"]:
        lines.append(f"--- [{s['finish']}, {len(s['tokens'])} tokens]")
        lines.append(f"{s['prompt']}\u2502{s['completion']}")  # the bar marks where the model took over
    return "\n".join(lines)


def main(argv=None) -> int:
    argv, texts = split_config_overrides(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(argv)
    from moejax import api

    def call() -> dict:
        prompts = list(args.prompt) + (_file_prompts(args.prompt_file) if args.prompt_file else [])
        return api.generate(args.path, prompts, corpus_prompts=args.corpus_prompts, tokenizer=args.tokenizer,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop_ids=args.stop_id, seed=args.seed, overrides=typed_overrides(texts),
                            **job_flags(args))

    return run_inference_command(PROG, call, format_samples, args.json)


if __name__ == "__main__":
    sys.exit(main())
