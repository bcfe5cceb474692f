"""Collectives of one training step per device, from the layout and the state's leaves, in the terms of
`parallel/hlo_collectives.py` (buffer bytes per device; reduce-scatter counted at its input), so the two
can be compared; and the wire bytes each puts on NVLink and on the NICs.

The rules, per step (n_micro passes of forward + backward; layers' collectives run once per layer):
  expert dispatch  capacity: all_to_all of [E*C, D] (compute dtype) for dispatch and combine, forward and
                   backward, again when the forward is recomputed (remat != none); allgather: the expert
                   group's tokens + routing gathered and outputs reduce-scattered, and their transposes;
                   dropless: each device's T*K routed rows each way (the GPU path, ragged_all_to_all)
  fsdp gathers     each fsdp-sharded weight is all-gathered once in the forward and, for weights inside the
                   layer scan, once more in the backward loop (param dtype; under bf16 compute, XLA may
                   gather after the cast: we assume the param dtype)
  gradient sums    a weight replicated over batch axes has its gradient summed over them. GSPMD sums an
                   fsdp-sharded weight's full gradient over fsdp and then its shard over the other replica
                   axes; expert weights (inside shard_map) are cast and gathered in the compute dtype, and their
                   gradient summed over data, then reduce-scattered over fsdp, in f32 (grad_reduce_dtype)
  tensor           a weight whose input dim is split over tensor (row-parallel) all-reduces its output in the
                   forward (and its recompute); one whose output dim is split (column-parallel) all-reduces
                   its input gradient in the backward. Rows: the device's tokens, or E*C for expert weights
  pipeline stages  (layout.stage > 1, parallel/pipeline.py) each of the M V + S - 1 ticks runs one chunk of
                   ceil(L / (S V)) MoE layers per stage and hands one micro-batch's activations to the next stage
                   (collective-permute over `stage`, forward and backward), the last stage's outputs reach every
                   stage once; the MoE stack's collectives above (gathers and
                   gradient sums included) run per tick for a chunk; the rest of the model runs in one pass on the
                   stage's 1/S of the local rows (MTP: each stage every S-th micro-batch's pass), its gradients
                   summed once per step (over `stage` too); the rows are all-gathered over `stage` into the pipeline
                   and the stages' output cotangents in the backward
  LM head          under the chunked loss its gradient is summed over the batch axes once per head (MTP heads
                   share it) and pass (1F1B: group), after the loss's backward scan (per-device partial sums inside)
  context          (layout.context > 1, parallel/context.py) every token count above is a device's seq_len / C
                   positions of its sequences; each attention layer all-gathers over `context` what its keys and
                   values are made from for the whole sequence (MLA: latent + shared RoPE key, GQA: K and V heads;
                   compute dtype) in the forward, again where remat recomputes it, and reduce-scatters the same
                   bytes in the backward (planner/context.py); parameters are replicated over `context`, so their
                   gradients are summed over it with the batch axes (the routed experts' with `data`)
Small collectives (losses, norms, router statistics: O(experts) floats) are left out.
Each collective carries the element type it moves at the model's dtypes (HLO names: bf16, f32, s32), which is
what a GPU moves; XLA:CPU widens bf16 collectives to f32 (see parallel/hlo_collectives.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp

from moejax.config.layers import layer_plan
from moejax.parallel.dispatch import capacity_per_expert
from moejax.parallel.mesh import BATCH_AXES
from moejax.parallel.pipeline import chunk_slots, schedule_ticks
from moejax.planner.context import attention_runs, gather_recomputed, gathered_values_per_token
from moejax.planner.layout import Layout, in_domain_factors, layout_config, loss_chunks
from moejax.planner.state_shapes import state_leaves
from moejax.program.state import optimizer_state_axes


@dataclass(frozen=True)
class Traffic:
    kind: str  # all-to-all | all-gather | reduce-scatter | all-reduce
    axes: tuple[str, ...]  # mesh axes of the group
    bytes: int  # buffer bytes per device per execution
    count: int  # executions per step
    what: str
    dtype: str = ""  # HLO element type moved (bf16, f32, s32; "" when mixed)

    @property
    def total(self) -> int:
        return self.bytes * self.count


_HLO_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float64": "f64", "int32": "s32",
              "int8": "s8", "uint8": "u8", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}


def hlo_type(dtype) -> str:
    """numpy/jax dtype -> the element type HLO prints (bfloat16 -> bf16)."""
    name = jnp.dtype(dtype).name
    return _HLO_TYPES.get(name, name)


def bytes_by_dtype(traffic: list[Traffic]) -> dict[str, dict[str, int]]:
    """{kind: {HLO element type: bytes per step}}, hlo_collectives.bytes_by_dtype's shape."""
    out: dict[str, dict[str, int]] = {}
    for t in traffic:
        kind = out.setdefault(t.kind, {})
        kind[t.dtype] = kind.get(t.dtype, 0) + t.total
    return out


