"""The training objective: next-token cross-entropy, the MTP losses, and the MoE balance losses.

Targets are masked where they belong to another document than their input (packed rows) and, for MTP depth
k, in the last k positions, whose target lies beyond the sequence. Means are over unmasked targets.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.model.moe import MoEStats
from moejax.model.transformer import shift_left


class LossParts(NamedTuple):
    ce: jax.Array  # main next-token cross-entropy (nats per target)
    mtp_ce_D: jax.Array  # [mtp_depth] cross-entropy of each MTP module
    aux: jax.Array  # weighted MoE balance losses, summed over layers
    stats: MoEStats | None


def masked_cross_entropy(logits_BxLxV, targets_BxL, mask_BxL):
    """Mean of -log p(target) over the masked-in positions, in f32."""
    logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    nll_BxL = -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]
    mask = mask_BxL.astype(jnp.float32)
    return jnp.sum(nll_BxL * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _target_mask(segment_ids_BxL1, k: int):
    """Targets for depth k (target token i + 1 + k for input i) that are inside the row and the same document."""
    batch, seq1 = segment_ids_BxL1.shape
    seq = seq1 - 1
    in_row = jnp.arange(seq) < seq - k
    same_doc = shift_left(segment_ids_BxL1[:, 1:], k, fill=-1) == segment_ids_BxL1[:, :-1]
    return same_doc & in_row[None, :]


def lm_loss(model, tokens_BxL1, segment_ids_BxL1=None, *, mtp_weight: float = 0.0):
    """(total loss, LossParts). tokens_BxL1 holds L inputs and their L next-token targets (L + 1 tokens)."""
    segments = segment_ids_BxL1 if segment_ids_BxL1 is not None else jnp.zeros_like(tokens_BxL1)
    out = model(tokens_BxL1[:, :-1], None if segment_ids_BxL1 is None else segment_ids_BxL1[:, :-1])
    ce = masked_cross_entropy(out.logits_BxLxV, tokens_BxL1[:, 1:], _target_mask(segments, 0))
    total = ce
    mtp_ce = []
    if out.mtp_logits_DxBxLxV is not None:
        for k in range(1, out.mtp_logits_DxBxLxV.shape[0] + 1):
            targets = shift_left(tokens_BxL1[:, 1:], k)
            mtp_ce.append(masked_cross_entropy(out.mtp_logits_DxBxLxV[k - 1], targets, _target_mask(segments, k)))
        # DeepSeek-V3 eq. 25: lambda / D * sum_k L_MTP^k.
        total = total + mtp_weight / len(mtp_ce) * sum(mtp_ce)
    aux = jnp.sum(out.stats.aux_loss) if out.stats is not None else jnp.float32(0)
    return total + aux, LossParts(ce, jnp.stack(mtp_ce) if mtp_ce else jnp.zeros((0,), jnp.float32), aux, out.stats)
