"""moejax-lm-eval: EleutherAI lm-evaluation-harness's command line with the `moejax` model registered.

    moejax-lm-eval run --model moejax --model_args pretrained=runs/tiny --tasks TASK --include_path TASKS/ --batch_size 8

Every argument is lm-eval's (`moejax-lm-eval --help`); the moejax model's arguments are in
moejax/inference/lm_eval_model.py and docs/evaluation.md. lm-eval 0.4 has no way for another package to add a
model to its own `lm_eval` command, hence this one. Needs the `eval` extra (pip install 'moejax[eval]').
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("moejax-lm-eval: lm-eval is not installed; pip install 'moejax[eval]'", file=sys.stderr)
        return 2
    import moejax.inference.lm_eval_model  # noqa: F401  (registers "moejax")

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
