"""Every collective of a compiled program, read from its HLO text (`compiled.as_text()`): kind, buffer bytes,
device groups, and how often one run of the program executes it. The one HLO collective parser of moejax.

GSPMD-inserted collectives exist only in the compiled text, not in the lowered StableHLO. Bytes are per
device: the buffer each collective fills (all-to-all, all-gather: the result; reduce-scatter: its input, the
result times the group size; all-reduce: the result). Async pairs are counted once, at their -start op.
A collective whose groups all have one device moves nothing and is skipped. Bytes are also split by the element type the collective moves (`Collective.by_dtype`, `bytes_by_dtype`):
the compiled program's, which need not be the model's (XLA:CPU's float-normalization-bf16 pass widens bf16
collectives to f32, with converts before and after, so a CPU compile moves bf16 traffic at 2x its bytes).

A training step's layers run inside while loops: `collectives` walks the call graph from ENTRY and multiplies
each computation by the known trip counts of the loops around it (`bytes_per_step`), while
`collective_bytes` counts each collective as it appears (a scan body once). Replica groups are parsed in
every form XLA prints (explicit lists, iota `[n,k]<=[dims]T(perm)`, and jaxlib >= 0.12's
`mesh['data'=2,...] {'expert'}`) into device-id groups, so callers can say which link a collective crosses.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute", "ragged-all-to-all")
_OP = re.compile(r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\(")
# _OP's lazy tuple match is quadratic on a long line without a collective (a Mosaic kernel's custom call carries
# 100 KB of config): only lines that name a collective op are searched.
_OP_NAMES = tuple(f" {k}{s}(" for k in _KINDS for s in ("", "-start"))
_SHAPE = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<how>body|condition|calls|to_apply)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_PARTITIONS = re.compile(r"num_partitions=(?P<n>\d+)")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_LIST_GROUPS = re.compile(r"replica_groups=\{(?P<body>(?:\{[0-9,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\(\[(?P<idims>[0-9,]+)\](?:T\((?P<iperm>[0-9,]+)\))?\))?"
    r"\s*\{(?P<sel>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>[^}]*)\}")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=")
_ASYNC_CALL = re.compile(r"\basync-start\(.*?calls=%(?P<callee>[\w.\-]+)")
_DONE = re.compile(r"\b(?:async|[a-z\-]+)-done\(%(?P<start>[\w.\-]+)")
# Work the GPU runs while a collective is in flight: fusions, GEMM/kernel custom calls, dots and the loops or
# calls that hold them (an async start or done is not work, nor a bitcast, tuple or parameter).
_COMPUTE = re.compile(r"\s(?:fusion|custom-call|dot|convolution|while|call|conditional)\(")
_SYNC = '"is_sync":true'
# A GEMM among that work: XLA:GPU's GEMM fusions (cuBLAS / Triton, `kind=kCustom`), kernel custom calls (tokamax's
# Mosaic GPU grouped GEMM), dots, and the loops that hold them. Stricter than _COMPUTE: an elementwise fusion of the
# routing metadata under an exchange is compute, not the work that hides it.
_GEMM = re.compile(r"\s(?:custom-call|dot|convolution|while)\(|\sfusion\(.*\bkind=kCustom\b")


@dataclass(frozen=True)
class Collective:
    kind: str  # all-to-all, all-gather, reduce-scatter, all-reduce, collective-permute, ragged-all-to-all
    bytes: int  # per device and execution, hlo_stats' convention (reduce-scatter: its input)
    groups: tuple[tuple[int, ...], ...]  # device ids that communicate together
    count: int  # executions per program run: the product of the enclosing loops' trip counts
    op_name: str  # jax's name for the op that produced it (metadata), for reports
    by_dtype: tuple[tuple[str, int], ...] = ()  # `bytes` split by HLO element type, e.g. (("f32", n),)
    overlapped: bool = False  # asynchronous, with compute scheduled between its start and its done (`overlap`)
    under_gemm: bool = False  # ... and among that compute a GEMM (_GEMM)


def _bytes_by_dtype(shapes: str) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for m in _SHAPE.finditer(shapes):
        if m["dtype"] not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, m["dims"].split(",")):
            n *= int(d)
        out[m["dtype"]] += n * DTYPE_BYTES[m["dtype"]]
    return dict(out)


def _bytes(shapes: str) -> int:
    return sum(_bytes_by_dtype(shapes).values())


def _top_level(shapes: str) -> list[str]:
    """The top-level elements of a tuple shape '(a, (b, c), d)'; a non-tuple shape is its own one element."""
    if not shapes.startswith("("):
        return [shapes]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shapes[1:-1], start=1):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(shapes[start:i].strip())
            start = i + 1
    return parts + [shapes[start:-1].strip()]


def _destination(result: str, *, started: bool) -> str:
    """The buffer a collective fills. An async `*-start` op's result is a tuple (operands, destination[,
    contexts]) on GPU: only the destination counts, or the bytes would be counted twice."""
    if started and result.startswith("("):
        parts = _top_level(result)
        if len(parts) >= 2:
            return parts[1]
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def replica_groups(line: str, n_devices: int) -> tuple[tuple[int, ...], ...]:
    """Device-id groups of one collective line; `{}` or no groups means all devices together."""
    if m := _MESH_GROUPS.search(line):
        axes = [(a.split("=")[0].strip("'\" "), int(a.split("=")[1])) for a in m["axes"].split(",") if a]
        sizes = [s for _, s in axes]
        ids = (_iota(_ints(m["idims"]), _ints(m["iperm"]) if m["iperm"] else None).reshape(-1)
               if m["idims"] else np.arange(int(np.prod(sizes))))
        grid = ids.reshape(sizes)
        chosen = {s.strip("'\" ") for s in m["sel"].split(",") if s.strip()}
        inside = [i for i, (name, _) in enumerate(axes) if name in chosen]
        outside = [i for i in range(len(axes)) if i not in inside]
        group_size = int(np.prod([sizes[i] for i in inside])) if inside else 1
        return tuple(tuple(int(d) for d in g) for g in grid.transpose(outside + inside).reshape(-1, group_size))
    if m := _IOTA_GROUPS.search(line):
        shape = _ints(m["shape"])
        ids = _iota(_ints(m["dims"]), _ints(m["perm"]) if m["perm"] else None).reshape(shape)
        return tuple(tuple(int(d) for d in g) for g in ids)
    if m := _LIST_GROUPS.search(line):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m["body"]))
        if groups and groups[0]:
            return groups
    if m := _PAIRS.search(line):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([0-9,]*)\}", "{" + m["body"] + "}"))
    return (tuple(range(n_devices)),)


def _call_graph(lines):
    """(computation of each line, {caller: [(callee, times)]}, entry name). times is None for the body and
    condition of a while loop whose trip count depends on data (dropless overflow rounds)."""
    owner, edges, entry, current = [], defaultdict(list), None, None
    for line in lines:
        if m := _HEADER.match(line):
            current = m["name"]
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        owner.append(current)
        if current is None:
            continue
        trip = _TRIP.search(line)
        for c in _CALLEE.finditer(line):
            times = 1
            if c["how"] in ("body", "condition"):
                times = None if trip is None else int(trip["n"]) + (c["how"] == "condition")
            edges[current].append((c["name"], times))
        if b := _BRANCHES.search(line):
            edges[current] += [(n.strip().lstrip("%"), 1) for n in b["names"].split(",") if n.strip()]
    return owner, edges, entry


def _multiplicities(edges, entry, data_dependent_trips: int) -> dict[str, int]:
    """How many times one run of ENTRY runs each computation (the call graph is a DAG), data-dependent loops
    taken `data_dependent_trips` times."""
    order, seen = [], set()

    def visit(name):  # post-order, so a callee comes after all of its callers once reversed
        if name in seen:
            return
        seen.add(name)
        for callee, _ in edges.get(name, ()):
            visit(callee)
        order.append(name)

    visit(entry)
    times = defaultdict(int, {entry: 1})
    for name in reversed(order):
        for callee, k in edges.get(name, ()):
            times[callee] += times[name] * (data_dependent_trips if k is None else k)
    return times


def _overlap_windows(lines, owner) -> tuple[dict[int, tuple[bool, bool]], dict[str, tuple[bool, bool]]]:
    """For a scheduled module (`is_scheduled=true`: each computation's instructions in execution order): whether
    compute runs between an asynchronous collective's start and its done, and whether a GEMM does. Returns ({line
    index of an X-start collective: (overlapped, under a GEMM)}, {async computation called by an async-start: the
    same}). A start marked `"is_sync":true` runs synchronously whatever lies between: not overlapped."""
    by_comp: dict[str, list[int]] = defaultdict(list)
    for i, comp in enumerate(owner):
        if comp is not None and _INSTR.match(lines[i]):
            by_comp[comp].append(i)
    starts, calls = {}, {}
    for comp, idx in by_comp.items():
        done_at = {}
        for pos, i in enumerate(idx):
            if d := _DONE.search(lines[i]):
                done_at[d["start"]] = pos
        # Running counts of compute and GEMM instructions, so each window is two subtractions (a scheduled
        # 671B step has computations of 10^5 instructions and thousands of long windows).
        compute_before = np.cumsum([0] + [bool(_COMPUTE.search(lines[i])) for i in idx])
        gemm_before = np.cumsum([0] + [bool(_GEMM.search(lines[i])) for i in idx])
        for pos, i in enumerate(idx):
            line = lines[i]
            call = _ASYNC_CALL.search(line)
            if not call and not re.search(r"\b[a-z\-]+-start\(", line):
                continue
            name = _INSTR.match(line)["name"]
            end = done_at.get(name)
            if end is not None and end > pos + 1 and _SYNC not in line:
                found = (bool(compute_before[end] > compute_before[pos + 1]),
                         bool(gemm_before[end] > gemm_before[pos + 1]))
            else:
                found = (False, False)
            if call:
                calls[call["callee"]] = found
            else:
                starts[i] = found
    return starts, calls


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of the program with its groups and per-run execution count. Text without an ENTRY
    computation (a few instructions, as a test or a tool may pass) counts each instruction once. A while loop
    whose trip count depends on data (dropless overflow rounds) counts 0 times: the step whose load fits its
    window; its collectives are listed with count 0."""
    lines = hlo_text.splitlines()
    # A fragment without a module header does not say its device count: its default group is "all devices".
    n_devices = int(m["n"]) if (m := _PARTITIONS.search(hlo_text)) else None
    owner, edges, entry = _call_graph(lines)
    if entry is None:
        owner, times, reached = ["fragment"] * len(lines), {"fragment": 1}, {"fragment": 1}
    else:
        times, reached = _multiplicities(edges, entry, 0), _multiplicities(edges, entry, 1)
    started, async_calls = _overlap_windows(lines, owner)
    out = []
    for i, (line, comp) in enumerate(zip(lines, owner)):
        m = _OP.search(line) if any(k in line for k in _OP_NAMES) else None
        if not m or "-done(" in line or comp is None or reached.get(comp, 0) == 0:
            continue
        groups = replica_groups(line, n_devices or 1)
        if n_devices and all(len(g) <= 1 for g in groups):
            continue  # groups of one device (a reduction over a mesh axis of size 1): nothing moves
        by_dtype = _bytes_by_dtype(_destination(m["result"], started="-start(" in line))
        if m["kind"] == "reduce-scatter":
            by_dtype = {t: n * len(groups[0]) for t, n in by_dtype.items()}
        name = n["name"] if (n := _OP_NAME.search(line)) else ""
        overlapped, under_gemm = started.get(i, (False, False))
        if comp in async_calls and _SYNC not in line:
            overlapped, under_gemm = async_calls[comp]
        out.append(Collective(m["kind"], sum(by_dtype.values()), groups, times.get(comp, 0), name,
                              tuple(sorted(by_dtype.items())), overlapped, under_gemm))
    return out


