"""Which device sits at each mesh coordinate, given each device's NVLink domain.

Pure Python on objects with `id` and `process_index` (real jax devices or test stand-ins), so the layout
can be checked for 144 devices without having them. The rule: `context`, `expert` and `tensor` (the axes whose
collectives run every layer: context all-gathers, all-to-all dispatch, tensor all-reduces) are laid out inside one domain;
`data` and `fsdp` take the remaining positions inside a domain (fsdp first: its gathers run every layer,
data's reduction once a step) and then span domains. `stage` (pipeline stages: one activation hand-off per
micro-batch and stage, point to point) is outermost: each stage takes whole domains, or, with more stages than
domains, an equal piece of every domain that still holds whole expert groups. The result depends only on the set of devices and
their domains, never on the order a process lists them in, so every process of a job builds the same mesh.
"""

from __future__ import annotations

import math

import numpy as np

from moejax.config import MESH_AXES
from moejax.errors import InputError


class MeshLayoutError(InputError, ValueError):
    """A mesh that cannot respect the NVLink domains; the message says why and what to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _by_domain(devices, domains) -> list[list]:
    groups: dict[int, list] = {}
    for d, dom in zip(devices, domains):
        groups.setdefault(dom, []).append(d)
    return [sorted(groups[k], key=lambda d: (d.process_index, d.id)) for k in sorted(groups)]


def hybrid_device_grid(sizes: dict[str, int], devices, domains, *, allow_cross_domain: bool = False,
                       where: str = "") -> np.ndarray:
    """Object array of shape [stage, data, fsdp, context, expert, tensor] of the devices; context x expert x tensor
    groups inside one domain, stages across domains. `where` names the topology in error messages."""
    n = len(devices)
    sizes = {"stage": 1, "context": 1, **sizes}  # a layout without stages or context split may leave them out
    if math.prod(sizes[a] for a in MESH_AXES) != n:
        raise MeshLayoutError(f"mesh axes {sizes} multiply to {math.prod(sizes.values())}, not {n} devices")
    stages = sizes["stage"]
    inner_sizes = {a: s for a, s in sizes.items() if a != "stage"}
    by_domain = _by_domain(devices, domains)
    if stages == 1:
        groups = [by_domain]
    elif len(by_domain) % stages == 0:  # each stage takes whole domains
        per_stage = len(by_domain) // stages
        groups = [by_domain[i * per_stage:(i + 1) * per_stage] for i in range(stages)]
    else:
        groups = _stages_inside_domains(sizes, by_domain, where)
    grids = [_stage_grid(inner_sizes, [d for g in group for d in g], [k for k, g in enumerate(group) for _ in g],
                         allow_cross_domain=allow_cross_domain, where=where) for group in groups]
    return np.stack(grids)


def _stages_inside_domains(sizes, by_domain, where: str) -> list[list[list]]:
    """More stages than domains (or a count the domains do not divide by): every domain is cut into equal pieces,
    one per stage (its expert x tensor groups then lie inside one domain)."""
    stages, n_domains, per_domain = sizes["stage"], len(by_domain), len(by_domain[0])
    pieces = stages // n_domains if stages % n_domains == 0 else 0
    if not pieces or per_domain % pieces or any(len(g) != per_domain for g in by_domain):
        raise MeshLayoutError(
            f"mesh.stage={stages} does not split {n_domains} NVLink domains of {per_domain} devices{where} into "
            "equal stages: use a stage count that divides the domain count, or a multiple of it that divides "
            "each domain")
    piece = per_domain // pieces  # n / stages devices, which the expert x tensor groups divide (the axes' product)
    return [[g[j * piece:(j + 1) * piece]] for g in by_domain for j in range(pieces)]


def _stage_grid(sizes: dict[str, int], devices, domains, *, allow_cross_domain: bool, where: str) -> np.ndarray:
    """One stage's devices as an object array [data, fsdp, context, expert, tensor]; context x expert x tensor
    groups inside one domain."""
    by_domain = _by_domain(devices, domains)
    flat = [d for group in by_domain for d in group]
    shape = tuple(sizes[a] for a in MESH_AXES if a != "stage")
    inner = sizes["context"] * sizes["expert"] * sizes["tensor"]
    counts = sorted({len(g) for g in by_domain})
    per_domain = counts[0]
    fits = len(counts) == 1 and per_domain % inner == 0
    if not fits:
        if allow_cross_domain:
            return _object_array(flat).reshape(shape)  # domain order still keeps most groups together
        if len(counts) > 1:
            raise MeshLayoutError(
                f"NVLink domains hold different numbers of devices ({', '.join(map(str, counts))}){where}: "
                "launch the same number of devices per domain, set mesh.domain_size, or set "
                "mesh.allow_cross_domain_experts=True")
        context = f"mesh.context={sizes['context']} x " if sizes["context"] > 1 else ""
        raise MeshLayoutError(
            f"{context}mesh.expert={sizes['expert']} x mesh.tensor={sizes['tensor']} = {inner} devices per expert group "
            f"does not divide the {per_domain} devices of an NVLink domain ({len(by_domain)} domains{where}): "
            "some group would span two domains and its all-to-all would cross the NICs; use expert x tensor "
            f"dividing {per_domain} ({', '.join(map(str, _divisors(per_domain)))}), launch a device count per "
            "domain that it divides (mesh.domain_size, e.g. 64 of an NVL72 rack's 72), or set "
            "mesh.allow_cross_domain_experts=True")
    slots = per_domain // inner  # data x fsdp positions inside one domain
    fsdp_in = math.gcd(sizes["fsdp"], slots)
    data_in = slots // fsdp_in
    if sizes["data"] % data_in:
        raise MeshLayoutError(
            f"mesh.data={sizes['data']} x mesh.fsdp={sizes['fsdp']} cannot fill {slots} positions per domain "
            f"and {len(by_domain)} domains{where}; make mesh.fsdp or mesh.data a multiple of {slots}")
    data_out, fsdp_out = sizes["data"] // data_in, sizes["fsdp"] // fsdp_in
    grid = _object_array(flat).reshape(data_out, fsdp_out, data_in, fsdp_in, inner)
    return grid.transpose(0, 2, 1, 3, 4).reshape(shape)


def _object_array(items) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def groups_along(grid: np.ndarray, axes: tuple[str, ...]) -> list[list]:
    """The device groups that communicate over `axes` (all other coordinates fixed)."""
    idx = [MESH_AXES.index(a) for a in axes]
    rest = [i for i in range(len(MESH_AXES)) if i not in idx]
    size = math.prod(grid.shape[i] for i in idx)
    return [list(g) for g in grid.transpose(rest + idx).reshape(-1, size)]
