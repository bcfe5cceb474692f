"""`python -m moejax.train` is `moejax-train` (the Python API's function is `moejax.train`)."""

import sys

if __name__ != "__main__":  # importing this module would replace the function moejax.train
    raise ImportError("moejax/train.py is the `python -m moejax.train` entry point; call moejax.train(cfg, workdir)")

from moejax.cli.train import main  # noqa: E402

sys.exit(main())
