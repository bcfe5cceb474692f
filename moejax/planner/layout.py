"""A candidate layout: mesh axis sizes, remat policy, micro-batch and dispatch mode; and where its axes sit
relative to the NVLink domains (the same placement rule as parallel/device_grid.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moejax.config import MESH_AXES


@dataclass(frozen=True)
class Layout:
    data: int
    fsdp: int
    expert: int
    tensor: int
    remat: str  # none | dots | full
    micro_batch: int  # sequences per device per forward/backward pass
    dispatch: str  # capacity | allgather | dropless
    stage: int = 1  # pipeline stages (the planner does not search them yet)

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp * self.expert

    def name(self) -> str:
        axes = " x ".join(f"{a}{s}" for a, s in self.sizes.items() if s > 1) or "1 device"
        return f"{axes} | remat {self.remat} | mb {self.micro_batch} | {self.dispatch}"

    def to_dict(self) -> dict:
        return asdict(self)


def in_domain_factors(sizes: dict[str, int], domain_size: int) -> dict[str, int]:
    """How many of each axis's positions lie inside one NVLink domain: expert and tensor entirely, then
    fsdp, then data fill what the domain has left (device_grid.hybrid_device_grid's rule)."""
    if domain_size <= 0:
        return dict(sizes)
    inner = sizes["expert"] * sizes["tensor"]
    slots = max(1, domain_size // inner) if domain_size % inner == 0 else 1
    fsdp_in = math.gcd(sizes["fsdp"], slots)
    data_in = math.gcd(sizes["data"], slots // fsdp_in)
    return {"data": data_in, "fsdp": fsdp_in, "expert": sizes["expert"], "tensor": sizes["tensor"]}
