"""Per-device memory of one training step: state, gradients, optimizer transients, activations.

  params, opt_state   every leaf of the abstract train state at its sharded size (exact)
  grads               one gradient per parameter in its dtype, at its sharded size: the backward reduces each
                      layer's weight gradient to its shard inside the layer loop (the dispatch's expert weights by
                      an explicit psum_scatter, the rest by GSPMD: all-reduce + slice on XLA:CPU, reduce-scatter on
                      XLA:GPU), so the loop's gradient carry is sharded like the parameters (read in the compiled
                      HLO of CPU and H200 steps, benchmarks/RESULTS.md "Memory"); the one layer being reduced is
                      in layer_live
  grad_accumulator    gradient accumulation (micro-batches without pipeline stages): the running sum beside one
                      pass's gradient, both sharded
  activations         what the forward saves for the backward under the remat policy (planner/activations.py)
  layer_transient     what one remat'd block rematerialises for its backward (attention scores of the XLA
                      reference attention, MoE dispatch buffers at the layout's expert parallelism)
  logits              the loss over the vocabulary: every head's logits and f32 log-softmax, one f32 gradient
                      (the loss runs before the layers' backward: no layer gradient exists yet; the peak holds the
                      larger phase)
  layer_live          the layer being differentiated: its weights gathered over fsdp (compute dtype) and
                      their gradients before the fsdp reduction (param dtype)
  kernel_workspace    kernels.expert_gemm=te: the cuBLAS workspace Transformer Engine's grouped GEMM asks for (one
                      call's: XLA reuses it), beside the layer being differentiated
  overlap_live        1F1B (layout.one_f_one_b) with the exchange under compute: in the steady state a tick runs one
                      micro-batch's forward chunk beside another's backward chunk, so while the backward's block is
                      being differentiated the forward's block in flight holds its own transient (dispatch buffers,
                      expert activations: one more `layer_transient`). XLA:GPU's scheduler overlaps them only
                      within its memory budget (within_scheduler_budget); past it, it schedules for memory and
                      these buffers are not live at once (0)
  context_kv          context parallelism (layout.context > 1): the layer being differentiated's keys and values of
                      the whole sequence beyond the L / C positions its trace holds (rematerialised where the
                      policy did not save them) and their gradients (planner/context.py); activations are traced
                      at the L / C positions a device holds, plus each layer's saved whole-sequence K/V side

Pipeline stages (layout.stage > 1), as moejax/parallel/pipeline.py runs them: a stage holds its V C MoE layer slots
(params, optimizer state, gradients split over `stage`; an uneven split's identity slots are zeros of the same size)
and every leaf outside the MoE stack whole; the schedule's scan keeps each tick's residuals until the backward, i.e.
C = ceil(L / (S V)) layers' residuals for each of the
M V + S - 1 ticks (all M micro-batches in flight at the end of the forward: GPipe's memory); under 1F1B
(mesh.pipeline_schedule=1f1b) for K chunk forwards (V S + 2 S - 2 in the steady state), whatever M, plus the pass's input and its
cotangent, and one micro-batch's loss at a time; the
embedding, dense layers, MTP and loss run in one pass, on the stage's 1/S of the local rows (parallel/mesh.py's
batch_axes; MTP's residuals are counted there too, though it runs on every stage's rows). `stage_copies`: the
vmap over stages runs each stage's layer scan over [S, C, ...] weights, which XLA:CPU transposes to [C, S, ...]: a
copy of the stage's MoE stack, and one of its gradient, in the backward (measured on compiled CPU steps; the local
stage dim is 1, so the transpose moves no data, and XLA:GPU makes no such copies: 0 there, measured on deviceless
H200 compiles of PP2, PP2 x VP2 and PP4, benchmarks/RESULTS.md "Memory").
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace

import jax.numpy as jnp
import ml_collections

from moejax.config.layers import layer_plan
from moejax.kernels import te_gemm
from moejax.parallel.one_f_one_b_tables import residual_slot_table
from moejax.parallel.pipeline import chunk_slots, schedule_ticks
from moejax.parallel.xla_gpu_flags import XLA_DEFAULT_SLOP_PERCENT, scheduler_memory_limit
from moejax.planner.activations import activation_terms
from moejax.planner.layout import Layout, layout_config, loss_chunks
from moejax.planner.state_shapes import state_leaves
from moejax.program.optim import uses_master_weights
from moejax.program.state import optimizer_state_axes


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    opt_state: int
    grads: int
    grad_accumulator: int
    activations: int
    layer_transient: int
    logits: int
    layer_live: int
    stage_copies: int = 0  # pipeline stages: the stage's MoE stack and its gradient in the layout the stages' vmap wants
    context_kv: int = 0  # context > 1: the whole sequence's K/V (and gradients) of the layer being differentiated
    kernel_workspace: int = 0  # kernels.expert_gemm=te: the cuBLAS workspace of the grouped GEMM being run
    f32_weight_copies: int = 0  # optim.master_weights: f32 copies of the stacks scanned outside the 1F1B schedule
    overlap_live: int = 0  # 1F1B, overlapped: the forward chunk's block in flight beside the backward's

    @property
    def state(self) -> int:
        return self.params + self.opt_state

    @property
    def backward(self) -> int:
        """Beside the state during the backward: the saved activations (and the accumulated gradient), then the
        larger of two phases: the loss over the vocabulary, which runs before any layer's weight gradient exists,
        or the layers' backward, which holds the gradients, the layer being differentiated and its transient."""
        return (self.grad_accumulator + self.activations + self.stage_copies + self.f32_weight_copies
                + max(self.logits, self.grads + self.layer_live + self.layer_transient + self.overlap_live
                      + self.context_kv + self.kernel_workspace))

    @property
    def temporaries(self) -> int:
        """What XLA counts as the program's temporaries: everything beside the state it takes as arguments."""
        return self.total - self.state

    @property
    def optimizer(self) -> int:
        """Beside the state at the update: the gradient (activations are freed). The update is one fused
        elementwise pass that writes the moments and parameters in place (program/optim.adamw_update): no clipped
        copy of the gradient, no copy of the moments."""
        return self.grads

    @property
    def total(self) -> int:
        return self.state + max(self.backward, self.optimizer)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def within_scheduler_budget(memory: MemoryEstimate, base_bytes: int,
                            slop: int = XLA_DEFAULT_SLOP_PERCENT) -> tuple[MemoryEstimate, bool]:
    """(the memory as XLA:GPU schedules it, whether it schedules the overlap) when XLA's allocator limit is
    `base_bytes`: its scheduler plans for (base - arguments) x slop / 100 of temporaries
    (parallel/xla_gpu_flags.scheduler_memory_limit, the arguments being the state). Where the temporaries (with
    1F1B's overlap buffers) exceed that, it orders the program to lower its peak and leaves the collectives
    synchronous: the 256-GB300 compiles of the record's layout put compute under 4% of the exchange bytes past the
    budget and 68-100% within it; a 64-GB300 layout over it, under none (benchmarks/RESULTS.md). 1F1B's overlap
    buffers are then not live at once (overlap_live 0)."""
    if memory.temporaries <= scheduler_memory_limit(int(base_bytes), memory.state, slop):
        return memory, True
    return replace(memory, overlap_live=0), False


