"""Markdown of the user docs, read for tests/test_docs.py: fenced blocks, headings' anchors and relative links.

Links: every relative link `[text](path)` or `![alt](path)` outside code resolves to an existing file or
folder, and a `#anchor` (into the same file or another markdown file) names a heading of that file under
GitHub's slug rules (lowercase; punctuation other than `-` and `_` dropped; each space a `-`; a repeated
heading gets `-1`, `-2`, ...).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # what a link's location is shown relative to (tests set a tmp one)


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def blocks(text: str):
    """(kind, info, first line number, lines): kind 'code' for fenced blocks, 'prose' for the rest."""
    out, prose, start, fence, info, code, code_start = [], [], 1, None, "", [], 0
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            out.append(("prose", "", start, prose))
            fence, info, code, code_start = m.group(1), m.group(2).strip(), [], n + 1
        elif fence is not None and m and m.group(1).startswith(fence) and not m.group(2).strip():
            out.append(("code", info, code_start, code))
            fence, prose, start = None, [], n + 1
        elif fence is None:
            prose.append(line)
        else:
            code.append(line)
    if fence is not None:
        out.append(("code", info, code_start, code))
    else:
        out.append(("prose", "", start, prose))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for kind, _, _, lines in blocks(path.read_text()):
        if kind != "prose":
            continue
        for line in lines:
            m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path):
    """(line number, target) of every link outside code blocks and code spans."""
    for kind, _, start, lines in blocks(path.read_text()):
        if kind != "prose":
            continue
        for i, line in enumerate(lines):
            line = re.sub(r"(`+).*?\1", "", line)  # code spans
            for m in _LINK.finditer(line):
                yield start + i, m.group(1)


def link_problems(path: Path) -> list[str]:
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{line}: ({target})"
        if not dest.exists():
            bad.append(f"{where} {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} no heading of {dest.relative_to(ROOT)} has the anchor #{anchor}")
    return bad