def overlap(colls: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {"bytes", "overlapped_bytes", "share", "gemm_bytes", "gemm_share"}} over one run of the program: the
    bytes each kind of collective moves, the part of them moved by asynchronous collectives with compute scheduled
    between start and done (in a scheduled module; what the GPU can hide behind work), and the part with a GEMM
    among that compute. XLA:CPU runs collectives synchronously."""
    out: dict[str, dict[str, float]] = {}
    for c in colls:
        o = out.setdefault(c.kind, {"bytes": 0, "overlapped_bytes": 0, "gemm_bytes": 0})
        o["bytes"] += c.bytes * c.count
        o["overlapped_bytes"] += c.bytes * c.count * c.overlapped
        o["gemm_bytes"] += c.bytes * c.count * c.under_gemm
    for o in out.values():
        o["share"] = o["overlapped_bytes"] / o["bytes"] if o["bytes"] else 0.0
        o["gemm_share"] = o["gemm_bytes"] / o["bytes"] if o["bytes"] else 0.0
    return out


def bytes_per_step(colls: list[Collective]) -> dict[str, int]:
    """{kind: bytes per device} over one run of the program, loops unrolled."""
    out: dict[str, int] = defaultdict(int)
    for c in colls:
        out[c.kind] += c.bytes * c.count
    return dict(out)


def bytes_by_dtype(colls: list[Collective]) -> dict[str, dict[str, int]]:
    """{kind: {HLO element type: bytes per device}} over one run of the program, loops unrolled."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in colls:
        for dtype, n in c.by_dtype:
            out[c.kind][dtype] += n * c.count
    return {kind: dict(d) for kind, d in out.items()}


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """{kind: bytes per device} with each collective counted once as it appears (a scan body once)."""
    out: dict[str, int] = defaultdict(int)
    for c in collectives(hlo_text):
        out[c.kind] += c.bytes
    return dict(out)
