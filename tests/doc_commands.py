"""Commands shown in the user docs, read and parsed for tests/test_docs.py.

Commands: every line of a fenced code block that runs a moejax tool is parsed by that tool's own parser,
without running the tool (nothing trains or compiles). A command line may start with `$ `, environment
assignments (`XLA_FLAGS=... moejax-train ...`) or `srun [options]`, and continues over lines ending in `\\`;
`python -m moejax.train ARGS` and `python launch/local.py ... -- ARGS` are checked as `moejax-train ARGS`.
Checked: the tool is one of pyproject's [project.scripts]; every option exists (moejax-train and moejax-plan:
the absl flag set their module defines, re-created from the module; moejax-data, moejax-convert and
moejax-report: the argparse parser their `main` builds, taken at its `parse_args` call); option values parse
with the option's own parser; a `--config` file exists (a `FILE:ARG` suffix such as `:32k` stripped); for
moejax-train and moejax-plan every `--config.a.b=v` override names a field of that config and its value has
the field's type (ml_collections' own override parsing, as the tool does it).

Placeholders. Docs write what the reader fills in as placeholders, which are not parsed:
- a value with an all-capitals name in it is a placeholder: `DIR`, `N`, `HOST:PORT`, `configs/X.py`,
  `WORKDIR/checkpoints/STEP`, `HF_DIR` (only the option's name is checked; a placeholder `--config` file is
  replaced by the stand-in `configs/tiny.py`, whose fields are every config's, since each starts from
  `default_config()`);
- so is a value holding `...` or `<...>`; a lone `...` stands for arguments left out and is dropped (a
  command with one needs no `--config`: the stand-in is used);
- `a|b` in a value lists alternatives: each one is checked;
- `[` and `]` mark optional parts: they are dropped and the parts inside are checked as if given;
- a fenced block whose info string has the word `template` (```` ```text template ````) holds usage templates:
  only the tools' and options' names are checked there.
Output lines (`moejax-train: error: ...`) are not commands: the first word must be a tool name alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from doc_markdown import blocks

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # name -> "module:main"
ABSL_TOOLS = ("moejax-train", "moejax-plan")  # absl flags + ml_collections config_flags
STAND_IN_CONFIG = "configs/tiny.py"


@dataclass
class Command:
    where: str
    tool: str
    args: list[str]
    template: bool
    elided: bool  # a lone `...` stood for arguments left out


_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_END = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def _command(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(tool, arguments) when the tokens run a moejax tool, else None."""
    while tokens and _ENV.match(tokens[0]):
        tokens = tokens[1:]
    if tokens and tokens[0] in ("srun", "exec", "time"):
        starts = [i for i, t in enumerate(tokens) if t in SCRIPTS]
        tokens = tokens[starts[0]:] if starts else []
    if not tokens:
        return None
    if tokens[0] in SCRIPTS:
        return tokens[0], tokens[1:]
    if re.fullmatch(r"(\S*/)?python3?", tokens[0]):
        if tokens[1:3] == ["-m", "moejax.train"]:
            return "moejax-train", tokens[3:]
        if len(tokens) > 1 and tokens[1].endswith("launch/local.py") and "--" in tokens:
            return "moejax-train", tokens[tokens.index("--") + 1:]
    return None


def commands(path: Path) -> list[Command]:
    out = []
    for kind, info, start, lines in blocks(path.read_text()):
        if kind != "code":
            continue
        template = "template" in info.split()
        i = 0
        while i < len(lines):
            first, text = i, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
            i += 1
            text = re.sub(r"^\s*\$\s+", "", text)
            try:
                tokens = shlex.split(text, comments=True)
            except ValueError:
                continue  # not shell (output, prose)
            for j, t in enumerate(tokens):
                if t in _END:
                    tokens = tokens[:j]
                    break
            found = _command(tokens)
            if found:
                tokens = [t.strip("[]") for t in found[1]]
                kept = [t for t in tokens if t and t != "..."]
                out.append(Command(f"{path.relative_to(ROOT)}:{start + first}", found[0], kept, template,
                                   "..." in tokens))
    return out


def is_placeholder(value: str) -> bool:
    if "..." in value or "<" in value:
        return True
    parts = re.split(r"[/:,=.]", value)
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", p) for p in parts)


def _alternatives(value: str) -> list[str]:
    return value.split("|") if "|" in value and not is_placeholder(value) else [value]


def _config_path(value: str) -> Path:
    """configs/deepseek_v3_671b_context.py:32k -> ROOT/configs/deepseek_v3_671b_context.py"""
    path = Path(value)
    if not (ROOT / path).is_file() and ":" in path.name:
        path = path.with_name(path.name.split(":", 1)[0])
    return ROOT / path


# absl tools ---------------------------------------------------------------------------------------------

