"""Decoder stack: embedding, dense and MoE blocks (two stacks, each a scan over layers with remat), final
norm and LM head, then the Multi-Token Prediction modules on the last hidden state. The dense blocks are the first
model.first_k_dense layers plus model.interleaved_dense_layers (config/layers.py); the layers run in their order, as
contiguous runs of one stack's layers (the default, dense layers first: the two stacks whole, one after the other).

With pipeline stages (mesh.stage > 1) the MoE blocks run as a circular pipeline over the `stage` mesh axis
(moejax/parallel/pipeline.py) on train.micro_batches micro-batches: the embedding and dense blocks before it, the
final norm, MTP modules and head after it, each MTP pass and every MoE statistic per micro-batch (as gradient
accumulation computes them). The embedding, dense blocks, final norm, head and loss run data-parallel over the stages
(their rows split over `stage` too: parallel/mesh.batch_axes), so no stage repeats them; the rows are gathered over
`stage` where the pipeline starts. The MTP modules run once per micro-batch (their statistics are per pass), stage s
taking micro-batches s, s + S, ...: no stage repeats another's MTP pass."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config.layers import check_pipeline_layers, layer_plan, pipeline_in_flight
from moejax.kernels import fp8
from moejax.kernels.resolve import exchange_chunks, model_kernels
from moejax.model.attention import make_attention
from moejax.model.layers import LAYERS_AXIS_METADATA, MLP, Embed, RMSNorm, dtype_of, grads_in_f32, param, project
from moejax.model import cached_attention
from moejax.model.moe import MoE, MoEStats, combine_micro_stats, exact_dispatch
from moejax.model.rope import segment_positions
from moejax.parallel.context import context_queries, context_size, gather_sequence, to_context_order
from moejax.parallel.mesh import constrain, current_mesh, inside_stage
from moejax.parallel.pipeline import circular_pipeline, merge_micro_batches, micro_batches, slot_is_layer
from moejax.model.layer_stack import (STAGE_LAYERS_AXIS_METADATA, _as_chunks, _decode_stack, _layer_range, _remat,
                                      _run_stack, _tick_policy, _to_slots, moe_stack_layout)

ACT_BxLxD = ("batch", "seq", "act_embed")

class ModelOutput(NamedTuple):
    logits_BxLxV: jax.Array
    # MTP depth k predicts token i + 1 + k at position i; [depth, B, L, V] (the last k positions are padding).
    mtp_logits_DxBxLxV: jax.Array | None
    # MoE statistics stacked over the MoE layers, then one row per MTP module: [n_moe + depth, ...].
    stats: MoEStats | None


class HiddenOutput(NamedTuple):
    """What the LM head reads: the final-normed hidden states of the main model and of each MTP module."""

    h_BxLxD: jax.Array
    mtp_h_DxBxLxD: jax.Array | None  # [depth, B, L, D]; MTP depth k's row i predicts token i + 1 + k
    stats: MoEStats | None  # [rows, ...]; pipelined: [micro_batches, rows, ...] (per pass, lm_loss combines them)


class Block(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is a dense MLP or an MoE."""

    def __init__(self, cfg, *, moe: bool, rngs: nnx.Rngs):
        m = cfg.model
        pdt = dtype_of(m.param_dtype)
        self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        kernels = model_kernels(cfg)
        self.attn = make_attention(m, kernels["attention"], rngs=rngs)
        self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        if moe:
            self.ffn = MoE(m.d_model, cfg.moe, kernels["expert_gemm"], rngs=rngs, std=m.init_std, param_dtype=pdt,
                           f32_grad=grads_in_f32(m), exchange_chunks=exchange_chunks(cfg))
        else:
            self.ffn = MLP(m.d_model, m.d_ff, rngs=rngs, std=m.init_std, param_dtype=pdt,
                           f32_grad=grads_in_f32(m))
        self.is_moe = moe

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL=None):
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL, segment_ids_BxL)
        x_BxLxD = constrain(x_BxLxD, ACT_BxLxD)
        if self.is_moe:
            y, stats = self.ffn(self.ffn_norm(x_BxLxD))
        else:
            y, stats = self.ffn(self.ffn_norm(x_BxLxD)), None
        return constrain(x_BxLxD + y, ACT_BxLxD), stats

    def decode(self, x_BxSxD, positions_BxS, cache):
        """The block on S new positions of each row over its attention's KV cache (generation; MoE layers
        dropless: callers trace this inside moe.exact_dispatch). Returns (output, the updated cache)."""
        a_BxSxD, cache = self.attn.decode(self.attn_norm(x_BxSxD), positions_BxS, cache)
        x_BxSxD = constrain(x_BxSxD + a_BxSxD, ACT_BxLxD)
        y = self.ffn(self.ffn_norm(x_BxSxD))
        return constrain(x_BxSxD + (y[0] if self.is_moe else y), ACT_BxLxD), cache