def _largest_layer_bytes(params, sizes, compute_itemsize) -> int:
    """One layer of the largest stack, gathered over fsdp: weights (compute dtype) + grads (`params`' dtype: the
    gradient's)."""
    stacks: dict[str, int] = {}
    for leaf in params:
        if not leaf.stacked:
            continue
        stack = leaf.path.split("[")[1] if "[" in leaf.path else leaf.path  # e.g. "['moe_layers']"
        per_layer = leaf.local_bytes(sizes, drop=("fsdp",)) // leaf.local_layers(sizes)
        stacks[stack] = stacks.get(stack, 0) + per_layer * (1 + compute_itemsize / leaf.itemsize)
    return int(max(stacks.values(), default=0))


def state_memory(cfg, layout: Layout, platform: str = "gpu", cfg_json: str | None = None) -> MemoryEstimate:
    """The layout's memory without activations (nothing traced: the state's leaves at their sharded size), each
    activation term 0: a lower bound of estimate_memory's total."""
    # Computed once per mesh shape and schedule (a search asks for it per layout: each walks every leaf): the remat
    # policy, dispatch and micro-batch change it only through whether the gradient is accumulated.
    accumulating = layout.passes(int(cfg.train.global_batch)) > 1
    return _state_memory(cfg_json or cfg.to_json_best_effort(sort_keys=True),
                         replace(layout, remat="full", dispatch="capacity", micro_batch=1, in_flight=0),
                         accumulating, platform)


