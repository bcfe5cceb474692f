"""Parsing of the `--config` flag shared by the entry points: --help, flag errors and unloadable config
files become one-line usage errors instead of tracebacks."""

from __future__ import annotations

import re


class UsageError(Exception):
    """A command-line mistake; the message is shown as is and the command exits 2."""


def _last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1].strip() if text else type(e).__name__


_SUGGESTION = re.compile(r'Did you mean "(?P<good>[^"]+)" instead of "(?P<bad>[^"]+)"')
_QUOTED = re.compile(r"'(?P<bad>[\w]+)'")


def _unknown_field(text: str, argv: list[str]) -> str | None:
    """ml_collections reports a misspelt override as the repr of a KeyError (with escaped quotes and a literal
    newline before 'Did you mean'); say it plainly, with the whole dotted name."""
    plain = text.replace("\\'", "'").replace("\\n", " ")
    found = _SUGGESTION.search(plain)
    quoted = _QUOTED.search(plain)
    unknown = found["bad"] if found else (quoted["bad"] if quoted and "instead of" not in plain else None)
    if unknown is None:
        return None
    for arg in argv[1:]:
        names = arg[2:].split("=", 1)[0].split(".")[1:] if arg.startswith("--config.") else []
        if unknown in names:
            where = names[: names.index(unknown)]
            hint = f"; did you mean {'.'.join([*where, found['good']])}?" if found else ""
            return f"the config has no field {'.'.join(names)}{hint}"
    return None


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
        raise UsageError(_unknown_field(str(e), argv) or _last_line(e)) from None
    try:
        cfg = flags.config  # a missing or broken file yields a stand-in that fails on first use
        if cfg is not None:
            cfg.keys()
    except Exception as e:
        raise UsageError(f"cannot load --config: {_last_line(e)}") from None
    if cfg is None:
        raise UsageError(f"--config is required, e.g. --config {example}")
    return cfg


OVERRIDE = "--config."


def split_config_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the other arguments, {field: text} of the `--config.FIELD=VALUE` ones): for the tools whose config is a saved
    model's, not a --config file (moejax-eval, moejax-generate), whose argparse parsers do not know the fields."""
    rest, texts = [], {}
    for arg in argv:
        if arg.startswith(OVERRIDE) and "=" in arg:
            key, _, text = arg[len(OVERRIDE):].partition("=")
            texts[key] = text
        else:
            rest.append(arg)
    return rest, texts


def typed_overrides(texts: dict[str, str]) -> dict:
    """{field: value} of split_config_overrides' texts, each read as its field's type (every config starts from
    default_config(), so a field's type is the same in all); ConfigError for an unknown field or a bad value."""
    from moejax.config import default_config
    from moejax.config.fields import set_field_from_text

    cfg = default_config()
    cfg.lock()
    for key, text in texts.items():
        set_field_from_text(cfg, key, text)
    return {key: cfg[key] for key in texts}
