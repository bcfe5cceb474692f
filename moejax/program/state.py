"""TrainState: model parameters, non-trained model state (router bias), optimizer state and step.

The state is created inside `jax.jit` with out_shardings computed from the parameters' logical axes, so
every array is born sharded on the mesh; nothing is materialised on one device first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.model.transformer import Transformer, moe_stack_repeats
from moejax.parallel.mesh import logical_to_spec


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
                      opt_state=tx.init(params))


def state_shardings(abstract_state, mesh: Mesh):
    """NamedSharding per leaf: Variables (params, and the optimizer moments that mirror them) follow
    their logical axes; scalars and counters are replicated."""

    def sharding_of(x):
        if _is_variable(x):
            names = x.get_metadata().get("logical_axes")
            spec = logical_to_spec(names) if names is not None else P()
            # Keep the Variable node so the shardings tree has exactly the state's structure.
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, P())

    return jax.tree.map(sharding_of, abstract_state, is_leaf=_is_variable)


def abstract_state(cfg, tx):
    return jax.eval_shape(functools.partial(_create_state, cfg, tx, 0))


def init_state(cfg, tx, mesh: Mesh, seed: int) -> tuple[TrainState, object]:
    """(state sharded on mesh, its shardings)."""
    shardings = state_shardings(abstract_state(cfg, tx), mesh)
    create = jax.jit(functools.partial(_create_state, cfg, tx), static_argnums=0, out_shardings=shardings)
    with jax.set_mesh(mesh):
        return create(seed), shardings


def stacked_like(saved_cfg: dict, cfg):
    """The config `cfg` as the run that wrote a checkpoint stored its MoE stack, or None when the shapes agree.

    Pipeline stages with virtual stages store the MoE stack as [V, L / V, ...] (model/transformer.py), any other
    layout as [L, ...]; both hold the layers in layer order, so a checkpoint of one restores onto the other by a
    reshape (restack). The stage count alone changes no shape."""
    saved_mesh = saved_cfg.get("mesh", {})
    like = cfg.copy_and_resolve_references()
    with like.unlocked():
        like.mesh.stage = int(saved_mesh.get("stage", 1))
        like.mesh.virtual_stages = int(saved_mesh.get("virtual_stages", 1))
    return None if moe_stack_repeats(like) == moe_stack_repeats(cfg) else like


def restack(state: TrainState, abstract, shardings, mesh: Mesh) -> TrainState:
    """A state restored in another stacking of the MoE stack ([V', L / V', ...] or [L, ...]) in this run's shapes
    and shardings (the element order is the layer order in both)."""
    targets, treedef = jax.tree.flatten(abstract)  # this run's leaves and metadata (logical axes), same key order

    def reshape(leaves):
        return treedef.unflatten([a.reshape(t.shape) for a, t in zip(leaves, targets, strict=True)])

    with jax.set_mesh(mesh):
        return jax.jit(reshape, out_shardings=shardings)(jax.tree.leaves(state))


def restore_shardings(abstract, mesh: Mesh):
    """state_shardings, with a dim left whole where its mesh axes do not divide it (a restore target in another
    stacking: [V', L / V'] need not split over this run's stages)."""
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

    return jax.tree.map(even, state_shardings(abstract, mesh), abstract)
