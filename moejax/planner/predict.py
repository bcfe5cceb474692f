"""Step time, throughput and TFLOP/s of a layout on a topology, and the ranked search over layouts.

Time model (every assumption is listed by `assumptions()` and printed with the results):
  compute   model FLOPs (Megatron-Core convention, plan's tokens) x recompute factor / (peak x efficiency), the
            peak being the FP8 format's GEMM rate (fp8_gemm_peak) for the share of FLOPs model.fp8 runs in FP8
            (accounting.fp8_macs_fraction) and the bf16 one for the rest; the recompute factor of each remat policy is traced from the step
            (planner/recompute.py)
  exposed   tensor all-reduces and pipeline hand-offs sit on the critical path (the next matmul needs them);
            fsdp gathers and gradient sums overlap with compute and only their excess shows; the expert
            exchange in C slices (moe.exchange_chunks) is exposed as exposed_exchange_s says

  context   (layout.context > 1) attention's all-gathers over `context` and their reduce-scatters are exposed
            (is_context_gather); MLA's K/V expansion of the other shards' positions adds to compute
            (planner/context.py); model FLOPs / n stay each device's share (load-balanced causal pieces)
  links     wire bytes of hierarchical collectives (comm.wire_bytes) over per-GPU NVLink / NIC bandwidth
  stages    (layout.stage > 1, parallel/pipeline.py as moejax runs it) the MoE layers' FLOPs are split over the
            stages and stretched by the bubble, 1 + (S - 1) / (M V) (a stage computes on its idle ticks too);
            the MTP passes split over the stages by micro-batch (ceil(M / S) S / M of their FLOPs), the embedding,
            dense layers,
            heads and loss are split over the stages with the batch; the hand-off between stages is waited on
            (critical), like the expert all-to-all
"""

from __future__ import annotations

from dataclasses import dataclass

from moejax.config import REMAT_POLICIES, ConfigError, validate
from moejax.config.layers import layer_plan
from moejax.kernels.resolve import GPU_EXCHANGE_CHUNKS, resolve_exchange_chunks
from moejax.model.accounting import (expert_ffn_macs_fractions, flops_per_token, fp8_macs_fraction,
                                     mtp_blocks_macs_fraction, pipelined_macs_fraction)
from moejax.parallel.one_f_one_b_tables import executed_slots
from moejax.parallel.pipeline import bubble_fraction, chunk_slots, slot_is_layer
from moejax.parallel.topology import Topology
from moejax.parallel.xla_gpu_flags import LAUNCH_MEM_FRACTION
from moejax.planner.comm import buffer_bytes_by_link, step_traffic, wire_bytes
from moejax.planner.context import CONTEXT_MIN_LOCAL_POSITIONS, CONTEXT_MIN_SEQ_LEN, context_overhead_flops
from moejax.planner.layout import Layout
from moejax.planner.memory import MemoryEstimate, estimate_memory, state_memory, within_scheduler_budget
from moejax.planner.recompute import recompute_factor

# blockwise FP8 GEMMs as qwix runs them (one GEMM of depth 128 per contraction tile, every tile's f32 partial written
# and summed) against the bf16 GEMM: measured on an H200 on 2026-12-04 (benchmarks/fp8_gemm.py, one 8192 x 7168 x
# 2048 GEMM fwd+bwd, 120 vs 345 TFLOP/s; benchmarks/RESULTS.md). Memory-bound, so applied to every GPU as a ratio.
BLOCKWISE_VS_BF16_MEASURED = 0.35


def fp8_gemm_peak(fmt: str, topo: Topology) -> float:
    """The dense rate the planner gives a model.fp8 format's GEMMs: the fp8 peak where each GEMM is one FP8 GEMM
    (rowwise: 2.17x the bf16 GEMM measured on an H200, the peaks say 2x; mxfp8: cuDNN's block-scaled GEMM, not
    measured), the measured fraction of the bf16 peak for blockwise."""
    return BLOCKWISE_VS_BF16_MEASURED * topo.peak_bf16 if fmt == "blockwise" else topo.peak_fp8

CRITICAL = ("expert", "tensor", "stage")  # collectives over these axes are waited on, not overlapped