@functools.lru_cache(maxsize=4096)
def _state_memory(cfg_json: str, layout: Layout, accumulating: bool, platform: str) -> MemoryEstimate:
    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    sizes = layout.sizes
    params, model_state, opt = state_leaves(layout_config(cfg, layout))
    over = optimizer_state_axes(cfg)
    # A distributed optimizer's moments are split over data too, and so is the gradient of a weight GSPMD
    # partitions: it reduces each layer's gradient over data inside the loop to the slice the moments need
    # (reduce-scatter on XLA:GPU). The routed experts' gradient is summed over data explicitly inside the dispatch
    # shard_map (parallel/dispatch._weights_bwd): XLA:GPU keeps it whole over data, XLA:CPU slices it after the sum
    # (compiled steps at data 2 and 8, benchmarks/RESULTS.md "Memory"; with accumulation XLA:GPU varies: ibid.).
    whole_over_data = platform != "cpu"
    # optim.master_weights: the gradient is f32 whatever the stored weights' dtype (program/step.py).
    f32_grads = uses_master_weights(cfg.optim)
    grad_leaves = [replace(leaf, itemsize=4) if f32_grads and leaf.itemsize < 4 else leaf for leaf in params]
    # 1F1B accumulates the stage's gradient in its loop carry, whole over data (summed once, after the schedule):
    # measured on the 256-GB300 compile of the record's layout (benchmarks/RESULTS.md).
    grads = sum((leaf if (leaf.expert and whole_over_data) or (layout.one_f_one_b and leaf.pipelined)
                 else leaf.split_further(sizes, over)).local_bytes(sizes) for leaf in grad_leaves)
    compute_itemsize = jnp.dtype(cfg.model.dtype).itemsize
    return MemoryEstimate(
        params=sum(leaf.local_bytes(sizes) for leaf in params) + sum(leaf.local_bytes(sizes) for leaf in model_state),
        opt_state=sum(leaf.split_further(sizes, over).local_bytes(sizes) for leaf in opt),
        grads=grads,
        grad_accumulator=(grads if accumulating else 0) + (
            # 1F1B: the heads' gradients (final norm, LM head, MTP, embedding) summed per stage beside the step's
            sum(leaf.local_bytes(sizes) for leaf in grad_leaves if not leaf.pipelined and "dense_layers" not in leaf.path)
            if layout.one_f_one_b else 0),
        activations=0,
        layer_transient=0,
        logits=0,
        layer_live=_largest_layer_bytes(grad_leaves, sizes, compute_itemsize),
        # Master weights: a stack scanned outside the 1F1B schedule is differentiated at f32 and XLA keeps f32 copies
        # of its weights (compiled: docs/memory.md "Master weights"); 1F1B's chunks take their vjps at f32 per tick.
        f32_weight_copies=sum(leaf.local_bytes(sizes) for leaf in grad_leaves
                              if f32_grads and leaf.stacked and not (layout.one_f_one_b and leaf.pipelined)),
        stage_copies=(2 * sum(leaf.local_bytes(sizes) for leaf in grad_leaves if leaf.pipelined) if platform == "cpu"
                      else 0),
    )


