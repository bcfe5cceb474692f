"""Collectives and their buffer sizes, read from a compiled program's HLO text (`compiled.as_text()`).

GSPMD-inserted collectives exist only there, not in the lowered StableHLO. Bytes are per device: the
buffer each collective fills (all-to-all, all-gather: the result; reduce-scatter: its input, the result
times the group size; all-reduce: the result). Async pairs are counted once, at their -start op.
"""

from __future__ import annotations

import re
from collections import defaultdict

_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute", "ragged-all-to-all")
_OP = re.compile(r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{(?P<first>[0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<n>\d+),(?P<size>\d+)\]<=")


def _bytes(shapes: str) -> int:
    total = 0
    for m in _SHAPE.finditer(shapes):
        if m["dtype"] not in _DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, m["dims"].split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[m["dtype"]]
    return total


def _group_size(line: str) -> int:
    if m := _GROUPS_LIST.search(line):
        return len(m["first"].split(","))
    if m := _GROUPS_IOTA.search(line):
        return int(m["size"])
    raise ValueError(f"cannot read the replica group size of: {line[:200]}")


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """{collective kind: bytes per device} summed over the program (a scan body counts once)."""
    out: dict[str, int] = defaultdict(int)
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m or "-done(" in line:
            continue
        size = _bytes(m["result"])
        if m["kind"] == "reduce-scatter":
            size *= _group_size(line)
        out[m["kind"]] += size
    return dict(out)