def _stacked_blocks(cfg, n: int, *, moe: bool, rngs: nnx.Rngs, in_pipeline: bool = False):
    """n Blocks with parameters stacked on a leading 'layers' dim, for nnx.scan (split over `stage` when the stack
    runs in the pipeline)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata=STAGE_LAYERS_AXIS_METADATA if in_pipeline else LAYERS_AXIS_METADATA)
    def create(rngs):
        return Block(cfg, moe=moe, rngs=rngs)

    return create(rngs)


class MTPModule(nnx.Module):
    """One Multi-Token Prediction module (DeepSeek-V3 section 2.2): h' = W [norm(emb(t_{i+k})); norm(h_i)],
    one transformer block, and its own norm before the shared LM head. The concat order (embedding first)
    is the released checkpoints' (`eh_proj`), which the paper's formula writes the other way round."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m = cfg.model
        pdt = dtype_of(m.param_dtype)
        self.emb_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        self.hidden_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        self.f32_grad = grads_in_f32(m)
        self.w_eh_2DxD = param(rngs, (2 * m.d_model, m.d_model), ("mtp_concat", "embed"), std=m.init_std, dtype=pdt)
        self.block = Block(cfg, moe=layer_plan(m).n_moe > 0, rngs=rngs)
        self.out_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)

    def __call__(self, h_BxLxD, next_emb_BxLxD, positions_BxL, segment_ids_BxL=None):
        cat_BxLx2D = jnp.concatenate([self.emb_norm(next_emb_BxLxD), self.hidden_norm(h_BxLxD)], axis=-1)
        x_BxLxD = project("blc,cd->bld", cat_BxLx2D, self.w_eh_2DxD[...], f32_grad=self.f32_grad)
        x_BxLxD, stats = self.block(constrain(x_BxLxD, ACT_BxLxD), positions_BxL, segment_ids_BxL)
        return x_BxLxD, self.out_norm(x_BxLxD), stats


def shift_left(tokens_BxL, k: int, fill: int = 0):
    """tokens[:, i + k] at position i; the last k positions get `fill` (their loss is masked)."""
    if k == 0:
        return tokens_BxL
    return jnp.concatenate([tokens_BxL[:, k:], jnp.full_like(tokens_BxL[:, :k], fill)], axis=1)


