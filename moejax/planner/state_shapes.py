"""The train state's leaves as data (shape, dtype, logical axes), from an abstract model: nothing allocated.

Parameter shapes come from `nnx.eval_shape` of the real model (program/state.py), so the planner follows
whatever attention or FFN the config builds (MHA, GQA, MLA, MTP) instead of re-deriving formulas.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import jax
import ml_collections
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.parallel.mesh import LOGICAL_RULES
from moejax.program.optim import make_optimizer
from moejax.program.state import abstract_state, split_further


LAYER_AXES = ("layers", "stage_layers", "repeat")  # logical names of the layer-stacking dims (parallel/mesh.py)


@dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    itemsize: int
    logical: tuple[str | None, ...]

    @property
    def layer_dims(self) -> int:
        """Leading dims that stack layers: 1 for a scanned stack [L, ...] or a pipelined one [L, ...] split over
        `stage`, 2 for a pipelined stack with virtual stages [V, L / V, ...]; 0 for a leaf outside the stacks."""
        n = 0
        while n < len(self.logical) and self.logical[n] in LAYER_AXES:
            n += 1
        return n

    @property
    def stacked(self) -> bool:
        """Stacked over layers (run inside the scan): its collectives run once per layer."""
        return self.layer_dims > 0

    @property
    def pipelined(self) -> bool:
        """Part of the MoE stack the pipeline stages split (logical 'stage_layers')."""
        return "stage_layers" in self.logical[:self.layer_dims]

    @property
    def n_layers(self) -> int:
        return math.prod(self.shape[:self.layer_dims])

    def local_layers(self, sizes: dict[str, int]) -> int:
        """Layers of the stack one device holds (a pipeline stage holds L / stages)."""
        return math.prod(self.local_shape(sizes)[:self.layer_dims])

    @property
    def expert(self) -> bool:
        return "expert" in self.logical

    def mesh_axes(self, dim: int) -> tuple[str, ...]:
        rule = LOGICAL_RULES.get(self.logical[dim]) if self.logical[dim] else None
        return () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))

    def local_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """Per-device shape (XLA pads uneven shards, hence the ceiling)."""
        return tuple(math.ceil(n / math.prod(sizes[a] for a in self.mesh_axes(i))) for i, n in enumerate(self.shape))

    def local_bytes(self, sizes: dict[str, int], drop: tuple[str, ...] = ()) -> int:
        """Bytes of one device's shard; axes in `drop` are treated as unsharded (e.g. fsdp, gathered)."""
        kept = {a: (1 if a in drop else s) for a, s in sizes.items()}
        return math.prod(self.local_shape(kept)) * self.itemsize

    def split_further(self, sizes: dict[str, int], axes: tuple[str, ...]) -> "Leaf":
        """This leaf as a distributed optimizer stores its moments: also split over `axes` where a dim divides
        (program/state.split_further), expressed as a leaf whose dims carry those mesh axes."""
        spec = P(*(self.mesh_axes(i) or None for i in range(len(self.shape))))
        further = split_further(spec, self.shape, sizes, axes)
        return _SplitLeaf(self.path, self.shape, self.itemsize, self.logical,
                          tuple(((e,) if isinstance(e, str) else tuple(e or ())) for e in
                                list(further) + [None] * (len(self.shape) - len(further))))

    def sharded_over(self, axis: str) -> bool:
        return any(axis in self.mesh_axes(i) for i in range(len(self.shape)))


@dataclass(frozen=True)
class _SplitLeaf(Leaf):
    """A Leaf whose mesh axes per dim are given (a distributed optimizer's moment), not read from LOGICAL_RULES."""

    axes: tuple[tuple[str, ...], ...] = ()

    def mesh_axes(self, dim: int) -> tuple[str, ...]:
        return self.axes[dim]


def _leaves(tree) -> list[Leaf]:
    out = []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, x in flat:
        value = x.get_value() if isinstance(x, nnx.Variable) else x
        names = x.get_metadata().get("logical_axes") if isinstance(x, nnx.Variable) else None
        if not hasattr(value, "shape"):
            continue
        names = tuple(names) if names is not None else (None,) * len(value.shape)
        out.append(Leaf(jax.tree_util.keystr(path), tuple(value.shape), value.dtype.itemsize, names))
    return out


@functools.lru_cache(maxsize=64)
def _state_leaves_cached(cfg_json: str):
    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    state = abstract_state(cfg, make_optimizer(cfg.optim))
    return _leaves(state.params), _leaves(state.model_state), _leaves(state.opt_state)


def state_leaves(cfg) -> tuple[list[Leaf], list[Leaf], list[Leaf]]:
    """(parameters, other model state, optimizer state) of the abstract train state."""
    return _state_leaves_cached(cfg.to_json_best_effort(sort_keys=True))