def loss_partials_bytes(cfg, layout: Layout, seq: int) -> int:
    """The chunked loss's per-device partial head gradients (kernels/cross_entropy.py row_parts): one [D, V / tensor]
    f32 beside the chunk's logits, where the rows are split over devices and the loss takes more than one chunk."""
    # the loss's rows: the batch axes', context folded into rows, and `stage` where the heads run outside the stages
    rows_split = layout.data * layout.fsdp * layout.expert * layout.context * (
        1 if layout.one_f_one_b else layout.stage) > 1
    if not (rows_split and loss_chunks(cfg, layout.local_positions(seq)) > 1):
        return 0
    return int(cfg.model.d_model) * -(-int(cfg.model.vocab_size) // layout.tensor) * 4


def estimate_memory(cfg, layout: Layout, seq_len: int | None = None, platform: str = "gpu",
                    cfg_json: str | None = None) -> MemoryEstimate:
    """Per-device memory of the layout; `platform` picks the routed-expert backend the trace follows (a dropless
    layer is a ragged grouped matmul on GPU, a padded einsum on CPU: what the dry run compiles)."""
    seq = int(cfg.train.seq_len if seq_len is None else seq_len)
    act = activation_terms(cfg, layout.micro_batch, seq, layout.remat, tensor=layout.tensor, expert=layout.expert,
                           dispatch=layout.dispatch, platform=platform, context=layout.context, cfg_json=cfg_json)
    saved, logits = act.saved, act.logits
    overlap_live = 0
    if layout.stage > 1:
        n_micro = layout.per_pass(int(cfg.train.global_batch))  # one pass's micro-batches are in flight
        n_pipelined = layer_plan(cfg.model).n_moe
        outside = max(0, act.saved - n_pipelined * act.moe_layer)  # embedding, dense layers, MTP, loss
        per_chunk = chunk_slots(n_pipelined, layout.stage, layout.virtual)  # an uneven split's identity slots too
        if layout.one_f_one_b:
            # 1F1B (parallel/one_f_one_b.py): a stage keeps K chunk forwards' residuals (residual_slot_table, the
            # most alive at once: V S + 2 S - 2 in the steady state); the
            # head runs on one micro-batch per stage at a time; the pass's input and its cotangent are kept whole
            # per stage ([M, rows, seq, d_model] each).
            # The dense layers before the stages keep only their inputs (model/pipelined_loss.py: `full` under any
            # policy but none) for the whole pass; the heads' (MTP block, loss) residuals are one micro-batch's at a
            # time, inside the schedule: counted with the loss's transient.
            n_pad = layout.scheduled_micro(int(cfg.train.global_batch))
            token_bytes = layout.micro_batch * layout.local_positions(seq) * int(cfg.model.d_model) * jnp.dtype(
                cfg.model.dtype).itemsize
            # A block's traced residuals (moe_layer) leave out its input, which the stack's scan saves (in `saved`):
            # here it goes with its chunk.
            outside_of = lambda a: max(0, a.saved - n_pipelined * (a.moe_layer + token_bytes))  # noqa: E731
            outside = outside_of(act if layout.remat == "none" else activation_terms(
                cfg, layout.micro_batch, seq, "full", tensor=layout.tensor, expert=layout.expert,
                dispatch=layout.dispatch, platform=platform, context=layout.context, cfg_json=cfg_json))
            chunk_bytes = (act.moe_layer + token_bytes) * per_chunk
            saved = (outside * n_micro // layout.stage + 2 * n_pad * token_bytes
                     + int(chunk_bytes * residual_slot_table(layout.stage, n_pad, layout.virtual)[1]))
            logits += act.moe_layer * int(cfg.model.get("mtp_depth", 0))
            # XLA:CPU runs each collective synchronously: no overlap to hold buffers for
            overlap_live = act.layer if platform != "cpu" else 0
        else:
            # The parts outside the stages hold 1/S of the rows each (parallel/mesh.batch_axes).
            saved = (outside * n_micro // layout.stage
                     + int(act.moe_layer * per_chunk * schedule_ticks(layout.stage, n_micro, layout.virtual)))
            logits = logits * n_micro // layout.stage
    logits += loss_partials_bytes(cfg, layout, seq)
    # TE built as `make install-te` builds it (the V2 grouped GEMM: one stream's workspace); the dry run reports which
    workspace = te_gemm.WORKSPACE_BYTES["v2"] if cfg.kernels.get("expert_gemm") == "te" else 0
    return replace(state_memory(cfg, layout, platform, cfg_json), activations=saved, layer_transient=act.layer, logits=logits,
                   context_kv=act.context_kv, kernel_workspace=workspace, overlap_live=overlap_live)
