"""What context parallelism (mesh.context = C > 1, parallel/context.py) costs a device beyond the per-token work of
its seq_len / C positions of each sequence.

Everything per token (embedding, norms, projections, the MoE dispatch, the loss) the planner traces at seq_len / C
positions (planner/activations.py), and the attention core's FLOPs are split evenly over the C devices (each holds a
front and a back piece of the sequence: causal load balance), so model FLOPs / n stays each device's share. What
attention does differently is modelled here, per attention layer (every decoder layer and every MTP module) and per
sequence of the micro-batch:

  gather        MLA all-gathers the compressed latent and the shared RoPE key (kv_lora_rank + qk_rope_head_dim
                values a position, 576 for DeepSeek-V3), GQA its K and V heads after RoPE (2 x kv heads x head_dim,
                the heads split over `tensor` when they divide), in the compute dtype, for the whole sequence: one
                all-gather in the forward, its transpose (a reduce-scatter of the same bytes) in the backward, and
                the forward's again wherever remat recomputes the attention (every policy but none: see `saved`)
  expansion     MLA: every device expands the whole sequence's latent into its heads' keys and values
                (k_nope = c W_kb, v = c W_vb), (C - 1) / C x L positions more than its own; fwd + bwd 3 GEMMs, a 4th
                where remat recomputes them (not dots, which saves their outputs). Overhead, not model FLOPs
  saved         what the whole sequence's K/V side leaves as residuals per position (read off saved_residuals of the
                block traced with context 2, tests/test_planner_context.py): remat none keeps the expansion's input
                (the gathered latent), k (no-RoPE part + the shared RoPE key broadcast to every head) and v for the
                attention kernel; dots keeps the expansion's matmul outputs k_nope and v (the gathered latent is not
                a matmul output: dots regathers it in the backward); attention, moe and full keep none of them (they
                save the attention output, the exchange and expert GEMMs, or the block input). GQA: none keeps the
                gathered K and V, dots only the local projections (regathered too)
  transient     the layer being differentiated rematerialises what its policy did not save, at the whole L, and its
                backward holds the gradients of the whole sequence's keys and values (dk, dv from the attention
                kernel and, MLA, the gathered latent's before its reduce-scatter). The planner's position-local
                trace (and the context-1 model) holds their L / C part of the residuals and none of the gradients:
                the term adds (1 - 1/C) x L of the rematerialised ones and the whole L of the gradients
Flash attention keeps no L x L scores on GPUs; XLA's reference attention (CPU) holds [B, H, L / C, L] scores, C x
those of a trace at L / C positions (planner/activations.py scales them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp

from moejax.config.layers import layer_plan
from moejax.parallel.pipeline import chunk_slots, schedule_ticks

# The layout search (predict.context_options) tries context > 1 from this sequence length on, down to this many
# positions per device (or wherever the batch's rows run out).
CONTEXT_MIN_SEQ_LEN = 16384
CONTEXT_MIN_LOCAL_POSITIONS = 8192


def attention_layers(m) -> int:
    """Attention sub-layers of one forward: every decoder layer and every MTP module's block."""
    return int(m.n_layers) + int(m.get("mtp_depth", 0))


def _local_heads(heads: int, tensor: int) -> int:
    return heads // tensor if heads % tensor == 0 else heads


def gathered_values_per_token(m, tensor: int) -> int:
    """Values per position the context all-gather moves (per device: heads split over `tensor`)."""
    if m.attention == "mla":
        return int(m.kv_lora_rank) + int(m.qk_rope_head_dim)
    return 2 * _local_heads(int(m.n_kv_heads or m.n_heads), tensor) * int(m.head_dim)


def saved_kv_values_per_token(m, tensor: int, remat: str) -> int:
    """Values per position of the whole sequence's K/V side one attention layer keeps for its backward under
    `remat` (module docstring: saved)."""
    if remat not in ("none", "dots"):
        return 0
    if m.attention == "mla":
        heads = _local_heads(int(m.n_heads), tensor)
        nope, rope, v = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim)
        if remat == "dots":
            return heads * (nope + v)  # the expansion's matmul outputs
        return int(m.kv_lora_rank) + heads * (nope + rope + v)  # the gathered latent, k and v
    return gathered_values_per_token(m, tensor) if remat == "none" else 0


