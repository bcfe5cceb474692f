"""TrainState: model parameters, non-trained model state (router bias), optimizer state and step.

The state is created inside `jax.jit` with out_shardings computed from the parameters' logical axes, so
every array is born sharded on the mesh; nothing is materialised on one device first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.model.layer_stack import moe_stack_layout
from moejax.model.transformer import Transformer
from moejax.parallel.mesh import logical_to_spec
from moejax.program.optim import init_optimizer_state


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State  # nnx.Param leaves, trained by the optimizer
    model_state: nnx.State  # everything else in the model (router bias), updated by the step itself
    opt_state: optax.OptState


def _is_variable(x):
    return isinstance(x, nnx.Variable)


def create_model(cfg, seed: int) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def model_graphdef(cfg):
    """The static model structure (no arrays allocated)."""
    abstract = nnx.eval_shape(lambda: create_model(cfg, 0))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    return graphdef


def _create_state(cfg, tx, seed) -> TrainState:
    _, params, model_state = nnx.split(create_model(cfg, seed), nnx.Param, ...)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                      opt_state=init_optimizer_state(cfg.optim, tx, params))


def optimizer_state_axes(cfg) -> tuple[str, ...]:
    """Mesh axes the Adam moments are split over beyond their parameters' (optim.state_sharding)."""
    return ("data",) if cfg.optim.get("state_sharding", "params") == "data" else ()


def split_further(spec: P, shape, axis_sizes, axes: tuple[str, ...]) -> P:
    """spec (of an array of `shape` on a mesh of axis_sizes: {axis: size}) with `axes` (those of size > 1 it does
    not use yet) added to the dim that keeps the largest slice and divides evenly; unchanged where no dim divides
    (small leaves stay replicated over them)."""
    entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in list(spec) + [None] * (len(shape) - len(spec))]
    used = {a for e in entries for a in e}
    extra = tuple(a for a in axes if axis_sizes[a] > 1 and a not in used)
    n_extra = math.prod(axis_sizes[a] for a in extra)
    if n_extra == 1:
        return spec
    local = [dim // math.prod(axis_sizes[a] for a in e) for dim, e in zip(shape, entries)]
    fits = [i for i in range(len(shape)) if local[i] % n_extra == 0 and shape[i] % math.prod(
        axis_sizes[a] for a in entries[i]) == 0]
    if not fits:
        return spec
    best = max(fits, key=lambda i: (local[i], i))
    entries[best] = (*entries[best], *extra)
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def state_shardings(abstract_state, mesh: Mesh, *, moments_over: tuple[str, ...] = ()):
    """NamedSharding per leaf: Variables (params, and the optimizer moments that mirror them) follow
    their logical axes; scalars and counters are replicated. moments_over (optimizer_state_axes): a TrainState's
    optimizer moments are also split over these mesh axes (a distributed optimizer)."""

    def sharding_of(x, over=()):
        if _is_variable(x):
            names = x.get_metadata().get("logical_axes")
            spec = logical_to_spec(names) if names is not None else P()
            if over:
                spec = split_further(spec, x.get_value().shape, mesh.shape, over)
            # Keep the Variable node so the shardings tree has exactly the state's structure.
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, P())

    shardings = jax.tree.map(sharding_of, abstract_state, is_leaf=_is_variable)
    if moments_over and isinstance(abstract_state, TrainState):
        opt = jax.tree.map(lambda x: sharding_of(x, moments_over), abstract_state.opt_state, is_leaf=_is_variable)
        shardings = shardings.replace(opt_state=opt)
    return shardings


def train_state_shardings(cfg, abstract: TrainState, mesh: Mesh) -> TrainState:
    """state_shardings of a run's train state: the optimizer moments where cfg.optim.state_sharding puts them."""
    return state_shardings(abstract, mesh, moments_over=optimizer_state_axes(cfg))


def abstract_state(cfg, tx):
    return jax.eval_shape(functools.partial(_create_state, cfg, tx, 0))


def init_state(cfg, tx, mesh: Mesh, seed: int) -> tuple[TrainState, object]:
    """(state sharded on mesh, its shardings)."""
    shardings = train_state_shardings(cfg, abstract_state(cfg, tx), mesh)
    create = jax.jit(functools.partial(_create_state, cfg, tx), static_argnums=0, out_shardings=shardings)
    with jax.set_mesh(mesh):
        return create(seed), shardings


def stacked_like(saved_cfg: dict, cfg):
    """The config `cfg` as the run that wrote a checkpoint stored its MoE stack, or None when the storage agrees.

    Pipeline stages with virtual stages or an uneven split store the MoE stack in padded chunk slots [V, S C, ...]
    (model/layer_stack.py's moe_stack_layout), any other layout as [L, ...]; a checkpoint of one restores onto the
    other by moving each layer to its slot (restack). The stage count of an even split alone changes no shape."""
    saved_mesh = saved_cfg.get("mesh", {})
    like = cfg.copy_and_resolve_references()
    with like.unlocked():
        like.mesh.stage = int(saved_mesh.get("stage", 1))
        like.mesh.virtual_stages = int(saved_mesh.get("virtual_stages", 1))
    return None if moe_stack_layout(like) == moe_stack_layout(cfg) else like


def restack(state: TrainState, abstract, shardings, mesh: Mesh, saved_like, cfg) -> TrainState:
    """A state restored in another storage of the MoE stack (stacked_like's `saved_like`) in this run's (`cfg`)
    shapes and shardings:
    every leaf under the MoE stack (parameters, router bias, optimizer moments) has each layer moved from its saved
    slot to its slot here, identity slots zero; the other leaves keep their shapes."""
    saved, wanted = moe_stack_layout(saved_like), moe_stack_layout(cfg)
    paths_targets, treedef = jax.tree.flatten_with_path(abstract)  # this run's leaves, same key order

    def move(a, path, target):
        if "moe_layers" not in jax.tree_util.keystr(path):
            return a.reshape(target.shape)
        layers_LxR = saved.from_slots(a.reshape(saved.n_slots, *a.shape[len(saved.lead):]))
        return wanted.to_slots(layers_LxR).reshape(target.shape)

    def restacked(leaves):
        return treedef.unflatten([move(a, path, t) for a, (path, t) in zip(leaves, paths_targets, strict=True)])

    with jax.set_mesh(mesh):
        return jax.jit(restacked, out_shardings=shardings)(jax.tree.leaves(state))


def restore_shardings(cfg, abstract, mesh: Mesh):
    """train_state_shardings, with a dim left whole where its mesh axes do not divide
    it (a restore target in another stacking: [V', L / V'] need not split over this run's stages)."""
    def even(sharding, leaf):
        spec = list(sharding.spec) + [None] * (len(leaf.shape) - len(sharding.spec))
        for i, axes in enumerate(spec):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            n = 1
            for a in names:
                n *= mesh.shape[a]
            if leaf.shape[i] % n:
                spec[i] = None
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(even, train_state_shardings(cfg, abstract, mesh), abstract)
