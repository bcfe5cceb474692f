"""Activation memory per device, from the real model traced on abstract inputs (nothing is allocated).

Three terms, each from `saved_residuals` (the residuals autodiff keeps for the backward) of the real code,
so MHA/GQA/MLA/MoE/MTP need no formulas:

  saved       the loss under the config's remat policy: what the forward keeps for the backward. The scan
              over layers saves its per-layer residuals stacked, so their sizes come out of the model itself.
  layer       one block's transient: what the backward of a remat'd block rematerialises and holds until its
              backward consumes it, i.e. the block's residuals without remat minus those the policy saved
              (largest block kind: dense or MoE; an MTP module's block is a MoE block). Under the XLA
              reference attention (`jax.nn.dot_product_attention`'s default) this holds the [B, H, L, L]
              scores and probabilities; for the MoE it holds the dispatch buffers and expert activations.
  logits      the loss over the vocabulary. The chunked kernel (kernels.loss auto/chunked) holds one chunk at a
              time: [micro_batch, loss_chunk, vocab] f32 logits and, in the backward, the logits' gradient in
              the compute dtype (on CPU also the f32 softmax and gradient XLA:CPU does not fuse away).
              The dense kernel: [micro_batch, seq, vocab] logits in f32 and their f32 log-softmax for every
              head, and in the backward one head's f32 cotangent of the log-softmax and its logits' gradient
              in the compute dtype; the log-softmax is a saved residual, moved here from `saved` so that it
              is counted once.

`layer` and `logits` are transients of different phases (the loss, the layers' backward): the peak holds
the larger of the two.

Context parallelism (context > 1): a device holds seq_len / context positions of each sequence, so all three are
traced at those positions (the chunked loss scans a device's own positions too); what attention holds of the whole
sequence (the gathered latent or K/V heads and the keys and values expanded from them, saved or rematerialised,
and their gradients) is added from planner/context.py: per layer to `saved`, and as `context_kv` for the layer
being differentiated. Flash kernels keep no L x L scores; XLA's reference attention (CPU) scores each local query
against the whole sequence, so its [.., L / C, L / C] residuals of the trace count C times.

Expert parallelism: the trace runs under an abstract mesh with the layout's `expert` axis (every other axis
1) and ep x micro_batch sequences, so the MoE code sizes its buffers as it does on ep devices (a dropless
receive buffer holds ep x T x min(K, E_local) rows, allgather gathers the group's tokens) instead of as if
ep were 1. Every residual is then a global array split over `expert` (the batch, or shard_map's per-device
residuals stacked), so a device's share is bytes / ep. Residuals that are not of hidden size (attention
heads, FFN intermediates, vocabulary) are split over `tensor`; the hidden-size ones (the residual stream,
norms) are replicated over it. A residual of a parameter's shape is that weight in the compute dtype (its
cast, kept for the backward: the LM head's under any policy, every layer's without remat): it counts at the
weight's per-device shard gathered over fsdp (split over expert and tensor as the weight is).

Routed experts run as the target platform runs them (`kernels.expert_gemm` auto): on GPU a dropless layer is one
ragged grouped matmul over the received rows (traced with lax.ragged_dot, whose residuals are the rows, like
tokamax's kernel); on CPU (the dry run) it is the tile loop over the window's rows padded per expert to whole
tiles (its residuals: the tiled rows and their gate and up projections). Transformer Engine's grouped GEMM
(`kernels.expert_gemm=te`) is traced as its emulation (kernels/te_gemm.py), which keeps what TE keeps: with FP8
the e4m3 copies of each GEMM's input and weight and their scales, not the bf16 ones.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from moejax.config import MESH_AXES
from moejax.config.layers import layer_plan
from moejax.kernels import te_gemm
from moejax.model.loss import lm_loss
from moejax.model.layer_stack import _remat
from moejax.model.transformer import Block
from moejax.planner.context import attention_layers, context_activations
from moejax.planner.state_shapes import state_leaves
from moejax.program.state import create_model

Residual = tuple[tuple[int, ...], int]  # (global shape, itemsize)


@dataclass(frozen=True)
class ActivationBytes:
    saved: int  # kept by the forward for the backward, all layers (policy's residuals, log-softmax excluded)
    layer: int  # one block's rematerialised internals during its backward
    logits: int  # the loss over the vocabulary (logits, log-softmax, one head's gradient)
    moe_layer: int = 0  # of `saved`: what one MoE block keeps (the scan stacks it per layer; pipeline stages per tick)
    context_kv: int = 0  # context > 1: the layer being differentiated's whole-sequence K/V beyond the local trace

    @property
    def transient(self) -> int:
        return max(self.layer + self.context_kv, self.logits)


def trace_config(cfg, *, remat: str, dispatch: str | None = None, platform: str = "gpu"):
    """The config as traced (without pipeline stages): the remat policy and dispatch mode of the layout, and a routed-expert kernel with
    the residuals of the one `auto` resolves to on the platform (a ragged grouped GEMM for dropless on GPU)."""
    c = cfg.copy_and_resolve_references()
    with c.unlocked():
        c.model.remat = remat
        # Traced without pipeline stages (no mesh here): the planner takes the per-block terms and places them on
        # the schedule's ticks itself (planner/memory.py).
        c.mesh.stage, c.mesh.virtual_stages = 1, 1
        if dispatch:
            c.moe.dispatch = dispatch
        # FP8 expert GEMMs: qwix's einsums (`auto`: kernels/resolve.py), or Transformer Engine's grouped GEMM when the
        # config names `te` (traced as its emulation: te_gemm.stand_in)
        accelerator = platform in ("gpu", "tpu")
        ragged = c.moe.dispatch == "dropless" and c.model.get("fp8", "none") == "none"
        if c.kernels.expert_gemm == "auto" or c.kernels.expert_gemm == "tokamax":
            c.kernels.expert_gemm = ("ragged_dot" if accelerator else "tile_loop") if ragged else "einsum"
        # The trace runs in this (CPU) process: a fused GPU attention kernel is traced as XLA's attention with
        # a flash kernel's residuals (no [B, H, L, L] scores kept); on CPU, XLA's reference.
        fused_attention = accelerator and c.kernels.attention != "xla"
        c.kernels.attention = "flash_residuals" if fused_attention else "xla"
        if c.kernels.loss == "auto":
            c.kernels.loss = "chunked"
    return c


def _mesh(expert: int):
    sizes = {a: (expert if a == "expert" else 1) for a in MESH_AXES}
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _collect(residuals, skip=lambda aval, source: False) -> tuple[Residual, ...]:
    out = []
    for aval, source in residuals:
        if "from the argument" in source or skip(aval, source):
            continue  # parameters and the batch: counted as state, not activations
        out.append((tuple(aval.shape), aval.dtype.itemsize))
    return tuple(out)


def _is_log_softmax(aval, source: str) -> bool:
    return "log_softmax" in source and "dense_cross_entropy" in source


def abstract_loss(cfg):
    """(loss(params, rest, tokens, segment_ids), abstract params, abstract other model state) of the real model:
    what the planner traces for saved residuals and recompute FLOPs (nothing is allocated). Packed rows with
    document ids, as training feeds them (the document mask costs memory in XLA's attention)."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: create_model(cfg, 0)), nnx.Param, ...)

    def loss(params, rest, tokens, segment_ids):
        return lm_loss(nnx.merge(graphdef, params, rest), tokens, segment_ids,
                       mtp_weight=float(cfg.model.mtp_loss_weight))[0]

    return loss, params, rest


@functools.lru_cache(maxsize=256)
def _saved(cfg_json: str, micro_batch: int, seq_len: int, expert: int) -> tuple[Residual, ...]:
    import ml_collections
    from jax._src.ad_checkpoint import saved_residuals  # public as jax.ad_checkpoint.print_saved_residuals

    loss, params, rest = abstract_loss(ml_collections.ConfigDict(json.loads(cfg_json)))
    tokens = jax.ShapeDtypeStruct((micro_batch * expert, seq_len + 1), jnp.int32)
    with jax.sharding.use_abstract_mesh(_mesh(expert)), te_gemm.stand_in():
        return _collect(saved_residuals(loss, params, rest, tokens, tokens), skip=_is_log_softmax)


@functools.lru_cache(maxsize=1024)  # per micro-batch, positions, expert axis and policy: a search traces hundreds
def _block(cfg_json: str, moe: bool, micro_batch: int, seq_len: int, expert: int, remat: str) -> tuple[Residual, ...]:
    """Residuals of one block under `remat`. The layer's weights are memory.layer_live's: parameters are
    traced in the compute dtype, so their casts are arguments, and the expert weights a shard_map passes
    through as its own residuals (same shape and dtype as a parameter) are left out."""
    import ml_collections
    from jax._src.ad_checkpoint import saved_residuals

    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    cfg.model.param_dtype = cfg.model.dtype
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Block(cfg, moe=moe, rngs=nnx.Rngs(0))), nnx.Param, ...)
    body = _remat(lambda block, x, positions, segment_ids: block(x, positions, segment_ids), remat)

    def run(params, rest, x, positions):  # positions double as document ids: same shape and dtype
        y, stats = body(nnx.merge(graphdef, params, rest), x, positions, positions)
        return y, (stats.aux_loss if stats is not None else jnp.float32(0))

    batch = micro_batch * expert
    x = jax.ShapeDtypeStruct((batch, seq_len, int(cfg.model.d_model)), jnp.dtype(cfg.model.dtype))
    positions = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    weights = {(tuple(p.shape), jnp.dtype(p.dtype)) for p in jax.tree.leaves(params)}
    with jax.sharding.use_abstract_mesh(_mesh(expert)), te_gemm.stand_in():
        return _collect(saved_residuals(run, params, rest, x, positions),
                        skip=lambda aval, source: (tuple(aval.shape), jnp.dtype(aval.dtype)) in weights)