def kv_gradient_values_per_token(m, tensor: int) -> int:
    """Values per position of one layer's whole-sequence key/value gradients in its backward."""
    if m.attention == "mla":
        heads = _local_heads(int(m.n_heads), tensor)
        return (heads * (int(m.qk_nope_head_dim) + int(m.qk_rope_head_dim) + int(m.v_head_dim))
                + gathered_values_per_token(m, tensor))
    return gathered_values_per_token(m, tensor)


def expansion_flops_per_token(m, tensor: int) -> int:
    """Forward FLOPs per position of expanding the latent into the device's heads' k_nope and v (MLA; 0 for GQA)."""
    if m.attention != "mla":
        return 0
    heads = _local_heads(int(m.n_heads), tensor)
    return 2 * int(m.kv_lora_rank) * heads * (int(m.qk_nope_head_dim) + int(m.v_head_dim))


@dataclass(frozen=True)
class ContextActivations:
    """Bytes per device a context split adds to the position-local trace (module docstring)."""

    saved_per_layer: int  # per attention layer, kept for the backward: (1 - 1/C) x L of the saved K/V side
    transient: int  # the layer being differentiated: rematerialised K/V (1 - 1/C) x L, gradients x L


def context_activations(cfg, micro_batch: int, seq_len: int, remat: str, *, context: int,
                        tensor: int = 1) -> ContextActivations:
    """seq_len: the whole sequence (the trace runs at seq_len / context)."""
    if context <= 1:
        return ContextActivations(0, 0)
    m = cfg.model
    act = jnp.dtype(m.dtype).itemsize
    others = micro_batch * (seq_len - seq_len // context)  # other shards' positions of the device's sequences
    saved = saved_kv_values_per_token(m, tensor, remat)
    rematerialised = saved_kv_values_per_token(m, tensor, "none") - saved if remat != "none" else 0
    grads = micro_batch * seq_len * kv_gradient_values_per_token(m, tensor)
    return ContextActivations(others * saved * act, (others * rematerialised + grads) * act)


@dataclass(frozen=True)
class AttentionRuns:
    """Attention layer executions of a step on one device: `runs` executions over `sequences` sequences each."""

    what: str
    sequences: float
    runs: int


def attention_runs(cfg, layout, global_batch: int) -> list[AttentionRuns]:
    """Every attention layer execution per device per step (one micro-batch's sequences each). With pipeline stages
    (as planner/comm.py counts the MoE layers): the MoE layers run a chunk per tick (idle ticks too), the dense layers
    once per pass on the stage's 1/S of the pass's rows, each MTP module on ceil(k / S) micro-batches per pass."""
    m = cfg.model
    plan = layer_plan(m)
    mtp = int(m.get("mtp_depth", 0))
    mb = layout.micro_batch
    n_micro = layout.n_micro(global_batch)
    if layout.stage <= 1:
        return [AttentionRuns("attention", mb, attention_layers(m) * n_micro)]
    per_pass, passes = layout.per_pass(global_batch), layout.passes(global_batch)
    ticks = passes * schedule_ticks(layout.stage, per_pass, layout.virtual)
    out = [AttentionRuns("attention (MoE layers, per tick)", mb,
                         round(chunk_slots(plan.n_moe, layout.stage, layout.virtual) * ticks))]
    if plan.n_dense:
        out.append(AttentionRuns("attention (dense layers)", mb * per_pass / layout.stage, plan.n_dense * passes))
    if mtp:
        out.append(AttentionRuns("attention (MTP)", mb, mtp * math.ceil(per_pass / layout.stage) * passes))
    return out


def gather_recomputed(remat: str) -> bool:
    """Whether the backward runs the forward's context all-gather again (what it gathers is not saved)."""
    return remat != "none"


def expansion_recomputed(m, remat: str) -> bool:
    """Whether the backward expands the latent again (dots saves the expansion's outputs, none everything)."""
    return m.attention == "mla" and remat not in ("none", "dots")


def context_overhead_flops(cfg, layout, seq_len: int) -> float:
    """FLOPs per device per step beyond model FLOPs / n: MLA's expansion of the other shards' positions, forward,
    backward (2 GEMMs) and the recompute where the policy does not keep its outputs."""
    c = layout.context
    if c <= 1:
        return 0.0
    m = cfg.model
    per_token = expansion_flops_per_token(m, layout.tensor) * (3 + expansion_recomputed(m, layout.remat))
    others = seq_len - seq_len // c
    return sum(r.sequences * r.runs for r in attention_runs(cfg, layout, int(cfg.train.global_batch))) * others * per_token
