"""Per-device memory of serving a model with moejax's generation (moejax/inference/generate.py): the weights at the
layout's shards and the KV cache of `batch` sequences of `context` positions, as model/cached_attention.py keeps it.

  weights   every parameter and the router bias at its sharded size (the training layout's rules: experts over
            `expert`, d_model over `fsdp`, the expert FFN over `tensor`), in `weight_dtype`
  kv_cache  per attention layer and position what the cache keeps (MLA: the latent + the shared RoPE key, C + R
            values; GQA: K and V heads, split over `tensor` where the heads divide), for the batch's rows split over
            data x fsdp x expert (the dispatch's token axes; generation runs without stages or a context split)

Not counted: the decode step's transients (one position's activations and the MoE dispatch buffers, small beside
the cache at serving batch sizes) and the MTP modules' caches (generation does not run them).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from moejax.model.cached_attention import cache_bytes_per_token, cache_widths
from moejax.planner.layout import Layout, layout_config
from moejax.planner.state_shapes import state_leaves


def kv_values_per_position(m, tensor: int = 1) -> int:
    """Values one attention layer's cache keeps per position on one device (GQA's heads split over `tensor` where
    they divide; MLA's latent is shared by all heads and is not split)."""
    widths = cache_widths(m)
    values = sum(math.prod(w) for w in widths)
    if m.attention != "mla":
        heads = int(m.n_kv_heads or m.n_heads)
        if heads % tensor == 0:
            values //= tensor
    return values


def serving_memory(cfg, layout: Layout, *, batch: int, context: int, weight_dtype: str = "bfloat16",
                   cache_dtype: str = "bfloat16") -> dict:
    """{"weights", "kv_cache", "total"} bytes per device, the rows per device and the cache's bytes per position
    and layer (kept, and what expanded per-head K/V would take)."""
    if layout.stage > 1 or layout.context > 1:
        raise ValueError("generation runs without pipeline stages or a context split: a serving layout has "
                         "stage = context = 1")
    sizes = layout.sizes
    params, model_state, _ = state_leaves(layout_config(cfg, layout))
    weight_itemsize = jnp.dtype(weight_dtype).itemsize
    weights = sum(leaf.local_bytes(sizes) // leaf.itemsize * weight_itemsize for leaf in params)
    weights += sum(leaf.local_bytes(sizes) for leaf in model_state)
    rows = -(-batch // layout.batch_shards)
    m = cfg.model
    itemsize = jnp.dtype(cache_dtype).itemsize
    kv = int(m.n_layers) * rows * context * kv_values_per_position(m, layout.tensor) * itemsize
    per_position = cache_bytes_per_token(m, itemsize)
    return {"weights": int(weights), "kv_cache": int(kv), "total": int(weights + kv), "rows_per_device": rows,
            "kv_bytes_per_position_per_layer": per_position["kept"],
            "expanded_kv_bytes_per_position_per_layer": per_position["expanded"]}