def _concat_stats(parts: list[MoEStats]) -> MoEStats | None:
    """Statistics [rows, ...] of consecutive layers, their rows one after the other."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)


def _stack_stats(main: MoEStats | None, extra: list[MoEStats]) -> MoEStats | None:
    return _concat_stats(([main] if main is not None else []) + [jax.tree.map(lambda x: x[None], s) for s in extra])


class Transformer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m = cfg.model
        pdt = dtype_of(m.param_dtype)
        self.cache_shape = (m.attention, cached_attention.cache_widths(m))  # per position, per layer (empty_cache)
        self.dtype = dtype_of(m.dtype)
        self.param_dtype = pdt  # stored weights (optim.master_weights differentiates their f32 values)
        self.f32_grad = grads_in_f32(m)
        self.fp8 = m.get("fp8", "none")  # model.fp8: the body's projections and expert GEMMs (kernels/fp8.py)
        self.remat = m.remat
        # The loss kernel lm_loss runs over this model's LM head (kernels.loss; moejax/kernels/cross_entropy.py).
        self.loss_kernel = model_kernels(cfg)["loss"]
        self.loss_chunk = int(cfg.kernels.loss_chunk)
        plan = layer_plan(m)
        self.n_dense, self.n_moe = plan.n_dense, plan.n_moe
        # (is MoE, first index in its stack, layers) per run of one kind, in layer order (a static attribute)
        self.layer_runs = plan.runs
        # Pipeline stages (mesh.stage > 1): the MoE stack runs as a circular pipeline over train.micro_batches.
        self.stages, self.virtual_stages = int(cfg.mesh.get("stage", 1)), int(cfg.mesh.get("virtual_stages", 1))
        check_pipeline_layers(m, self.stages)
        self.pipelined = self.stages > 1 and self.n_moe > 0
        self.micro_batches = pipeline_in_flight(cfg)  # per pass (program/step.py accumulates over the passes)
        # circular (parallel/pipeline.py) | 1f1b (parallel/one_f_one_b.py, training only: model/pipelined_loss.py)
        self.pipeline_schedule = str(cfg.mesh.get("pipeline_schedule", "circular"))
        self.embed = Embed(m.vocab_size, m.d_model, rngs=rngs, std=m.init_std, param_dtype=pdt)
        self.dense_layers = _stacked_blocks(cfg, self.n_dense, moe=False, rngs=rngs) if self.n_dense else None
        self.moe_layers = (_stacked_blocks(cfg, self.n_moe, moe=True, rngs=rngs, in_pipeline=self.pipelined)
                           if self.n_moe else None)
        self.stack_layout = moe_stack_layout(cfg)
        if self.pipelined and self.stack_layout.lead != (self.n_moe,):  # virtual stages or an uneven split
            _to_slots(self.moe_layers, self.stack_layout)
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdt)
        self.head_DxV = param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"), std=m.init_std, dtype=pdt)
        self.mtp = nnx.List([MTPModule(cfg, rngs=rngs) for _ in range(m.mtp_depth)])

    def update_router_bias(self, tokens_per_expert_LxE, rate: float):
        """Aux-loss-free balancing: bias += rate * sign(mean_load - load), per MoE layer (MTP blocks included;
        rows follow ModelOutput.stats: the stacked MoE layers, then one per MTP module)."""
        if self.moe_layers is None or rate == 0:
            return
        load = tokens_per_expert_LxE.astype(jnp.float32)
        step_LxE = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        bias = self.moe_layers.ffn.router.bias_E  # stored in the stack's slots (moe_stack_layout)
        bias[...] = bias[...] + self.stack_layout.to_slots(step_LxE[: self.n_moe])
        for k, module in enumerate(self.mtp):
            mtp_bias = module.block.ffn.router.bias_E
            mtp_bias[...] = mtp_bias[...] + step_LxE[self.n_moe + k]

    def logits(self, h_BxLxD):
        return constrain(project("bld,dv->blv", h_BxLxD, self.head_DxV[...], f32_grad=self.f32_grad),
                         ("batch", "seq", "vocab"))

    def __call__(self, tokens_BxL, segment_ids_BxL=None) -> ModelOutput:
        """Logits in the compute dtype, in sequence order. With segment ids (packed documents), positions restart in
        each document and attention never crosses a document boundary."""
        out = self.hidden(tokens_BxL, segment_ids_BxL)
        if self.pipelined and out.stats is not None:
            out = out._replace(stats=combine_micro_stats(out.stats))
        parts = context_size()  # hidden states in context order: the logits back in sequence order

        def logits(h_BxLxD):
            return gather_sequence(self.logits(h_BxLxD), parts, trailing=("vocab",))

        mtp_logits = None if out.mtp_h_DxBxLxD is None else jnp.stack([logits(h) for h in out.mtp_h_DxBxLxD])
        return ModelOutput(logits(out.h_BxLxD), mtp_logits, out.stats)

    def hidden(self, tokens_BxL, segment_ids_BxL=None) -> HiddenOutput:
        """The forward pass up to (not including) the LM head: what the loss kernels (model/loss.py) read. With
        model.fp8 its projections and expert GEMMs read FP8 inputs; the head (logits) stays in the compute dtype.
        tokens and segment ids in sequence order; with the sequence split over `context` (parallel/context.py) the
        hidden states come out in context order, split over it."""
        with fp8.gemms_in(self.fp8):
            return self._hidden(tokens_BxL, segment_ids_BxL)

    def _embedded(self, tokens_BxL, segment_ids_BxL=None):
        """(embeddings [B, L, D], positions, segment ids) as the layers see them (context order and its query
        ranges with context parallelism)."""
        batch, seq = tokens_BxL.shape
        if segment_ids_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        else:
            positions_BxL = segment_positions(segment_ids_BxL)
        parts = context_size()
        if parts > 1:  # every layer works on context-ordered positions; attention reads each query's key range
            segment_ids_BxL, positions_BxL = context_queries(positions_BxL, parts)
        x_BxLxD = constrain(self.embed(to_context_order(tokens_BxL, parts), self.dtype), ACT_BxLxD)
        return x_BxLxD, positions_BxL, segment_ids_BxL

    def pipeline_input(self, tokens_BxL, segment_ids_BxL=None, *, remat: str | None = None):
        """A pipelined model's parts before the stages: the embedding and the dense layers (they all come first:
        check_pipeline_layers). (x [B, L, D], positions, segment ids as the layers see them.) remat: the dense
        layers' policy, default model.remat."""
        x_BxLxD, positions_BxL, segment_ids_BxL = self._embedded(tokens_BxL, segment_ids_BxL)
        if self.dense_layers is not None:
            x_BxLxD, _ = _run_stack(self.dense_layers, x_BxLxD, positions_BxL, segment_ids_BxL,
                                    self.remat if remat is None else remat)
        return x_BxLxD, positions_BxL, segment_ids_BxL

    def _hidden(self, tokens_BxL, segment_ids_BxL=None) -> HiddenOutput:
        if self.pipelined:
            x_BxLxD, positions_BxL, segments = self.pipeline_input(tokens_BxL, segment_ids_BxL)
            return self._pipelined(x_BxLxD, tokens_BxL, positions_BxL, segments)
        x_BxLxD, positions_BxL, segment_ids_BxL = self._embedded(tokens_BxL, segment_ids_BxL)
        moe_stats = []  # one per run of MoE layers, in layer order
        for moe, start, count in self.layer_runs:
            stack, size = (self.moe_layers, self.n_moe) if moe else (self.dense_layers, self.n_dense)
            blocks = stack if count == size else _layer_range(stack, start, start + count)
            x_BxLxD, stats = _run_stack(blocks, x_BxLxD, positions_BxL, segment_ids_BxL, self.remat)
            if moe:
                moe_stats.append(stats)
        stats = _concat_stats(moe_stats)
        mtp_h_DxBxLxD, mtp_stats = self._mtp(self.mtp, self.embed, x_BxLxD, tokens_BxL, positions_BxL,
                                             segment_ids_BxL)
        return HiddenOutput(self.final_norm(x_BxLxD), mtp_h_DxBxLxD, _stack_stats(stats, mtp_stats))

    def empty_cache(self, batch: int, length: int):
        """A zero KV cache for `batch` rows of `length` positions: one stacked cache [layers, B, T, ...] per run of
        one stack's layers (Transformer.layer_runs), in the compute dtype (model/cached_attention.py)."""
        return tuple(cached_attention.empty_cache(*self.cache_shape, batch, length, self.dtype, lead=(count,))
                     for _, _, count in self.layer_runs)

    def decode(self, tokens_BxS, positions_BxS, cache):
        """Generation's forward: S new tokens of each row at their positions, over and into the KV cache.
        Returns (logits [B, S, V] in f32, the updated cache). Prefill is this on the prompt from an empty cache; the
        logits equal the uncached forward's at the same positions (tests/test_generate.py). Every MoE layer is
        dropless, as in evaluation; the MTP modules take no part (they predict further tokens for training)."""
        if self.pipelined:
            raise ValueError("generation runs without pipeline stages: load the model with mesh.stage=1 "
                             "(moejax.inference.load_model does)")
        x_BxSxD = constrain(self.embed(tokens_BxS, self.dtype), ACT_BxLxD)
        new_cache = []
        with exact_dispatch():
            for (moe, start, count), cache_run in zip(self.layer_runs, cache):
                stack, size = (self.moe_layers, self.n_moe) if moe else (self.dense_layers, self.n_dense)
                blocks = stack if count == size else _layer_range(stack, start, start + count)
                x_BxSxD, cache_run = _decode_stack(blocks, x_BxSxD, positions_BxS, cache_run)
                new_cache.append(cache_run)
        logits = self.logits(self.final_norm(x_BxSxD))
        return logits.astype(jnp.float32), tuple(new_cache)

    def _mtp(self, mtp, embed, h_BxLxD, tokens_BxL, positions_BxL, segment_ids_BxL):
        """The MTP modules in sequence on the main model's last hidden state: ([depth, B, L, D] normed hidden
        states or None, their MoE statistics). tokens_BxL in sequence order (the shift is along the sequence), the
        rest as the layers see them (context order with context parallelism)."""
        mtp_hidden, mtp_stats = [], []
        run = _remat(lambda mod, h, e, p, s: mod(h, e, p, s), self.remat)
        parts = context_size()
        for k, module in enumerate(mtp, start=1):
            next_emb = embed(to_context_order(shift_left(tokens_BxL, k), parts), self.dtype)
            h_BxLxD, normed_BxLxD, s = run(module, h_BxLxD, next_emb, positions_BxL, segment_ids_BxL)
            mtp_hidden.append(normed_BxLxD)
            if s is not None:
                mtp_stats.append(s)
        return (jnp.stack(mtp_hidden) if mtp_hidden else None), mtp_stats

    def _pipelined(self, x_BxLxD, tokens_BxL, positions_BxL, segment_ids_BxL) -> HiddenOutput:
        """The MoE stack as a circular pipeline over micro-batches (rows m, m + M, ...: parallel/pipeline.py),
        then the MTP modules once per micro-batch, so every statistic is per pass: [M, rows, ...]."""
        mesh = current_mesh()
        if mesh is None or mesh.shape.get("stage", 1) != self.stages:
            raise ValueError(f"this model was built for mesh.stage={self.stages} pipeline stages; run it under a "
                             f"mesh with that stage axis (jax.set_mesh), not {None if mesh is None else mesh.shape}")
        # Outside the stages the rows are split over `stage` too (mesh.batch_axes): the embedding and the dense
        # layers above, the head and the loss after this ran data-parallel over the stages. The MoE stack needs every
        # micro-batch on every stage (each stage runs its chunks on all of them): gathered over `stage` here.
        with inside_stage():
            x_BxLxD = constrain(x_BxLxD, ACT_BxLxD)
            y_MxBxLxD, mtp_h_DxBxLxD, stats = self._stages_and_mtp(mesh, x_BxLxD, tokens_BxL, positions_BxL,
                                                                  segment_ids_BxL)
        # Back to rows split over `stage` (a local slice of what every stage holds) before the head and the loss.
        h_BxLxD = constrain(merge_micro_batches(y_MxBxLxD), ACT_BxLxD)
        if mtp_h_DxBxLxD is not None:
            mtp_h_DxBxLxD = constrain(mtp_h_DxBxLxD, (None, *ACT_BxLxD))
        return HiddenOutput(self.final_norm(h_BxLxD), mtp_h_DxBxLxD, stats)

    def _mtp_split_over_stages(self, mesh, y_MxBxLxD, tokens_MxB, positions_MxB, segments_MxB):
        """The MTP modules once per micro-batch (a whole pass each, as gradient accumulation runs them, so their MoE
        statistics are per pass), stage s taking micro-batches s, s + S, ...: each stage runs ceil(M / S) passes,
        none repeats another's. With M not a multiple of S the last round pads with copies of the first micro-batches,
        whose outputs are dropped (a stage would idle that long anyway). Returns ([M, depth, B, L, D], statistics
        [M, depth, ...])."""
        n_micro, n_stages = y_MxBxLxD.shape[0], self.stages
        rounds = -(-n_micro // n_stages)
        take = np.arange(rounds * n_stages) % n_micro  # padded micro-batch j = r S + s runs on stage s

        def by_stage(tree):  # [M, ...] -> [S, rounds, ...], dim 0 split over `stage` (each array of a pytree)
            def one(a):
                a = a[take].reshape(rounds, n_stages, *a.shape[1:]).swapaxes(0, 1)
                spec = P("stage", *[P.UNCONSTRAINED] * (a.ndim - 1))
                return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

            return jax.tree.map(one, tree)

        def in_order(a):  # [S, rounds, ...] -> [M, ...]
            return a.swapaxes(0, 1).reshape(rounds * n_stages, *a.shape[2:])[:n_micro]

        graphdef, state = nnx.split((self.mtp, self.embed))

        def stage_passes(state, h_RxB, tokens_RxB, positions_RxB, segments_RxB):
            mtp, embed = nnx.merge(graphdef, state)

            def mtp_pass(mtp, embed, h, tokens, positions, segments):
                mtp_h, mtp_stats = self._mtp(mtp, embed, h, tokens, positions, segments)
                return mtp_h, _stack_stats(None, mtp_stats)

            return nnx.scan(mtp_pass, in_axes=(None, None, 0, 0, 0, 0), out_axes=(0, 0))(
                mtp, embed, h_RxB, tokens_RxB, positions_RxB, segments_RxB)

        out = jax.vmap(stage_passes, in_axes=(None, 0, 0, 0, 0), spmd_axis_name="stage")(
            state, by_stage(y_MxBxLxD), by_stage(tokens_MxB), by_stage(positions_MxB), by_stage(segments_MxB))
        return jax.tree.map(in_order, out)

    def stage_side(self, positions_BxL, segment_ids_BxL):
        """What each stage reads for the micro-batch it works on: {positions, segments} [M, ...] per micro-batch."""
        side = {"positions": micro_batches(positions_BxL, self.micro_batches)}
        if segment_ids_BxL is not None:  # segment ids, or ContextQueries
            side["segments"] = jax.tree.map(lambda a: micro_batches(a, self.micro_batches), segment_ids_BxL)
        return side

    def stage_chunks(self):
        """(the MoE stack as chunks (state [V, S, C, ...], is-layer mask [V, S, C] of an uneven split or None),
        stage_fn(chunk, x, side) -> (y, stats) running one chunk's layers)."""
        graphdef, state = nnx.split(self.moe_layers)
        chunks = _as_chunks(state, self.stages, self.virtual_stages)
        is_layer_VxSxC = slot_is_layer(self.n_moe, self.stages, self.virtual_stages)
        uneven = not is_layer_VxSxC.all()
        # An uneven split's identity slots ride along with the chunk they belong to (selected per tick like it).
        params_VxSxC = (chunks, jnp.asarray(is_layer_VxSxC) if uneven else None)

        def stage_fn(chunk, x, side_m):
            chunk_state, is_layer_C = chunk
            return _run_stack(nnx.merge(graphdef, chunk_state), x, side_m["positions"], side_m.get("segments"),
                              self.remat, is_layer_C)

        return params_VxSxC, stage_fn

    def micro_batch_stats(self, stats_VxSxMxC, mtp_stats_MxD=None):
        """Per-micro-batch statistics [M, rows, ...] of the pipeline's chunks [V, S, M, C, ...]: the MoE layers in
        layer order (an uneven split's identity slots left out), then the MTP modules' rows."""
        stats_MxL = jax.tree.map(lambda a: self.stack_layout.from_slots(
            jnp.moveaxis(a, 2, 0).reshape(a.shape[2], -1, *a.shape[4:]), axis=1), stats_VxSxMxC)
        return stats_MxL if mtp_stats_MxD is None else jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], axis=1), stats_MxL, mtp_stats_MxD)

    def _stages_and_mtp(self, mesh, x_BxLxD, tokens_BxL, positions_BxL, segment_ids_BxL):
        """Inside the stages: the MoE stack's pipeline, then the MTP modules once per micro-batch on every stage
        alike (replicated over `stage`, as their MoE statistics are per pass: [M, rows, ...])."""
        n_micro = self.micro_batches
        side = self.stage_side(positions_BxL, segment_ids_BxL)
        params_VxSxC, stage_fn = self.stage_chunks()
        # Micro-batches keep the rows' split (each device's share of every micro-batch) on the way in and out, so
        # the backward's per-tick slices of their cotangents need no re-layout either.
        x_MxBxLxD = constrain(micro_batches(x_BxLxD, n_micro), (None, *ACT_BxLxD))
        one = jax.tree.map(lambda a: a[0], (x_MxBxLxD, side))
        chunk_like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), params_VxSxC)
        stats_like = jax.eval_shape(stage_fn, chunk_like, *one)[1]
        y_MxBxLxD, stats_VxSxMxC = circular_pipeline(stage_fn, params_VxSxC, x_MxBxLxD, mesh=mesh, axis="stage",
                                                     n_repeats=self.virtual_stages, side_MxB=side, aux_like=stats_like,
                                                     tick_policy=_tick_policy(self.remat) if self.virtual_stages > 1 else None)
        y_MxBxLxD = constrain(y_MxBxLxD, (None, *ACT_BxLxD))
        mtp_h_MxDx, mtp_stats_Mx = (None, None)
        if len(self.mtp):
            mtp_h_MxDx, mtp_stats_Mx = self._mtp_split_over_stages(
                mesh, y_MxBxLxD, micro_batches(tokens_BxL, n_micro), side["positions"], side.get("segments"))
        stats = self.micro_batch_stats(stats_VxSxMxC, mtp_stats_Mx)
        mtp_h_DxBxLxD = None if mtp_h_MxDx is None else jnp.stack(
            [merge_micro_batches(mtp_h_MxDx[:, k]) for k in range(mtp_h_MxDx.shape[1])])
        return y_MxBxLxD, mtp_h_DxBxLxD, stats