def _group(axes, sizes) -> tuple[str, ...]:
    return tuple(a for a in axes if sizes[a] > 1)


def step_traffic(cfg, layout: Layout, seq_len: int | None = None) -> list[Traffic]:
    seq = int(cfg.train.seq_len if seq_len is None else seq_len)
    sizes = layout.sizes
    m, e = cfg.model, cfg.moe
    act = jnp.dtype(m.dtype).itemsize
    act_t, param_t = hlo_type(m.dtype), hlo_type(m.param_dtype)
    n_micro = layout.n_micro(int(cfg.train.global_batch))
    # Pipeline passes: k micro-batches each (mesh.pipeline_in_flight), the gradient accumulated over them.
    per_pass, n_passes = layout.per_pass(int(cfg.train.global_batch)), layout.passes(int(cfg.train.global_batch))
    local_seq = layout.local_positions(seq)  # positions of each sequence a device holds (context parallelism)
    tokens = layout.micro_batch * local_seq  # per device per pass
    recompute = layout.remat != "none"
    n_decoder_moe = layer_plan(m).n_moe
    n_moe = n_decoder_moe + int(m.get("mtp_depth", 0))
    piped = layout.stage > 1
    # 1F1B pads a pass to whole groups of S micro-batches; its forward and backward chunks run the same ticks'
    # worth of chunk executions as the circular schedule's (each tick one forward and one backward of a chunk).
    scheduled = layout.scheduled_micro(int(cfg.train.global_batch))
    ticks = n_passes * schedule_ticks(layout.stage, scheduled, layout.virtual) if piped else 0
    groups = n_passes * scheduled // layout.stage if layout.one_f_one_b else 0  # heads run per group of S
    per_chunk = chunk_slots(n_decoder_moe, layout.stage, layout.virtual) if piped else 0  # identity slots included
    # MoE layer executions per device per step: a stage runs one chunk per tick (idle ticks compute too).
    moe_runs = round(per_chunk * ticks + (n_moe - n_decoder_moe) * n_micro) if piped else n_moe * n_micro
    out: list[Traffic] = []
    # the loss scans a device's own positions (context parallelism folds them into rows of their own)
    n_loss_chunks = loss_chunks(cfg, local_seq)
    n_heads = 1 + int(m.get("mtp_depth", 0))

    if piped:
        # As XLA compiles parallel/pipeline.py (read on compiled CPU steps, 2026-12-04): per tick the roll to the next
        # stage is collective-permutes of one micro-batch slice, one forward and two backward (every other buffer of
        # the schedule stays on its stage); once per step the last stage's M outputs go to every stage (a permute and
        # an all-reduce) and their cotangents back (a permute), and the input micro-batches' cotangent (stage 0's) is
        # summed over the stages (an all-reduce).
        slice_bytes = tokens * int(m.d_model) * act
        if layout.one_f_one_b:
            # 1F1B (parallel/one_f_one_b.py): per tick one forward and one backward hand-off; per group the last
            # stage's finished micro-batches to the stages that run their heads and the heads' cotangents back
            # (S - 1 each); the rest as the circular schedule's.
            out.append(Traffic("collective-permute", ("stage",), slice_bytes, 2 * ticks, "pipeline hand-off", act_t))
            out.append(Traffic("collective-permute", ("stage",), slice_bytes, 2 * (layout.stage - 1) * groups,
                               "finished micro-batches to their heads and the cotangents back", act_t))
        else:
            out.append(Traffic("collective-permute", ("stage",), slice_bytes, 3 * ticks, "pipeline hand-off",
                               act_t))
            out.append(Traffic("collective-permute", ("stage",), slice_bytes * per_pass, 2 * n_passes,
                               "last stage's outputs out and their cotangents back", act_t))
        out.append(Traffic("all-reduce", ("stage",), slice_bytes * per_pass, (1 if layout.one_f_one_b else 2) * n_passes,
                           "stage 0's input cotangents to every stage" if layout.one_f_one_b else
                           "last stage's outputs to every stage, stage 0's input cotangents", act_t))
        # Outside the stages the rows are split over `stage` as well (parallel/mesh.batch_axes): they are gathered
        # where the pipeline starts, and the cotangents of the stages' outputs (the hidden state, each MTP module's)
        # where the backward enters it.
        out.append(Traffic("all-gather", ("stage",), slice_bytes * per_pass, n_passes,
                           "rows gathered over stage into the pipeline", act_t))
        # XLA splits the backward's gathers in two steps with more than two stages (1.5 x the bytes, measured at
        # S = 4 on compiled CPU steps).
        if not layout.one_f_one_b:  # 1F1B's heads run inside the schedule: their cotangents stay there
            out.append(Traffic("all-gather", ("stage",), slice_bytes * per_pass * (3 if layout.stage > 2 else 2) // 2,
                               (1 + int(m.get("mtp_depth", 0))) * n_passes,
                               "cotangents gathered over stage into the pipeline", act_t))

    if layout.context > 1:
        # The whole sequence's latent (MLA) or K/V heads (GQA) per attention layer: the all-gather's output (its
        # buffer bytes in hlo_collectives' convention) and its transpose, a reduce-scatter counted at its input.
        per_sequence = seq * gathered_values_per_token(m, layout.tensor) * act
        for r in attention_runs(cfg, layout, int(cfg.train.global_batch)):
            gathered = int(r.sequences * per_sequence)
            out.append(Traffic("all-gather", ("context",), gathered, (1 + gather_recomputed(layout.remat)) * r.runs,
                               f"context gather, {r.what}", act_t))
            out.append(Traffic("reduce-scatter", ("context",), gathered, r.runs,
                               f"context gather's transpose, {r.what}", act_t))

    # Expert dispatch.
    ep, k, n_exp, d = layout.expert, int(e.top_k), int(e.n_routed_experts), int(m.d_model)
    if ep > 1 and n_moe:
        passes = (4 + 2 * recompute) * moe_runs
        if layout.dispatch == "capacity":
            cap = capacity_per_expert(tokens, k, n_exp, float(e.capacity_factor))
            out.append(Traffic("all-to-all", ("expert",), n_exp * cap * d * act, passes, "expert dispatch/combine",
                               act_t))
        elif layout.dispatch == "dropless":
            out.append(Traffic("all-to-all", ("expert",), tokens * k * d * act, passes,
                               "expert dispatch/combine (ragged)", act_t))
        else:
            gathered = ep * tokens
            per = (2 + recompute) * moe_runs  # forward (+ recompute) and the transposes
            out.append(Traffic("all-gather", ("expert",), gathered * d * act, per, "expert group's tokens", act_t))
            out.append(Traffic("all-gather", ("expert",), gathered * 4 * k, per, "expert group's routing ids", "s32"))
            out.append(Traffic("all-gather", ("expert",), gathered * 4 * k, per, "expert group's routing weights",
                               "f32"))
            out.append(Traffic("reduce-scatter", ("expert",), gathered * d * act, per, "expert outputs", act_t))

    params, _, _ = state_leaves(layout_config(cfg, layout))
    tp = layout.tensor
    over = optimizer_state_axes(cfg)
    for leaf in params:
        f = sizes["fsdp"] if leaf.sharded_over("fsdp") else 1
        shard = leaf.local_bytes(sizes)
        # A pipelined leaf is gathered, and its gradient summed, a chunk (1 / V of the stage's layers) per tick; any
        # other leaf once per pass (with stages: one pass over the whole local batch).
        passes, piece = (ticks, layout.virtual) if leaf.pipelined else (n_passes if piped else n_micro, 1)
        if groups and not leaf.pipelined and "dense_layers" not in leaf.path:
            passes = groups  # 1F1B: the heads' leaves (norm, LM head, MTP, embedding) are used once per group
        grad_sums = passes
        if f > 1:
            gathers = (2 if leaf.stacked else 1) * passes
            if leaf.expert:  # cast, then gathered inside the dispatch shard_map: compute-dtype bytes
                out.append(Traffic("all-gather", ("fsdp",), shard * f * act // leaf.itemsize // piece, gathers,
                                   f"fsdp gather {leaf.path}", act_t))
            else:
                out.append(Traffic("all-gather", ("fsdp",), shard * f // piece, gathers, f"fsdp gather {leaf.path}",
                                   param_t))
        # Outside the stages (parallel/mesh.batch_axes) a leaf's rows are split over `stage` too, and its gradient
        # summed over it; the MTP modules' too (each stage runs every S-th micro-batch's pass).
        outside = piped and not leaf.pipelined
        replicas = _group([a for a in BATCH_AXES + ("context",) + (("stage",) if outside else ())
                           if not leaf.sharded_over(a)], sizes)
        if leaf.path == "['head_DxV']" and n_loss_chunks > 1:
            # The chunked loss keeps the head's gradient as per-device partial sums over its chunks and sums them
            # once per head call (kernels/cross_entropy.py row_parts): once per head (MTP heads share it).
            grad_sums *= n_heads
        if leaf.expert:
            # dispatch._weights_for_compute: the full (fsdp-gathered) gradient summed over data (and context), then
            # reduce-scattered over fsdp, in f32 (model.grad_reduce_dtype) or the compute dtype.
            grad_t = "f32" if m.get("grad_reduce_dtype", "float32") == "float32" else act_t
            full = shard * f * (4 if grad_t == "f32" else act) // leaf.itemsize // piece
            if replicas_of_experts := _group(("data", "context"), sizes):
                out.append(Traffic("all-reduce", replicas_of_experts, full, grad_sums, f"grad sum {leaf.path}",
                                   grad_t))
            if f > 1:
                out.append(Traffic("reduce-scatter", ("fsdp",), full, grad_sums, f"grad sum (fsdp) {leaf.path}",
                                   grad_t))
        else:
            if f > 1:
                out.append(Traffic("all-reduce", ("fsdp",), shard * f // piece, grad_sums,
                                   f"grad sum (fsdp) {leaf.path}", param_t))
            if replicas:
                out.append(Traffic("all-reduce", replicas, shard // piece, grad_sums, f"grad sum {leaf.path}", param_t))
        if over and leaf.split_further(sizes, over).sharded_over("data"):
            # A distributed optimizer (optim.state_sharding=data): each data rank updates its slice, and the new
            # parameters are all-gathered over data once per step (program/optim.adamw_update).
            out.append(Traffic("all-gather", ("data",), shard, 1, f"optimizer gather {leaf.path}", param_t))
        if tp > 1 and leaf.sharded_over("tensor"):
            rows = tokens // layout.stage if outside else tokens
            out += _tensor_traffic(leaf, rows, n_exp * capacity_per_expert(tokens, k, n_exp, float(e.capacity_factor)),
                                   act, layout, ticks if leaf.pipelined else n_micro, act_t,
                                   layers=leaf.local_layers(sizes) // piece)
    return out


def _tensor_traffic(leaf, tokens, expert_rows, act, layout, n_micro, act_t="", *, layers: int = 1) -> list[Traffic]:
    """`n_micro` passes over `layers` layers of the leaf (a pipelined chunk's per tick)."""
    lead = leaf.layer_dims + (1 if leaf.expert else 0)
    dims = list(range(lead, len(leaf.shape)))
    if not dims:
        return []
    rows = expert_rows if leaf.expert else tokens
    first = dims[0]
    if "tensor" in leaf.mesh_axes(first):  # row-parallel: the forward output (the last dim) is a partial sum
        width = leaf.shape[-1]
        again = layout.remat == "full" or (layout.remat == "dots" and leaf.expert)
        return [Traffic("all-reduce", ("tensor",), rows * width * act, (1 + again) * layers * n_micro,
                        f"tensor fwd {leaf.path}", act_t)]
    return [Traffic("all-reduce", ("tensor",), rows * leaf.shape[first] * act, layers * n_micro,
                    f"tensor bwd {leaf.path}", act_t)]


def link_split(traffic: Traffic, sizes: dict[str, int], domain_size: int) -> tuple[int, int]:
    """(devices of the group inside one domain, domains the group spans)."""
    inside = in_domain_factors(sizes, domain_size)
    n_in = math.prod(inside[a] for a in traffic.axes)
    n_all = math.prod(sizes.get(a, 1) for a in traffic.axes)
    return n_in, n_all // n_in


def wire_bytes(traffic: Traffic, sizes: dict[str, int], domain_size: int) -> dict[str, float]:
    """Bytes one device sends per step over each link class, for NCCL-style hierarchical algorithms:
    ring inside the domain, then across domains on 1/n_in of the data per device (one NIC per GPU)."""
    n_in, n_out = link_split(traffic, sizes, domain_size)
    s = traffic.bytes * traffic.count
    if traffic.kind == "collective-permute":  # a ring over the group: n_out of its n hops cross a domain boundary
        crossing = n_out / (n_in * n_out) if n_out > 1 else 0.0
        return {"nvlink": s * (1 - crossing), "nic": s * crossing}
    factor = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0}[traffic.kind]
    if traffic.kind == "all-to-all":
        n = n_in * n_out
        return {"nvlink": s * (n_in - 1) / n, "nic": s * (n - n_in) / n}
    return {"nvlink": factor * s * (n_in - 1) / n_in,
            "nic": factor * s / n_in * (n_out - 1) / n_out if n_out > 1 else 0.0}


def buffer_bytes_by_link(traffic: list[Traffic], sizes: dict[str, int], domain_size: int) -> dict[str, int]:
    """Buffer bytes per step, each collective filed under nvlink when its group stays inside one domain,
    else nic (the convention hlo_stats/hlo_collectives use for compiled programs)."""
    out = {"nvlink": 0, "nic": 0}
    for t in traffic:
        out["nvlink" if link_split(t, sizes, domain_size)[1] == 1 else "nic"] += t.total
    return out