def _bytes(residuals, d_model: int, expert: int, tensor: int, weights=None, *, scores: tuple[int, int] = (0, 1)) -> int:
    """Per-device bytes of residuals traced on an abstract mesh of `expert` devices (module docstring). scores:
    (positions traced, context) of XLA's reference attention: with context > 1 it scores each local query against
    the whole sequence, so its [..., heads, positions, positions] scores and mask count context times."""
    total = weight_bytes = 0
    gathered = {"data": 1, "fsdp": 1, "expert": expert, "tensor": tensor}
    local, context = scores
    for shape, itemsize in residuals:
        if weights and (leaf := weights.get(shape)) is not None:
            weight_bytes += int(np.prod(leaf.local_shape(gathered))) * itemsize
            continue
        n = int(np.prod(shape)) * itemsize
        if context > 1 and len(shape) >= 4 and shape[-2:] == (local, local) and shape[-1] != d_model:
            n *= context
        total += n if (shape and shape[-1] == d_model) else -(-n // tensor)
    return -(-total // expert) + weight_bytes


@functools.lru_cache(maxsize=256)
def _block_config_key(cfg_json: str) -> str:
    """The traced config's key for one block's trace: the block runs under the policy _block is given, so the
    config's own model.remat is left out (one trace per block policy, not one per layout policy as well)."""
    c = json.loads(cfg_json)
    c["model"]["remat"] = "none"
    return json.dumps(c, sort_keys=True)


def _in_micro_batch(bytes_at, micro_batch: int, *, proportional: bool = False) -> int:
    """bytes_at(micro_batch) from the traces at 1 (and 2) sequences, where each further micro-batch would cost a
    trace of its own (the search's time is its traces). proportional: a GPU block's residuals are all per token or
    per sequence (activations, ragged dispatch buffers, attention scores: 2 sequences hold 2 x 1's bytes within 1e-4
    on DeepSeek-V3 671B's blocks, every policy, 2026-12-07). Otherwise (the whole model, the CPU tile loop's per-expert
    padding) there are per-step terms: extended along the line through 1 and 2 sequences."""
    if micro_batch <= (1 if proportional else 2):
        return bytes_at(micro_batch)
    if proportional:
        return micro_batch * bytes_at(1)
    one, two = bytes_at(1), bytes_at(2)
    return one + (micro_batch - 1) * (two - one)


def activation_terms(cfg, micro_batch: int, seq_len: int, remat: str, *, tensor: int = 1, expert: int = 1,
                     dispatch: str | None = None, platform: str = "gpu", context: int = 1,
                     cfg_json: str | None = None) -> ActivationBytes:
    """Bytes per device: saved residuals, one block's transient, and the loss's logits (module docstring).
    context > 1: each device holds seq_len / context positions of its micro_batch sequences; everything is traced
    at those positions, and the whole sequence's K/V side that attention holds is added (planner/context.py).
    cfg_json: the config's to_json_best_effort(sort_keys=True), where the caller has it."""
    # Once per config and arguments: a search asks for the same terms for every layout that differs only in the
    # data, fsdp or stage sizes.
    return _activation_terms(cfg_json or cfg.to_json_best_effort(sort_keys=True), micro_batch, seq_len, remat, tensor, expert,
                             dispatch, platform, context)


@functools.lru_cache(maxsize=1024)
def _activation_terms(cfg_json: str, micro_batch: int, seq_len: int, remat: str, tensor: int, expert: int,
                      dispatch: str | None, platform: str, context: int) -> ActivationBytes:
    import ml_collections

    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    c = trace_config(cfg, remat=remat, dispatch=dispatch, platform=platform)
    m = c.model
    key = c.to_json_best_effort(sort_keys=True)
    d_model = int(m.d_model)
    whole_seq, seq_len = seq_len, seq_len // context  # a device's positions: every per-token residual's length
    scores = (seq_len, context) if c.kernels.attention == "xla" else (0, 1)  # a flash kernel keeps no scores
    plan = layer_plan(m)
    n_moe_blocks = plan.n_moe
    n_moe_blocks += int(m.get("mtp_depth", 0)) if n_moe_blocks else 0  # an MTP module's block is a MoE block
    ep = expert if n_moe_blocks else 1  # no MoE layer: expert only splits the batch
    weights = {leaf.shape: leaf for leaf in state_leaves(c)[0]}
    # The whole model is traced once per micro-batch and policy (ep 1); what expert parallelism changes is
    # inside the MoE blocks, whose residuals the scan saves per layer: add each block's change at ep (equal
    # to tracing the whole model on the ep mesh, tests/test_planner_memory.py; a fraction of the time).
    saved = _in_micro_batch(lambda mb: _bytes(_saved(key, mb, seq_len, 1), d_model, 1, tensor, weights,
                                              scores=scores), micro_batch)

    block_key = _block_config_key(key)

    def block_bytes(moe, e, policy):
        return _in_micro_batch(lambda mb: _bytes(_block(block_key, moe, mb, seq_len, e, policy), d_model, e, tensor,
                                                 scores=scores), micro_batch, proportional=platform == "gpu")

    moe_layer = block_bytes(True, ep, remat) if n_moe_blocks else 0
    if ep > 1:
        saved += n_moe_blocks * (moe_layer - block_bytes(True, 1, remat))
    # Context parallelism: every attention layer's whole-sequence K/V side (planner/context.py), per layer in the
    # scan's stacked residuals (and in a MoE block's, which pipeline stages place per tick).
    cp = context_activations(c, micro_batch, whole_seq, remat, context=context, tensor=tensor)
    saved += attention_layers(m) * cp.saved_per_layer
    moe_layer += cp.saved_per_layer if n_moe_blocks else 0
    layer = 0
    kinds = [False] * (plan.n_dense > 0) + [True] * (plan.n_moe > 0)
    if remat != "none":
        for moe in kinds:
            e = ep if moe else 1  # a dense block's per-device residuals do not depend on the expert axis
            without = block_bytes(moe, e, "none")
            kept = block_bytes(moe, e, remat) if remat != "full" else 0
            layer = max(layer, without - kept)
    heads = 1 + int(m.get("mtp_depth", 0))
    vocab = -(-int(m.vocab_size) // tensor)
    act = jnp.dtype(m.dtype).itemsize
    if c.kernels.loss == "dense":
        per_head = micro_batch * seq_len * vocab
        logits = per_head * (heads * (4 + 4) + 4 + act)
    else:  # chunked (kernels/cross_entropy.py): one chunk at a time. Its backward holds the recomputed f32 logits
        # and the logits' gradient in the compute dtype; XLA:CPU also keeps the f32 softmax and the f32 gradient
        # before its cast (measured on compiled steps), XLA:GPU fuses those into the gradient.
        per_element = 4 + act + (0 if platform == "gpu" else 4 + 4)
        logits = micro_batch * min(int(c.kernels.loss_chunk), seq_len) * vocab * per_element
    return ActivationBytes(saved, layer, logits, moe_layer, cp.transient)
