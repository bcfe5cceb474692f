"""Parsing of the `--config` flag shared by the entry points: --help, flag errors and unloadable config
files become one-line usage errors instead of tracebacks."""

from __future__ import annotations


class UsageError(Exception):
    """A command-line mistake; the message is shown as is and the command exits 2."""


def _last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1].strip() if text else type(e).__name__


def parse_config(flags, argv: list[str], doc: str, example: str):
    """Parses argv into `flags` and returns the loaded config, or None after printing --help.
    Raises UsageError for bad flags, a config file that cannot be loaded, or a missing --config."""
    if any(a in ("-h", "--help", "--helpshort") for a in argv[1:]):
        print(doc.strip())
        print(flags.get_help())
        return None
    try:
        flags(argv)
    except Exception as e:  # absl flag errors, config file import errors, bad overrides
        raise UsageError(_last_line(e)) from None
    try:
        cfg = flags.config  # a missing or broken file yields a stand-in that fails on first use
        if cfg is not None:
            cfg.keys()
    except Exception as e:
        raise UsageError(f"cannot load --config: {_last_line(e)}") from None
    if cfg is None:
        raise UsageError(f"--config is required, e.g. --config {example}")
    return cfg
