"""Recompute factor of a remat policy (hardware FLOPs / model FLOPs), from the traced training program.

The loss's forward + backward (`jax.vjp` of the real loss on abstract inputs, micro-batch 1) is traced to a
jaxpr under each policy and the FLOPs of its matrix multiplications are counted: every `dot_general`,
`ragged_dot_general` (2 x multiply-adds; a ragged grouped matmul counts its rows once, not once per group) and
block-scaled `scaled_matmul` (mxfp8 on GPUs),
inside scans times their length, inside `cond` the largest branch, inside a while loop (dropless overflow
rounds, data-dependent) none: the plan is for steps whose load fits the receive window. Without remat the program is the forward
and its two backward GEMMs per forward GEMM; under a policy the backward also recomputes every forward
operation the policy did not save. The factor is FLOPs(policy) / FLOPs(none):

  full   nothing saved inside a block: each block's forward runs twice (about 4/3; a little less, since the
         embedding, the LM heads and the loss are outside the remat'd blocks)
  dots   `checkpoint_dots_with_no_batch_dims` saves the outputs of matmuls without batch dims (projections,
         the shared expert, the router) but not batched ones: core attention (QK^T, PV over batch x heads)
         and the routed experts (a batched einsum over experts, or a ragged grouped matmul) are recomputed

Both programs are counted the same way (the XLA reference attention computes the full L x L square, capacity
dispatch its padded slots), so those conventions cancel in the ratio. Routed experts are traced as the
platform runs them (planner/activations.trace_config: a dropless layer is a ragged grouped matmul on GPU).
Cached per config and policy.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from moejax.kernels import te_gemm
from moejax.planner.activations import abstract_loss, trace_config


def _matmul_flops(eqn) -> int | None:
    """2 x multiply-adds of a dot_general / ragged_dot_general; None for any other primitive."""
    name = eqn.primitive.name
    if name == "scaled_matmul_wrapper":  # jax.nn.scaled_matmul (mxfp8 on GPUs): lhs [B, M, K] x rhs [B, N, K]
        lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
        return 2 * int(np.prod(lhs, dtype=np.int64)) * int(rhs[1])
    if name == "dot_general":
        (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
        group = ()
    elif name == "ragged_dot_general":
        dims = eqn.params["ragged_dot_dimension_numbers"]
        (_, rhs_contract), (_, rhs_batch) = dims.dot_dimension_numbers
        group = tuple(dims.rhs_group_dimensions)
    else:
        return None
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    # Every lhs element meets every rhs column that is not contracted, batched or a group index.
    skip = set(rhs_contract) | set(rhs_batch) | set(group)
    rhs_free = [d for i, d in enumerate(rhs) if i not in skip]
    return 2 * int(np.prod(lhs, dtype=np.int64)) * int(np.prod(rhs_free, dtype=np.int64))


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(v, jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jcore.Jaxpr):
                yield v


def _gpu_branch(platform_index_eqn) -> int:
    """The branch lax.platform_dependent takes when compiling for CUDA."""
    platforms = platform_index_eqn.params["platforms"]  # e.g. (('cpu',), None): None is the default branch
    for i, names in enumerate(platforms):
        if names is not None and "cuda" in names:
            return i
    return platforms.index(None)


def matmul_flops(jaxpr) -> int:
    """Matmul FLOPs of one run of a jaxpr as compiled for GPUs: scans times their length, a cond its largest
    branch, a lax.platform_dependent choice its CUDA branch."""
    total = 0
    platform_choice = {}  # outvar of a platform_index -> the branch the GPU program takes
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "platform_index":
            platform_choice[eqn.outvars[0]] = _gpu_branch(eqn)
            continue
        flops = _matmul_flops(eqn)
        if flops is not None:
            total += flops
            continue
        subs = [matmul_flops(j) for j in _subjaxprs(eqn)]
        if not subs:
            continue
        if eqn.primitive.name == "cond":
            index = eqn.invars[0]
            chosen = platform_choice.get(index) if isinstance(index, jcore.Var) else None
            total += subs[chosen] if chosen is not None else max(subs)
        elif eqn.primitive.name == "while":
            continue  # data-dependent trip count: dropless overflow rounds, which a step within its window skips
        else:
            total += sum(subs) * (int(eqn.params["length"]) if eqn.primitive.name == "scan" else 1)
    return total


@functools.lru_cache(maxsize=64)
def _step_flops(cfg_json: str, seq_len: int) -> int:
    """Matmul FLOPs of forward + backward of the loss for one sequence, under the config's remat policy."""
    import ml_collections

    loss, params, rest = abstract_loss(ml_collections.ConfigDict(json.loads(cfg_json)))
    tokens = jax.ShapeDtypeStruct((1, seq_len + 1), jnp.int32)
    with te_gemm.stand_in():  # Transformer Engine's grouped GEMM as its emulation: TE is not traced here
        step = jax.make_jaxpr(lambda *args: jax.vjp(loss, *args)[1](jnp.float32(1.0)))(params, rest, tokens, tokens)
    return matmul_flops(step.jaxpr)


def step_flops(cfg, remat: str, *, dispatch: str | None = None, platform: str = "gpu", seq_len: int | None = None) -> int:
    """Matmul FLOPs of one sequence's forward + backward under `remat` (what the hardware runs)."""
    seq = int(cfg.train.seq_len if seq_len is None else seq_len)
    # FP8 changes no GEMM's FLOPs: the ratio is the model's, traced without FP8 (with it, the expert GEMMs would be
    # the tiled einsum, whose padding and one-hot weight-gradient sum at this trace's expert parallelism 1 say
    # nothing of the layout's recompute ratio).
    no_fp8 = cfg.copy_and_resolve_references()
    with no_fp8.unlocked():
        no_fp8.model.fp8 = "none"
    c = trace_config(no_fp8, remat=remat, dispatch=dispatch, platform=platform)
    # The attention math as the model defines it: a flash kernel's own recompute inside its backward is the
    # kernel's cost, not the remat policy's (trace_config's flash_residuals stand-in is for memory).
    c.kernels.attention = "xla"
    return _step_flops(c.to_json_best_effort(sort_keys=True), seq)


def recompute_factor(cfg, remat: str, *, dispatch: str | None = None, platform: str = "gpu",
                     seq_len: int | None = None, cfg_json: str | None = None) -> float:
    """Hardware FLOPs / model FLOPs of the policy: the traced step's matmul FLOPs under `remat` over those
    without remat (1.0 for none)."""
    if remat == "none":
        return 1.0
    return _recompute_factor(cfg_json or cfg.to_json_best_effort(sort_keys=True), remat, dispatch, platform, seq_len)


@functools.lru_cache(maxsize=256)  # a search asks per layout; the answer depends on the policy and dispatch only
def _recompute_factor(cfg_json: str, remat: str, dispatch, platform: str, seq_len) -> float:
    import ml_collections

    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    kw = dict(dispatch=dispatch, platform=platform, seq_len=seq_len)
    return step_flops(cfg, remat, **kw) / step_flops(cfg, "none", **kw)
