"""Imports point one way: each part of moejax may import only the parts in the layers below it (and itself).

The layers, bottom first (README, "Architecture"):

    errors, units, remat_names leaves
    config                     schema, pure validation, the table of fields that may change between runs
    kernels                    the hot-path kernels (attention, grouped GEMM, loss) and which one runs where
    data, parallel             the data pipeline; devices -> mesh, dispatch, topology, HLO reading
    model                      Flax modules (logical axis names only)
    interop                    Hugging Face / weights directories
    program                    train state, optimizer, the jitted step: what training runs and planning compiles
    planner, training, report  the planner and dry run; the training loop and its parts; reports of a run
    inference                  a saved model loaded for evaluation and generation
    api                        the Python API: composes checks and runs
    moejax (package), cli      entry points: the package exports the API; the command-line tools
    train                      `python -m moejax.train`, which is moejax-train

Every import counts, including the ones inside functions. `python tests/test_architecture.py` prints the
package-level import graph.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moejax"

LAYERS = (
    ("errors", "units", "remat_names"),
    ("config",),
    ("kernels",),
    ("data", "parallel"),
    ("model",),
    ("interop",),
    ("program",),
    ("planner", "training", "report"),
    ("inference",),
    ("api",),
    ("__init__", "cli"),
    ("train",),
)
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str:
    """'moejax.planner.comm' -> 'planner'; 'moejax' -> '__init__'."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> dict[str, set[str]]:
    """{importing module: moejax modules it imports}, every import statement of every file."""
    out = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        module = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the module's package
                    base = parts if is_init else parts[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from moejax import api` imports the module moejax.api, not just the package.
                targets = [f"{source}.{a.name}" if _is_module(f"{source}.{a.name}") else source for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            out[module].update(t for t in targets if t == "moejax" or t.startswith("moejax."))
    return out


def violations() -> list[str]:
    bad = []
    for module, targets in sorted(imports().items()):
        src = _part(module)
        for target in sorted(targets):
            dst = _part(target)
            if dst == src:
                continue
            if src not in LAYER_OF or dst not in LAYER_OF:
                bad.append(f"{module} -> {target}: {src if src not in LAYER_OF else dst!r} has no layer in LAYERS")
            elif LAYER_OF[dst] >= LAYER_OF[src]:
                bad.append(f"{module} -> {target}: {src} (layer {LAYER_OF[src]}) may not import {dst} "
                           f"(layer {LAYER_OF[dst]})")
    return bad


def package_graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for module, targets in imports().items():
        for target in targets:
            if _part(target) != _part(module):
                graph[_part(module)].add(_part(target))
    return graph


def test_imports_point_down():
    bad = violations()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_every_part_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.is_file() and p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts <= set(LAYER_OF), f"parts of moejax without a layer: {sorted(parts - set(LAYER_OF))}"


def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch):
    # The rule must be able to fail: a config module importing the data package is reported.
    fake = tmp_path / "moejax"
    (fake / "config").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "config" / "__init__.py").write_text("def f():\n    from moejax.data.corpus import BYTE_VOCAB\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations() == ["moejax.config -> moejax.data.corpus: config (layer 1) may not import data (layer 3)"]


def test_importing_moejax_does_not_start_jax():
    import subprocess

    code = "import sys, moejax; assert callable(moejax.train); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


if __name__ == "__main__":
    for part, targets in sorted(package_graph().items(), key=lambda kv: LAYER_OF.get(kv[0], 99)):
        print(f"{part:10s} -> {', '.join(sorted(targets, key=lambda t: LAYER_OF.get(t, 99)))}")
    for line in violations():
        print("VIOLATION", line)