def exposed_exchange_s(exchange_s: float, routed_s: float, shared_s: float, chunks: int) -> float:
    """The expert exchange's exposed time when each MoE layer runs it in `chunks` slices (moe.exchange_chunks):
    per layer and pass, slice c's exchange can run under slice c - 1's expert GEMMs, so of the exchange's
    exchange_s only the first slice's dispatch and the last slice's return (exchange_s / C) wait on nothing but
    the shared experts (shared_s, independent of the exchange), and the middle (exchange_s (C - 1) / C) shows
    where it exceeds the routed GEMMs' routed_s. One slice: the shared experts alone hide it. Every term sums
    over the step's MoE layer executions (forward, recompute, backward), which all share the same ratios."""
    edge, middle = exchange_s / chunks, exchange_s * (chunks - 1) / chunks
    return max(0.0, edge - shared_s) + max(0.0, middle - routed_s)


def is_expert_exchange(traffic) -> bool:
    """The all-to-all of the expert dispatch and combine (capacity, dropless)."""
    return traffic.kind == "all-to-all" and tuple(traffic.axes) == ("expert",)


def is_context_gather(traffic) -> bool:
    """Attention's all-gather over `context` and its transpose (planner/context.py): the next matmul (the K/V
    expansion, the attention kernel; in the backward the latent's weight gradient) waits on it. Nothing in moejax
    schedules it under other work, and no compiled step has measured it: it counts as exposed, like the tensor
    all-reduces. (A parameter's gradient sum over `context` is an all-reduce: it overlaps like the other sums.)"""
    return traffic.kind in ("all-gather", "reduce-scatter") and tuple(traffic.axes) == ("context",)


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    memory: MemoryEstimate
    fits: bool
    buffer_bytes: dict  # per link class, per step (hlo_collectives' convention)
    wire_bytes: dict  # per link class, per step
    recompute: float  # hardware FLOPs / model FLOPs of the layout's remat policy (traced)
    bubble: float  # pipeline stages: idle ticks over useful ones, (S - 1) / (M V); 0 without stages
    stage_compute: float  # pipeline stages: device FLOPs over an even split's (bubble and redundant parts); 1 without
    compute_s: float
    exchange_chunks: int  # moe.exchange_chunks as a GPU run resolves it for this layout
    exchange_s: float  # the expert exchange's time on the links, every MoE layer execution of the step
    exposed_exchange_s: float  # the part of it no compute covers (exposed_exchange_s()); in exposed_comm_s
    exposed_comm_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    context_gather_s: float = 0.0  # context > 1: attention's all-gathers over `context` on the links (exposed)
    context_overhead_s: float = 0.0  # context > 1: of compute_s, MLA's K/V expansion of other shards' positions

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "name": self.layout.name(), "memory": self.memory.to_dict(),
                "fits": self.fits, "buffer_bytes": self.buffer_bytes, "wire_bytes": self.wire_bytes,
                "recompute": self.recompute, "bubble": self.bubble, "stage_compute": self.stage_compute,
                "compute_s": self.compute_s, "exchange_chunks": self.exchange_chunks, "exchange_s": self.exchange_s,
                "exposed_exchange_s": self.exposed_exchange_s, "exposed_comm_s": self.exposed_comm_s,
                "step_s": self.step_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "tflops_per_gpu": self.tflops_per_gpu,
                "mfu": self.mfu, "context_gather_s": self.context_gather_s,
                "context_overhead_s": self.context_overhead_s}


def domain_size_for(topo: Topology, n_gpus: int, override: int = 0) -> int:
    """Devices per NVLink domain the job uses: the override, the whole domain when the job fills whole
    domains, else the largest multiple of a process's devices that divides the job (NVL72 at 256 GPUs: 64
    of each rack's 72, as launch/ does)."""
    if override:
        return override
    size = topo.domain_size or n_gpus
    if n_gpus % size == 0:
        return size
    step = max(1, topo.devices_per_process)
    return max((d for d in range(step, size + 1, step) if n_gpus % d == 0), default=1)


