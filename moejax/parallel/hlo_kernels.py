"""What a compiled program runs, read from its HLO text: custom-call targets (cuDNN attention, Mosaic GPU and
Triton kernels, cuBLAS GEMMs) and fusion kinds (XLA:GPU's kLoop / kInput / kOutput, and kCustom fusions named
by their backend kind, e.g. Triton GEMMs), each with its count as it appears in the text (a scan body once).
Also the operand element types of every dot (f8e4m3fn x f8e4m3fn: an FP8 GEMM) and the array shapes the program
holds, for tests that assert a buffer does not exist, and the whole-stack relayouts of stacked weights."""

from __future__ import annotations

import math
import re
from collections import Counter

from moejax.parallel.hlo_collectives import DTYPE_BYTES

_CUSTOM_CALL = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_FUSION = re.compile(r"\bfusion\(.*?kind=(?P<kind>k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"(?P<kind>[^"]+)"')
_DEFINITION = re.compile(r"^\s*(?:ROOT )?(?P<name>%[\w.\-]+) = (?P<dtype>\w+)\[")
_DOT = re.compile(r"= \w+\[[^\]]*\]\S* dot\((?P<lhs>%[\w.\-]+), (?P<rhs>%[\w.\-]+)\)")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16|f8e\w+)\[(?P<dims>[0-9,]*)\]")


def kernel_inventory(hlo_text: str) -> dict[str, dict[str, int]]:
    """{'custom_calls': {target: count}, 'fusions': {kind[:backend kind]: count}}."""
    calls, fusions = Counter(), Counter()
    for line in hlo_text.splitlines():
        if m := _CUSTOM_CALL.search(line):
            calls[m["target"]] += 1
        if (m := _FUSION.search(line)) and "=" in line.split("fusion(")[0]:
            kind = m["kind"]
            if kind == "kCustom" and (b := _BACKEND_KIND.search(line)):
                kind = f"{kind}:{b['kind']}"
            fusions[kind] += 1
    return {"custom_calls": dict(calls.most_common()), "fusions": dict(fusions.most_common()),
            "dots": dot_operand_types(hlo_text)}


def gemm_custom_calls(inventory: dict) -> dict[str, int]:
    """The GEMM library calls of a kernel_inventory (cuBLAS / cuBLASLt, `$f8` for FP8): on GPUs XLA turns dots into
    these, so the compiled program's GEMMs are counted here, not among its dots."""
    return {t: n for t, n in inventory["custom_calls"].items() if "matmul" in t or "gemm" in t}


def dot_operand_types(hlo_text: str) -> dict[str, int]:
    """{'lhs x rhs' element types: count} over the program's dot instructions (inside GEMM fusions too)."""
    dtype_of = {}
    for line in hlo_text.splitlines():
        if m := _DEFINITION.match(line):
            dtype_of[m["name"]] = m["dtype"]
    dots = Counter(f"{dtype_of.get(m['lhs'], '?')} x {dtype_of.get(m['rhs'], '?')}" for m in _DOT.finditer(hlo_text))
    return dict(dots.most_common())


_TENSOR_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*(\w+)>")
_LOWERED_CALL = re.compile(r"stablehlo\.custom_call @(?P<target>[\w$.\-]+)\((?P<args>[^)]*)\).*?: \((?P<types>[^)]*)\)")


def lowered_custom_calls(stablehlo_text: str) -> dict[str, dict[str, int]]:
    """{target: {'operand types': count}} of the custom calls in a lowered (StableHLO) program: what jax asked
    XLA for, before XLA's passes rewrite or expand them."""
    calls: dict[str, Counter] = {}
    for m in _LOWERED_CALL.finditer(stablehlo_text):
        types = ", ".join(_TENSOR_ELEMENT.findall(m["types"]))
        calls.setdefault(m["target"], Counter())[types] += 1
    return {t: dict(c.most_common()) for t, c in sorted(calls.items())}


def array_shapes(hlo_text: str) -> set[tuple[str, tuple[int, ...]]]:
    """Every (element type, dims) that appears in the program."""
    return {(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d)) for m in _ARRAY.finditer(hlo_text)}


_STACKED_PARAMETER = re.compile(
    r"%[\w.\-]+ = (?P<dtype>\w+)\[(?P<dims>[0-9,]+)\]\{[0-9,]*\} parameter\(\d+\), "
    r"metadata=\{op_name=\"state\.params\[\\?'\w*layers\\?'\]")


def stacked_weight_copies(hlo_text: str) -> dict[str, int]:
    """Arrays of the compiled program that hold a whole layer stack of a parameter in another dimension order
    ('f32[3584,58,8,2048]': bytes of one): XLA's relayout of a stacked weight for a gather (moejax/parallel/
    layouts.py), or of its gradient. Found by shape: the stacked parameter's dims (layers first) permuted so
    that the layer dim is not first. Stacks whose layer count equals another of their dims are not checked."""
    stacks = set()
    for m in _STACKED_PARAMETER.finditer(hlo_text):
        dims = tuple(int(d) for d in m["dims"].split(","))
        if len(dims) >= 3 and dims.count(dims[0]) == 1:
            stacks.add((m["dtype"], dims))
    copies = {}
    for dtype, dims in array_shapes(hlo_text):
        for stack_dtype, stack in stacks:
            if dtype == stack_dtype and dims != stack and sorted(dims) == sorted(stack) and dims[0] != stack[0]:
                copies[f"{dtype}[{','.join(map(str, dims))}]"] = math.prod(dims) * DTYPE_BYTES[dtype]
    return dict(sorted(copies.items()))


_TE_GEMM = re.compile(r"= \((?P<out>\w+)\[(?P<out_dims>[0-9,]*)\](?:\{[0-9,]*\})?, "  # the output, then
                      r"u8\[(?P<workspace>\d+)\][^)]*\) custom-call\(.*?"  # the cuBLAS workspace (V2: + 2 small)
                      r'custom_call_target="te_grouped_gemm(?P<v2>_v2)?_ffi", '
                      r"operand_layout_constraints=\{(?P<ops>.*?)\}, "
                      r'api_version.*?op_name="(?P<op>[^"]*)"')
_AD_TRANSFORM = re.compile(r"transpose\(jvp\(\)\)|jvp\(\)")
_OPERAND = re.compile(r"(\w+)\[[0-9,]*\](?:\{[0-9,]*\})?")


def te_grouped_gemms(hlo_text: str) -> list[dict]:
    """Transformer Engine's grouped GEMMs in a compiled program, one dict each: 'kind' (forward: x . w, also when
    a remat recomputes it; dgrad: dy . w^T; wgrad: x^T . dy, a [G, K, N] output; told by the op's autodiff
    transform, not by TE's transpose flags, which Hopper's FP8 layouts change), 'operands' (lhs, lhs scales, rhs,
    rhs scales element types: e.g. f8e4m3fn, f8e8m0fnu, f8e4m3fn, f8e8m0fnu for MXFP8), 'out' ('bf16[1536,256]'),
    'workspace_bytes' (the cuBLAS workspace each call returns beside its output) and 'v2' (TE's CUDA-graph-safe
    path, no host sync)."""
    gemms = []
    for m in _TE_GEMM.finditer(hlo_text):
        operands = _OPERAND.findall(m["ops"])
        transforms = _AD_TRANSFORM.findall(m["op"])  # outermost first: the last says what this call computes
        backward = bool(transforms) and transforms[-1].startswith("transpose")
        kind = ("wgrad" if m["out_dims"].count(",") == 2 else "dgrad") if backward else "forward"
        gemms.append({"kind": kind, "operands": tuple(operands[:4]), "out": f"{m['out']}[{m['out_dims']}]",
                      "workspace_bytes": int(m["workspace"]), "v2": bool(m["v2"])})
    return gemms
