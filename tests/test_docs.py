"""The user docs (README.md, docs/*.md, benchmarks/RESULTS.md) hold no broken link (tests/doc_markdown.py says what
is checked) and no command that would not parse (tests/doc_commands.py: the rules and the placeholder convention).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import doc_commands
import doc_markdown
import pytest
from doc_commands import SCRIPTS, command_problems, commands
from doc_markdown import link_problems

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]



# ml_collections loads config files with importlib's load_module.
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

def test_the_docs_exist():
    assert (ROOT / "README.md").is_file() and len(DOCS) > 3
    assert set(SCRIPTS) >= {"moejax-train", "moejax-plan", "moejax-data", "moejax-convert", "moejax-report"}


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_links_resolve(path):
    bad = link_problems(path)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_commands_parse():
    found = [c for p in DOCS for c in commands(p)]
    tools = {c.tool for c in found}
    assert {"moejax-train", "moejax-plan", "moejax-data", "moejax-convert", "moejax-report"} <= tools, tools
    bad = list(itertools.chain.from_iterable(command_problems(c) for c in found))
    assert not bad, f"{len(bad)} of {len(found)} commands in the docs do not parse:\n" + "\n".join(bad)


# The checks must be able to fail.

def test_a_broken_link_and_anchor_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(doc_markdown, "ROOT", tmp_path)
    monkeypatch.setattr(doc_commands, "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Real heading: `moejax-plan`, the planner\n\n## Real heading: `moejax-plan`, the planner\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#real-heading-moejax-plan-the-planner) [ok](b.md#real-heading-moejax-plan-the-planner-1)\n"
                    "[gone](missing.md) [bad anchor](b.md#nope) `[in code](missing2.md)`\n"
                    "```\n[in a block](missing3.md)\n```\n")
    bad = link_problems(page)
    assert len(bad) == 2 and "missing.md does not exist" in bad[0] and "#nope" in bad[1], bad


def _check(tmp_path, monkeypatch, block: str) -> list[str]:
    page = tmp_path / "page.md"
    page.write_text(block)
    monkeypatch.setattr(doc_markdown, "ROOT", tmp_path)
    monkeypatch.setattr(doc_commands, "ROOT", tmp_path)
    (tmp_path / "configs").mkdir(exist_ok=True)
    for name in ("tiny.py", "deepseek_v3_671b_context.py", "deepseek_v3_671b.py"):
        (tmp_path / "configs" / name).write_text((Path(__file__).resolve().parents[1] / "configs" / name).read_text())
    return [p for c in commands(page) for p in command_problems(c)]


def test_good_commands_pass(tmp_path, monkeypatch):
    assert _check(tmp_path, monkeypatch, (
        "```bash\n"
        "$ XLA_FLAGS=--xla_force_host_platform_device_count=8 moejax-train --config configs/tiny.py \\\n"
        "    --workdir runs/x --config.train.steps=5 --config.mesh.expert=N   # a comment\n"
        "moejax-train --config configs/deepseek_v3_671b_context.py:32k --workdir DIR --dry_run "
        "--dry_run_target h200|gb300 --config.checkpoint.init_from=WORKDIR/checkpoints/STEP\n"
        "moejax-train ... --config.data.corpus=data/code:3,data/prose:1\n"
        "moejax-plan --config configs/X.py --topology gb300-nvl72 --gpus 256,512 --layout pp=2,vp=8 --json\n"
        "moejax-data tokenize corpus/ --output data/mine [--tokenizer path/to/tokenizer.json]\n"
        "moejax-convert export --from DIR --hf_dir OUT --dtype bfloat16|float8_e4m3fn --max_shard_gb 5\n"
        "moejax-report runs/tiny --json\n"
        "moejax-train: error: this is output, not a command\n"
        "```\n"
        "```text template\nmoejax-train --config C --config.a.b=v --workdir DIR\n```\n")) == []


@pytest.mark.parametrize("line,message", [
    ("moejax-train --config configs/tiny.py --workdir x --no_such_flag", "has no flag --no_such_flag"),
    ("moejax-train --config configs/tiny.py --workdir x --config.train.stepz=5", "stepz"),
    ("moejax-train --config configs/tiny.py --workdir x --config.train.steps=many", "many"),
    ("moejax-train --config configs/tiny.py --workdir DIR --config.moe.no_field=N", "no field moe.no_field"),
    ("moejax-train --config configs/missing.py --workdir x", "does not exist"),
    ("moejax-train --config configs/tiny.py --dry_run --dry_run_devices many", "dry_run_devices"),
    ("moejax-plan --config configs/tiny.py --gpuz 256", "has no flag --gpuz"),
    ("moejax-data tokenize corpus/ --output d --shard_tokenz 5", "has no option --shard_tokenz"),
    ("moejax-data tokenize corpus/ --output d --shard_tokens lots", "invalid int value"),
    ("moejax-convert export --from D --hf_dir O --dtype bfloat16|float99", "float99"),
    ("moejax-convert import --hf_dir H --out O --config configs/missing.py", "does not exist"),
    ("moejax-convert expor --from D", "not one of its commands"),
    ("moejax-report runs/x --json --out", "expected one argument"),
    ("moejax-report runs/x --jsn", "has no option --jsn"),
])
def test_bad_commands_fail(tmp_path, monkeypatch, line, message):
    problems = _check(tmp_path, monkeypatch, f"```bash\n{line}\n```\n")
    assert problems and message in "\n".join(problems), problems