def _fresh_module(tool: str):
    """The tool's module executed anew: its own FlagValues with the flags it defines, none parsed yet."""
    name = SCRIPTS[tool].split(":")[0]
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _absl_split(flags, args: list[str]) -> list[tuple[str, str | None]]:
    """[(name, value or None)] of `--name=value`, `--name value` and boolean `--name` / `--noname`."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            raise AssertionError(f"unexpected argument {arg!r}")
        name, eq, value = arg.lstrip("-").partition("=")
        boolean = (name in flags and flags[name].boolean) or (
            name.startswith("no") and name[2:] in flags and flags[name[2:]].boolean)
        if not eq and not boolean and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        out.append((name, value if (eq or value) else None))
        i += 1
    return out


def _absl_problems(cmd: Command) -> list[str]:
    module = _fresh_module(cmd.tool)
    flags = module.FLAGS
    try:
        pairs = _absl_split(flags, cmd.args)
    except AssertionError as e:
        return [str(e)]
    bad, config, overrides, plain = [], None, [], []
    for name, value in pairs:
        if name == "config":
            config = value
        elif name.startswith("config."):
            overrides.append((name, value))
        elif name in flags or (name.startswith("no") and name[2:] in flags and flags[name[2:]].boolean):
            plain.append((name, value))
        else:
            bad.append(f"{cmd.tool} has no flag --{name}")
    if bad or cmd.template:
        return bad
    if config is None and not cmd.elided:
        return [f"{cmd.tool} needs --config"]
    if config is None or is_placeholder(config):
        config = STAND_IN_CONFIG
    elif not _config_path(config).is_file():
        return [f"--config {config}: {_config_path(config).relative_to(ROOT)} does not exist"]

    # Values: each flag's own parser; placeholders are not parsed.
    for name, value in plain:
        flag = flags[name] if name in flags else flags[name[2:]]
        for alt in ([] if value is None or is_placeholder(value) else _alternatives(value)):
            try:
                flag.parser.parse(alt)
            except Exception as e:  # noqa: BLE001 - absl raises ValueError subclasses
                bad.append(f"--{name}={alt}: {e}")
    # The config and its overrides, parsed as the tool parses them (ml_collections reads sys.argv); an override
    # with a placeholder value: only its field is looked up.
    per_override, placeholder_fields = [], []
    for name, value in overrides:
        if value is not None and is_placeholder(value):
            placeholder_fields.append(name[len("config."):])
        else:
            per_override.append([f"--{name}" if a is None else f"--{name}={a}"
                                 for a in (_alternatives(value) if value is not None else [None])])
    for extra in itertools.product(*per_override):
        module = _fresh_module(cmd.tool)
        argv = [cmd.tool, f"--config={ROOT / config}", *extra]
        saved, sys.argv = sys.argv, argv
        try:
            module.FLAGS(argv)
            cfg = module.FLAGS.config
        except Exception as e:  # noqa: BLE001 - unknown field, bad value, broken config file
            text = str(e).replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
            bad.append(f"{' '.join(extra) or '--config'}: {text}")
            continue
        finally:
            sys.argv = saved
        for field in placeholder_fields:
            node = cfg
            for part in field.split("."):
                if not hasattr(node, "keys") or part not in node:
                    bad.append(f"the config has no field {field}")
                    break
                node = node[part]
    return bad


# argparse tools -----------------------------------------------------------------------------------------

class _Caught(Exception):
    def __init__(self, parser):
        self.parser = parser


def _argparse_parser(tool: str) -> argparse.ArgumentParser:
    """The parser the tool's main() builds, taken from its parse_args call (main stops there)."""
    module_name, func = SCRIPTS[tool].split(":")
    main = getattr(importlib.import_module(module_name), func)
    original = argparse.ArgumentParser.parse_args

    def catch(self, *a, **k):
        raise _Caught(self)

    argparse.ArgumentParser.parse_args = catch
    try:
        main([])
    except _Caught as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{tool}'s main() did not call parse_args")


def _sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _argparse_problems(cmd: Command) -> list[str]:
    parser = _argparse_parser(cmd.tool)
    subs = _sub_parsers(parser)
    active = parser
    if subs:
        first = next((a for a in cmd.args if not a.startswith("-")), None)
        if first not in subs:
            return [f"{cmd.tool}: {first!r} is not one of its commands ({', '.join(subs)})"]
        active = subs[first]
    options = {**parser._option_string_actions, **active._option_string_actions}

    def option(name):
        if name in options:
            return options[name]
        matches = [o for o in options if o.startswith(name)]  # argparse's prefix matching
        return options[matches[0]] if len(matches) == 1 else None

    bad, argv, choices_at = [], [], []
    i = 0
    while i < len(cmd.args):
        arg = cmd.args[i]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            action = option(name)
            if action is None:
                bad.append(f"{cmd.tool} {active.prog.split()[-1]} has no option {name}")
                i += 1
                continue
            takes_value = action.nargs != 0
            if takes_value and not eq:
                if i + 1 == len(cmd.args) or cmd.args[i + 1].startswith("--"):
                    argv.append(name)  # no value: argparse says so
                    i += 1
                    continue
                value, i = cmd.args[i + 1], i + 1
            if takes_value:
                if cmd.template or is_placeholder(value):
                    value = (str(next(iter(action.choices))) if action.choices else
                             "1" if action.type in (int, float) else value)
                if action.dest == "config" and not is_placeholder(value) and not cmd.template:
                    if not _config_path(value).is_file():
                        bad.append(f"{name} {value}: {_config_path(value).relative_to(ROOT)} does not exist")
                choices_at.append(len(argv) + 1)
                argv += [name, value]
            else:
                argv.append(name)
        else:
            argv.append(arg)
        i += 1
    if bad:
        return bad
    # Each alternative of an `a|b` value in turn.
    variants = []
    for pos in choices_at:
        for alt in _alternatives(argv[pos])[1:]:
            variants.append(argv[:pos] + [alt] + argv[pos + 1:])
    first = [a if k not in choices_at else _alternatives(a)[0] for k, a in enumerate(argv)]
    for variant in [first, *variants]:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(variant)
        except SystemExit:
            bad.append(f"{' '.join(variant)}: {err.getvalue().strip().splitlines()[-1]}")
    return bad


def command_problems(cmd: Command) -> list[str]:
    problems = _absl_problems(cmd) if cmd.tool in ABSL_TOOLS else _argparse_problems(cmd)
    return [f"{cmd.where}: {cmd.tool} {' '.join(cmd.args)}\n    {p}" for p in problems]
