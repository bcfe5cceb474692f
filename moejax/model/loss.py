"""The training objective: next-token cross-entropy, the MTP losses, and the MoE balance losses.

Targets are masked where they belong to another document than their input (packed rows) and, for MTP depth
k, in the last k positions, whose target lies beyond the sequence. Means are over unmasked targets.

The LM head and the cross-entropy run as one kernel (`model.loss_kernel`, moejax/kernels/cross_entropy.py) over
the model's final hidden states (`Transformer.hidden`): `chunked` never materialises the [B, L, V] logits of
any head, `dense` computes them whole; both in f32 from the compute-dtype head.

The batch-wise balance loss is transformers' `load_balancing_loss_func` (Mixtral, Qwen3-MoE), so
`moe.batch_aux_loss_coef` is their `router_aux_loss_coef`: computed once per forward pass over every MoE
layer's tokens together (MTP modules' MoE blocks count as further layers), not summed over layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.kernels.cross_entropy import chunked_cross_entropy, dense_cross_entropy
from moejax.model.moe import MoEStats, combine_micro_stats
from moejax.model.transformer import shift_left
from moejax.parallel.context import context_size, fold_context_into_rows, to_context_order
from moejax.parallel.mesh import constrain, row_shards


class LossParts(NamedTuple):
    ce: jax.Array  # main next-token cross-entropy (nats per target)
    mtp_ce_D: jax.Array  # [mtp_depth] cross-entropy of each MTP module
    aux: jax.Array  # weighted MoE balance losses: per-layer seq/z terms summed, plus the model-wide batch term
    stats: MoEStats | None


def masked_mean(nll_BxL, mask_BxL):
    """Mean of nll over the masked-in positions, in f32 (0 when none is)."""
    mask = mask_BxL.astype(jnp.float32)
    return jnp.sum(nll_BxL.astype(jnp.float32) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _constrain_logits(logits_BxLxV):
    # The split the model gives its own logits: batch over the batch axes, vocab over tensor (as the head's V).
    return constrain(logits_BxLxV, ("batch", "seq", "vocab"))


def _constrain_folded_logits(logits_RxLxV):
    # Rows of one context shard's positions (parallel/context.fold_context_into_rows): rows over token_axes().
    return constrain(logits_RxLxV, ("token_rows", None, "vocab"))


def _constrain_row_parts(d_w_PxDxV):
    # The chunked loss's per-device partial head gradients: part p on the devices holding rows of part p.
    return constrain(d_w_PxDxV, ("batch", None, "vocab"))


def _constrain_folded_row_parts(d_w_PxDxV):
    return constrain(d_w_PxDxV, ("token_rows", None, "vocab"))


def head_cross_entropy(kernel: str, h_BxLxD, w_DxV, targets_BxL, *, chunk: int, folded: bool = False):
    """Per-position nll [B, L] (f32) of the LM head w over h, by the loss kernel `kernel` (dense | chunked).
    folded: h's rows are context shards' positions (fold_context_into_rows)."""
    constrain_logits = _constrain_folded_logits if folded else _constrain_logits
    if kernel == "dense":
        return dense_cross_entropy(h_BxLxD, w_DxV, targets_BxL, constrain_logits=constrain_logits)
    if kernel == "chunked":
        # The head's gradient as one partial sum per device the rows are split over, summed once per call
        # (kernels/cross_entropy.chunked_cross_entropy's row_parts), not once per chunk.
        parts = row_shards() * (context_size() if folded else 1)
        return chunked_cross_entropy(h_BxLxD, w_DxV, targets_BxL, chunk=chunk, constrain_logits=constrain_logits,
                                     row_parts=(parts, _constrain_folded_row_parts if folded else _constrain_row_parts))
    raise ValueError(f"unknown loss kernel {kernel!r} (kernels.loss: dense | chunked)")


def target_mask(segment_ids_BxL1, k: int):
    """Targets for depth k (target token i + 1 + k for input i) that are inside the row and the same document."""
    batch, seq1 = segment_ids_BxL1.shape
    seq = seq1 - 1
    in_row = jnp.arange(seq) < seq - k
    same_doc = shift_left(segment_ids_BxL1[:, 1:], k, fill=-1) == segment_ids_BxL1[:, :-1]
    return same_doc & in_row[None, :]


def batch_balance_loss(router_load_RxE, router_prob_RxE):
    """Per-row terms of transformers' `load_balancing_loss_func` over all R router rows together (the MoE
    layers, then the MTP modules' MoE blocks); their mean is that function's value on the concatenated logits:

        loss = E * sum_e F_e * P_e,  F_e = fraction of all rows' tokens whose top-k includes e (sums to top_k),
                                     P_e = mean probability of e over all rows' tokens.

    Every row routes the same B*L tokens, so the means over all rows' tokens are the means over rows of the
    per-row means (MoEStats.router_load_E / router_prob_E, mesh-wide). Row r's term E * sum_e F_e * p_re
    carries the whole gradient of row r's router (the loads are counts, not differentiable). The loss is
    top_k at perfect balance.
    """
    load_E = jnp.mean(jax.lax.stop_gradient(router_load_RxE), axis=0)
    return router_load_RxE.shape[-1] * jnp.sum(load_E * router_prob_RxE, axis=-1)


def with_batch_balance(stats: MoEStats, coef: float) -> MoEStats:
    """Stats with the model-wide batch-wise balance loss filled in: batch_aux_loss holds each row's term (mean
    over rows = the unweighted loss) and aux_loss gains coef * term / R (sum over rows = the weighted total)."""
    rows_R = batch_balance_loss(stats.router_load_E, stats.router_prob_E)
    aux = stats.aux_loss + coef * rows_R / rows_R.shape[0] if coef else stats.aux_loss
    return stats._replace(batch_aux_loss=rows_R, aux_loss=aux)


def head_ce(model, w_DxV, h_BxLxD, targets_BxL, mask_BxL):
    """Mean next-token cross-entropy of the LM head w over the final hidden states h (model.loss_kernel). With the
    sequence split over `context` the hidden states are in context order: the targets and masks are put in the same
    order, and each shard's positions become rows of their own, so the chunked loss scans local positions (a mean
    over positions does not care about their order)."""
    parts = context_size()
    h_BxLxD, targets_BxL, mask_BxL = (fold_context_into_rows(a, parts) for a in (
        h_BxLxD, to_context_order(targets_BxL, parts), to_context_order(mask_BxL, parts)))
    nll_BxL = head_cross_entropy(model.loss_kernel, h_BxLxD, w_DxV, targets_BxL, chunk=model.loss_chunk,
                                 folded=parts > 1)
    return masked_mean(nll_BxL, mask_BxL)


def valid_targets_H(segments_BxL1, n_heads: int):
    """[heads] count of the targets each head is trained on (main head, then MTP depths 1..D): the loss's own
    masks (another document, past the row end)."""
    return jnp.stack([jnp.sum(target_mask(segments_BxL1, k).astype(jnp.float32)) for k in range(n_heads)])


def micro_batch_balance(stats_MxR: MoEStats, coef: float):
    """(the step's statistics, the weighted balance loss) of per-micro-batch statistics [M, rows, ...]: each
    micro-batch's batch-wise balance loss over its own rows (as gradient accumulation computes it), their mean."""
    stats_MxR = jax.vmap(lambda s: with_batch_balance(s, coef))(stats_MxR)
    return combine_micro_stats(stats_MxR), jnp.sum(stats_MxR.aux_loss) / stats_MxR.aux_loss.shape[0]


def lm_loss(model, tokens_BxL1, segment_ids_BxL1=None, *, mtp_weight: float = 0.0):
    """(total loss, LossParts). tokens_BxL1 holds L inputs and their L next-token targets (L + 1 tokens)."""
    segments = segment_ids_BxL1 if segment_ids_BxL1 is not None else jnp.zeros_like(tokens_BxL1)
    out = model.hidden(tokens_BxL1[:, :-1], None if segment_ids_BxL1 is None else segment_ids_BxL1[:, :-1])
    w_DxV = model.head_DxV[...]  # as stored (f32): the kernels compute in h's dtype and return an f32 gradient

    def ce_of(h_BxLxD, targets_BxL, mask_BxL):
        return head_ce(model, w_DxV, h_BxLxD, targets_BxL, mask_BxL)

    ce = ce_of(out.h_BxLxD, tokens_BxL1[:, 1:], target_mask(segments, 0))
    total = ce
    mtp_ce = []
    if out.mtp_h_DxBxLxD is not None:
        for k in range(1, out.mtp_h_DxBxLxD.shape[0] + 1):
            targets = shift_left(tokens_BxL1[:, 1:], k)
            mtp_ce.append(ce_of(out.mtp_h_DxBxLxD[k - 1], targets, target_mask(segments, k)))
        # DeepSeek-V3 eq. 25: lambda / D * sum_k L_MTP^k.
        total = total + mtp_weight / len(mtp_ce) * sum(mtp_ce)
    stats, aux = out.stats, jnp.float32(0)
    if stats is not None:
        coef = float(model.moe_layers.ffn.batch_aux_loss_coef)
        if getattr(model, "pipelined", False):  # [M, rows, ...]: the balance losses per pass, their mean counts
            stats, aux = micro_batch_balance(stats, coef)
        else:
            stats = with_batch_balance(stats, coef)
            aux = jnp.sum(stats.aux_loss)
    return total + aux, LossParts(ce, jnp.stack(mtp_ce) if mtp_ce else jnp.zeros((0,), jnp.float32), aux, stats)
