"""Activation memory per device, from what the real model saves for its backward pass.

`saved_residuals` traces the loss (forward + the residuals autodiff keeps) on abstract inputs of one
device's micro-batch, under the config's remat policy: the scan over layers saves its per-layer residuals
stacked, so their sizes come out of the model itself (MHA, GQA, MLA, MoE buffers, logits), nothing is
hard-coded. The trace has no mesh, so the MoE path sizes its buffers for one device's tokens, as each device
does on a mesh. Residuals that are not of hidden size (attention heads, FFN intermediates) are split over
`tensor`; the hidden-size ones (the residual stream, norms) are replicated over it.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.model.loss import lm_loss
from moejax.program.state import create_model


@functools.lru_cache(maxsize=64)
def _residuals(cfg_json: str, micro_batch: int, seq_len: int, remat: str) -> tuple[tuple[tuple[int, ...], int], ...]:
    import ml_collections
    from jax._src.ad_checkpoint import saved_residuals  # public as jax.ad_checkpoint.print_saved_residuals

    cfg = ml_collections.ConfigDict(json.loads(cfg_json))
    cfg.model.remat = remat
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: create_model(cfg, 0)), nnx.Param, ...)

    def loss(params, rest, tokens):
        return lm_loss(nnx.merge(graphdef, params, rest), tokens)[0]

    tokens = jax.ShapeDtypeStruct((micro_batch, seq_len + 1), jnp.int32)
    out = []
    for aval, source in saved_residuals(loss, params, rest, tokens):
        if "from the argument" in source:
            continue  # parameters and the batch: counted as state, not activations
        out.append((tuple(aval.shape), aval.dtype.itemsize))
    return tuple(out)


def activation_bytes(cfg, micro_batch: int, seq_len: int, remat: str, tensor: int = 1) -> int:
    """Bytes per device the forward pass keeps for the backward pass."""
    d_model = int(cfg.model.d_model)
    total = 0
    for shape, itemsize in _residuals(cfg.to_json_best_effort(sort_keys=True), micro_batch, seq_len, remat):
        n = int(np.prod(shape)) * itemsize
        total += n if (shape and shape[-1] == d_model) else -(-n // tensor)
    return total