def predict(cfg, topo: Topology, layout: Layout, *, efficiency: float, domain_size: int,
            mem_fraction: float = LAUNCH_MEM_FRACTION) -> Prediction:
    """mem_fraction: the share of each GPU's memory XLA's allocator is given (XLA_PYTHON_CLIENT_MEM_FRACTION): a
    layout fits where its memory is within it, and it is the base of XLA:GPU's scheduler budget: communication is
    overlapped with compute only where the layout's temporaries fit that budget (memory.within_scheduler_budget),
    else every collective is exposed."""
    t = cfg.train
    seq = int(t.seq_len)
    n = layout.n_devices
    cfg_json = cfg.to_json_best_effort(sort_keys=True)  # the key of every per-config cache below
    memory, overlap_scheduled, allocator = estimate_memory(cfg, layout, seq, cfg_json=cfg_json), True, topo.hbm_bytes
    if topo.name != "cpu":  # XLA:CPU has no allocator share nor scheduler budget (its collectives are synchronous)
        allocator *= mem_fraction
        memory, overlap_scheduled = within_scheduler_budget(memory, allocator)
    traffic = step_traffic(cfg, layout, seq)
    wire = {"nvlink": 0.0, "nic": 0.0}
    critical_s = overlap_s = exchange_s = context_gather_s = handoff_s = 0.0
    for tr in traffic:
        w = wire_bytes(tr, layout.sizes, domain_size)
        for link in wire:
            wire[link] += w[link]
        seconds = sum(w[link] / topo.link_bw(link) for link in w)
        if is_expert_exchange(tr):
            exchange_s += seconds
        elif is_context_gather(tr):
            context_gather_s += seconds
        elif layout.one_f_one_b and tr.kind == "collective-permute" and tuple(tr.axes) == ("stage",):
            handoff_s += seconds
        elif set(tr.axes) <= set(CRITICAL):
            critical_s += seconds
        else:
            overlap_s += seconds
    tokens_per_step = t.global_batch * seq
    model_flops = flops_per_token(cfg, seq) * tokens_per_step / n
    recompute = recompute_factor(cfg, layout.remat, dispatch=layout.dispatch, seq_len=seq, cfg_json=cfg_json)
    fp8_share = fp8_macs_fraction(cfg, seq)
    fp8_peak = fp8_gemm_peak(cfg.model.get("fp8", "none"), topo)
    bubble, stage_compute = stage_terms(cfg, layout, seq, recompute)
    compute_s = (model_flops * recompute * stage_compute
                 * ((1 - fp8_share) / topo.peak_bf16 + fp8_share / fp8_peak) / efficiency)
    # Context parallelism: MLA's K/V expansion of the other shards' positions (a projection: FP8 with model.fp8).
    context_overhead_s = (context_overhead_flops(cfg, layout, seq) / efficiency
                          / (fp8_peak if cfg.model.get("fp8", "none") != "none" else topo.peak_bf16))
    compute_s += context_overhead_s
    routed_share, shared_share = expert_ffn_macs_fractions(cfg, seq)
    chunks = planned_exchange_chunks(cfg, layout, topo)
    # The expert FFNs' share of compute_s (recompute and stage stretch apply to them like the rest).
    exposed_exchange = exposed_exchange_s(exchange_s, routed_share * compute_s, shared_share * compute_s, chunks)
    if not overlap_scheduled:
        # past the scheduler's budget XLA:GPU schedules for memory: every collective runs synchronously
        exposed_exchange, critical_s, overlap_s = exchange_s, critical_s + handoff_s + overlap_s, 0.0
    elif layout.one_f_one_b:
        exposed_exchange = exposed_1f1b_s(layout, layout.scheduled_micro(int(t.global_batch)),
                                          exposed_exchange + handoff_s, exchange_s + handoff_s,
                                          pipelined_macs_fraction(cfg, seq) * compute_s)
    exposed = critical_s + context_gather_s + exposed_exchange + max(0.0, overlap_s - compute_s)
    step_s = compute_s + exposed
    tokens_per_s = tokens_per_step / step_s / n
    return Prediction(layout, memory, memory.total <= allocator, buffer_bytes_by_link(traffic, layout.sizes, domain_size),
                      wire, recompute, bubble, stage_compute, compute_s, chunks, exchange_s, exposed_exchange, exposed,
                      step_s, tokens_per_s,
                      model_flops / step_s / 1e12, model_flops / step_s / topo.peak_bf16, context_gather_s,
                      context_overhead_s)


def planned_exchange_chunks(cfg, layout: Layout, topo: Topology) -> int:
    """moe.exchange_chunks as a run of this layout resolves it: the config's value, or auto for the topology's
    devices at the layout's expert parallelism and dispatch (called per searched layout: no config copy)."""
    return resolve_exchange_chunks(int(cfg.moe.get("exchange_chunks", 0)), "cpu" if topo.name == "cpu" else "gpu",
                                   layout.expert, layout.dispatch)


def stage_terms(cfg, layout: Layout, seq: int, recompute: float = 1.0) -> tuple[float, float]:
    """(bubble, device FLOPs over model FLOPs / n) of the layout's pipeline stages: the pipelined share stretched by
    the bubble and by an uneven split's identity slots (S V C / L), the MTP passes split over the stages by
    micro-batch (ceil(M / S) per stage), the rest (embedding, dense layers, heads, loss) split
    over the stages like the batch. 1F1B: the pipelined share is the slot executions the schedule runs
    (one_f_one_b_tables.executed_slots: it leaves identity last slots out where no stage needs them), a backward slot
    weighing 2 + 3 (recompute - 1) forward ones (recompute: the policy's hardware over model FLOPs)."""
    if layout.stage <= 1:
        return 0.0, 1.0
    n_micro = layout.per_pass(int(cfg.train.global_batch))
    scheduled = layout.scheduled_micro(int(cfg.train.global_batch))  # 1F1B: padded to groups of S
    bubble = bubble_fraction(layout.stage, scheduled, layout.virtual)
    piped, mtp = pipelined_macs_fraction(cfg, seq), mtp_blocks_macs_fraction(cfg, seq)
    n_moe = layer_plan(cfg.model).n_moe
    padded = chunk_slots(n_moe, layout.stage, layout.virtual) * layout.stage * layout.virtual / n_moe  # identity slots
    mtp_share = -(-n_micro // layout.stage) * layout.stage / n_micro  # padded rounds of MTP passes
    stretch = padded * scheduled / n_micro * (1 + bubble)
    if layout.one_f_one_b:
        per_chunk = chunk_slots(n_moe, layout.stage, layout.virtual)
        last = slot_is_layer(n_moe, layout.stage, layout.virtual)[..., -1]
        fwd, bwd = executed_slots(layout.stage, n_micro, layout.virtual, per_chunk, None if last.all() else last)
        backward = 2 + 3 * (recompute - 1)
        stretch = (fwd + backward * bwd) / ((1 + backward) * n_micro * n_moe / layout.stage)
    return bubble, piped * stretch + mtp * mtp_share + (1 - piped - mtp)


def exposed_1f1b_s(layout: Layout, n_micro: int, exposed_alone_s: float, hidden_s: float, cover_s: float) -> float:
    """1F1B's exposed share of the expert exchange and the hand-offs (hidden_s, the step's total on the links):
    in the steady state each tick runs one micro-batch's forward chunk and another's backward chunk, independent of
    each other, so either's exchange and hand-off can run under the other's compute (cover_s: the pipelined layers'
    compute of the step); the warm-up and cool-down (S / M of the forwards and of the backwards) run one kind only,
    exposed as without stages (exposed_alone_s, for the whole step, scaled to their share)."""
    steady = max(0.0, 1.0 - layout.stage / n_micro)
    return (1 - steady) * exposed_alone_s + max(0.0, steady * (hidden_s - cover_s))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_options(cfg, n_gpus: int, domain_size: int, max_virtual: int = 8) -> list[tuple[int, int]]:
    """(stages, virtual stages) to search: stages that split the job's NVLink domains (whole domains per stage, or
    equal pieces of each) with a MoE layer per stage at least, and for each, every virtual-stage count up to
    max_virtual (uneven splits pay for their identity slots: stage_terms) and one layer per chunk when the stages
    split the layers; (1, 1) always."""
    plan = layer_plan(cfg.model)
    if not plan.dense_first:  # dense layers among the MoE layers: no pipeline stages (config/layers.py)
        return [(1, 1)]
    n_pipelined = plan.n_moe
    domains = max(1, n_gpus // domain_size) if domain_size else 1
    out = [(1, 1)]
    for stages in _divisors(n_gpus)[1:]:
        if stages > n_pipelined or not (domains % stages == 0 or (stages % domains == 0
                                                                 and domain_size % (stages // domains) == 0)):
            continue
        virtual = [v for v in range(1, max_virtual + 1) if stages * v <= n_pipelined]
        if n_pipelined % stages == 0 and n_pipelined // stages > max_virtual:
            virtual.append(n_pipelined // stages)
        out += [(stages, v) for v in virtual]
    return out


def context_options(cfg, per_stage: int, group: int) -> list[int]:
    """Context sizes to search beside an expert x tensor group of `group` devices: 1, and the powers of two C that
    split the sequence into 2 C equal pieces (parallel/context.py) with C x group dividing the stage's devices (the
    caller keeps those whose C x group lies inside an NVLink domain). To keep the search small, C > 1 only
      - for sequences of CONTEXT_MIN_SEQ_LEN positions or more, and only while a device keeps at least
        CONTEXT_MIN_LOCAL_POSITIONS of them (shorter pieces: per-token activations like a pre-training step's,
        which fit without context parallelism, while the whole sequence's gathered K/V stays per device), or
      - where the global batch is smaller than the batch shards C = 1 leaves (no sequence for some devices): then
        every C that divides."""
    seq, batch = int(cfg.train.seq_len), int(cfg.train.global_batch)
    rows_run_out = batch < per_stage // group
    if seq < CONTEXT_MIN_SEQ_LEN and not rows_run_out:
        return [1]
    out, c = [1], 2
    while (seq % (2 * c) == 0 and per_stage % (c * group) == 0
           and (rows_run_out or seq // c >= CONTEXT_MIN_LOCAL_POSITIONS)):
        out.append(c)
        c *= 2
    return out


def enumerate_layouts(cfg, n_gpus: int, domain_size: int, *, remats=REMAT_POLICIES, dispatches=None,
                      max_tensor: int = 8, stages=None, hbm_bytes: int = 0) -> list[Layout]:
    """Every layout the config accepts on n_gpus with context x expert x tensor inside one domain (context sizes:
    context_options); `stages`: the (stages, virtual stages) pairs to try (default stage_options; ((1, 1),) leaves
    pipelines out). hbm_bytes: leave out the context > 1 layouts whose memory without activations (state_memory:
    the train state, gradients, the largest layer gathered) exceeds it: the state is replicated over `context`, so a
    larger C leaves fewer devices to shard it. At C = 1 every layout is kept, to rank the ones that do not fit."""
    dispatches = dispatches or (cfg.moe.dispatch,)
    out = []
    for n_stages, virtual in (stages or stage_options(cfg, n_gpus, domain_size)):
        per_stage = n_gpus // n_stages
        piece = domain_size // max(1, n_stages // max(1, n_gpus // domain_size)) if domain_size else per_stage
        groups = [(e, t, c) for e in _divisors(per_stage) for t in _divisors(max_tensor) if per_stage % (e * t) == 0
                  for c in context_options(cfg, per_stage, e * t)]
        for expert, tensor, context in groups:
            inner = context * expert * tensor  # laid out inside one domain (layout.inner_group)
            if domain_size % inner or piece % inner or cfg.model.n_heads % tensor:
                continue
            rest = per_stage // inner
            for fsdp in _divisors(rest):
                data = rest // fsdp
                trial = cfg.copy_and_resolve_references()
                with trial.unlocked():
                    trial.mesh.data, trial.mesh.fsdp, trial.mesh.expert, trial.mesh.tensor = data, fsdp, expert, tensor
                    trial.mesh.context = context
                    trial.mesh.stage, trial.mesh.virtual_stages = n_stages, virtual
                per_device = cfg.train.global_batch // (data * fsdp * expert)  # sequences; context splits positions
                for mb in (m for m in _divisors(per_device) if m & (m - 1) == 0 or m == per_device):
                    if context > 1 and mb > 1:
                        # mb sequences over C devices hold the positions per device of one sequence over C / mb
                        # devices, which leave more devices to shard the state: one sequence per micro-batch.
                        continue
                    if per_device // mb < n_stages:
                        continue  # fewer micro-batches than stages
                    with trial.unlocked():
                        trial.train.micro_batches = per_device // mb
                    try:
                        validate(trial, n_gpus)
                    except ConfigError:
                        continue
                    if context > 1 and hbm_bytes and state_memory(cfg, Layout(
                            data, fsdp, expert, tensor, "full", mb, cfg.moe.dispatch, n_stages, virtual, 0,
                            context)).total > hbm_bytes:
                        continue  # the state alone (and gradients) do not fit: more context leaves fewer shards
                    # Pipelines: all micro-batches in one pass, or passes of S, 2S, 4S (mesh.pipeline_in_flight)
                    n_micro = per_device // mb
                    in_flights = [0] + [k for k in (n_stages, 2 * n_stages, 4 * n_stages)
                                        if n_stages > 1 and k < n_micro and n_micro % k == 0
                                        and cfg.train.global_batch % (
                                            n_stages * data * fsdp * expert * (n_micro // k)) == 0]
                    for remat in remats:
                        for dispatch in dispatches:
                            if n_stages > 1 and dispatch == "dropless":
                                # Dropless runs inside the stages, but pipelined dropless layouts are left out of the
                                # search to keep it short (tens of thousands more layouts at 256 GPUs); rank one with
                                # --layout ...,dispatch=dropless.
                                continue
                            out += [Layout(data, fsdp, expert, tensor, remat, mb, dispatch, n_stages, virtual, k,
                                           context) for k in in_flights]
                            if n_stages > 1:  # 1F1B: the activations are bounded by the schedule, one pass
                                out.append(Layout(data, fsdp, expert, tensor, remat, mb, dispatch, n_stages, virtual,
                                                  0, context, "1f1b"))
    return out


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """Layouts that fit first, fastest first."""
    return sorted(predictions, key=lambda p: (not p.fits, p.step_s))


def _recompute_text(cfg, remats, dispatches) -> str:
    if cfg is None:
        return "the remat policy's recompute factor"
    parts = []
    for dispatch in dispatches or (cfg.moe.dispatch,):
        factors = ", ".join(f"{r} {recompute_factor(cfg, r, dispatch=dispatch):.3f}" for r in remats)
        parts.append(f"{factors}" + (f" ({dispatch})" if len(dispatches or ()) > 1 else ""))
    return ("the recompute factor traced from the step's matmuls (hardware / model FLOPs: " + "; ".join(parts)
            + ")")


def _fp8_text(cfg, topo: Topology, efficiency: float) -> str:
    share = fp8_macs_fraction(cfg, int(cfg.train.seq_len))
    return (f"fp8 ({cfg.model.fp8}): {share:.1%} of the model FLOPs (projections, dense/shared/routed FFNs, MTP "
            f"projection) at {efficiency:.0%} of {fp8_gemm_peak(cfg.model.fp8, topo) / 1e12:.0f} TFLOP/s ("
            + (f"{BLOCKWISE_VS_BF16_MEASURED:.2f} x the bf16 peak: qwix's per-tile blockwise GEMMs, measured on an "
               "H200" if cfg.model.fp8 == "blockwise" else "the fp8 dense peak") + "), the rest "
            "(attention core, LM heads) at the bf16 peak; memory and dispatch bytes unchanged (moejax saves the "
            "bf16 inputs for the backward and re-quantises them, and dispatches bf16 rows)")


def assumptions(topo: Topology, efficiency: float, domain_size: int, cfg=None, *, remats=REMAT_POLICIES,
                dispatches=None, mem_fraction: float = LAUNCH_MEM_FRACTION) -> list[str]:
    return [
        f"hardware: {topo.name} ({topo.notes}); bf16 dense peak {topo.peak_bf16 / 1e12:.0f} TFLOP/s, "
        f"HBM {topo.hbm_bytes / 1e9:.0f} GB, NVLink {topo.nvlink_bw / 1e9:.0f} GB/s and NIC {topo.nic_bw / 1e9:.0f} GB/s "
        "per GPU each way (nominal)",
        f"NVLink domain used: {domain_size} GPUs (context x expert x tensor inside one domain, fsdp then data "
        "across)",
        f"compute: model FLOPs (Megatron-Core convention) at {efficiency:.0%} of the bf16 dense peak, times "
        + _recompute_text(cfg, remats, dispatches),
        *([_fp8_text(cfg, topo, efficiency)] if cfg is not None and cfg.model.get("fp8", "none") != "none" else []),
        *([f"XLA's allocator holds {mem_fraction:.2f} of each GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION, "
           f"--mem_fraction): a layout fits within {mem_fraction * topo.hbm_bytes / 1e9:.1f} GB; XLA:GPU's "
           "latency-hiding scheduler overlaps communication with compute only where the temporaries (memory beyond "
           "the state) fit its budget, (allocator - state) x 95%; past it every collective is exposed"]
          if topo.name != "cpu" else []),
        "communication: NCCL-style hierarchical collectives (ring inside the domain, then 1/n_in of the data per "
        "GPU over its own NIC); tensor all-reduces and pipeline hand-offs are not overlapped with compute, fsdp "
        "gathers and gradient sums are overlapped and only their excess over compute shows",
        "expert exchange in C slices per MoE layer (moe.exchange_chunks; auto on GPUs: "
        f"{GPU_EXCHANGE_CHUNKS} for dropless with expert parallelism, else 1): a slice's exchange runs under the previous slice's routed-expert GEMMs, the "
        "first dispatch and the last return (1/C of the bytes) only under the shared experts; exposed = "
        "max(0, X/C - shared) + max(0, X (C-1)/C - routed), X the exchange time, routed/shared the expert FFNs' "
        "share of compute (as XLA:GPU schedules it with moejax's flags; docs/parallelism.md)",
        "dispatch bytes: capacity = E x C x D per exchange; dropless = the device's T x K routed rows (GPU ragged "
        "path; buffers of the receive window, moe.dropless_window x T x K rows); 4 exchanges per MoE layer per "
        "pass, 6 with recompute",
        "memory: the train state at its sharded size (params and AdamW moments in model.param_dtype; with "
        "optim.master_weights the moments, f32 masters and gradients in f32; the moments and masters also split "
        "over data with optim.state_sharding=data) plus the larger of two phases: the backward (the "
        "residuals the remat policy saves for one micro-batch, the accumulated gradient when accumulating, and the "
        "larger of the loss's f32 logits per head and the layers' backward: the sharded gradient tree, the largest "
        "layer's gathered weights and unreduced gradients and one remat'd block's rematerialised internals "
        "(unfused [B, H, L, L] attention scores, MoE dispatch buffers at the layout's expert parallelism)) and the "
        "update (the gradient: the fused update writes in place); no allocator fragmentation or NCCL buffers",
        "micro-batch below the per-device batch means gradient accumulation: run it with "
        "train.micro_batches = per-device batch / micro-batch (each pass re-gathers fsdp weights)",
        "pipeline stages (stage > 1), circular schedule: MoE-layer compute x S V C / L (an uneven "
        "split's identity slots, C = ceil(L / (S V))) x (1 + bubble), bubble (S - 1) / (k V) for passes of k "
        "micro-batches (mesh.pipeline_in_flight; k = M by default), the gradient accumulated over M / k passes; "
        "embedding, dense "
        "layers, heads and loss split over the stages with the batch (the rows gathered over `stage` where the "
        "pipeline starts), MTP passes split over the stages by micro-batch; one micro-batch's "
        "activations per tick to the next stage and back (on the NICs when stages take whole NVLink domains), waited "
        "on; every tick's residuals kept until the backward of its pass (GPipe memory per pass). 1f1b schedule "
        "(sched=1f1b): the layer slots the schedule executes (identity last slots left out where no stage needs "
        "them), a backward slot weighing 2 + 3 (recompute - 1) forward ones; V S + 2 S - 2 chunk forwards' "
        "residuals per stage; heads per group of S micro-batches inside the schedule; in the steady state the "
        "expert exchange and the hand-offs under the other micro-batch's compute, the warm-up and cool-down's "
        "S / M exposed as without stages, and one more block's transient live (the forward's beside the "
        "backward's)",
        f"context parallelism (context C > 1; searched for sequences of {CONTEXT_MIN_SEQ_LEN} positions or more "
        f"down to {CONTEXT_MIN_LOCAL_POSITIONS} per device, or where the batch's rows run out; one sequence per "
        "micro-batch; layouts whose state and gradients alone exceed HBM left out): per-token work and activations "
        "at a device's L / C positions, attention FLOPs split evenly (load-balanced pieces); per attention layer "
        "the whole sequence's MLA latent + RoPE key (GQA: K/V heads) all-gathered over context in the forward (again "
        "under every remat but none) and reduce-scattered in the backward, exposed (nothing schedules them under "
        "compute; not measured); their whole-sequence keys and values saved per layer under none (dots: the "
        "expansion's outputs), else rematerialised, plus one layer's K/V gradients; MLA's K/V expansion of the "
        "other shards' (C - 1) / C x L positions as extra FLOPs (not model FLOPs); parameters replicated over "
        "context, their gradients summed over it with the batch axes; planner/context.py",
        "not modelled: zero-bubble schedules and DualPipe (moejax runs circular and 1f1b), "
        + ("FP8 GEMMs (model.fp8=none), " if cfg is None or cfg.model.get("fp8", "none") == "none" else
           "FP8 quantisation passes (amax, scale, cast: elementwise, memory-bound), ")
        + "overlap of one micro-batch's exchange with another's compute outside 1f1b's steady state, "
        "load imbalance across experts (dropless overflow rounds of steps whose load exceeds "
        "the window), stragglers",
    ]
