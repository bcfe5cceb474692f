"""The planner's serving memory (moejax/planner/serving.py) against hand counts: weights from the parameter counts,
the KV cache from what model/cached_attention.py keeps per position."""

from pathlib import Path

import pytest

from moejax import load_config
from moejax.model.accounting import param_counts
from moejax.planner.layout import Layout
from moejax.planner.serving import serving_memory

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _layout(**axes):
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **axes}
    return Layout(**sizes, remat="none", micro_batch=1, dispatch="dropless")


def test_weights_are_the_parameter_counts_at_their_shards():
    cfg = load_config(CONFIGS / "deepseek_v3_small.py")
    m, e = cfg.model, cfg.moe
    counts = param_counts(cfg)
    moe_rows = (m.n_layers - m.first_k_dense) + m.mtp_depth  # MoE layers, the MTP block's included
    bias = moe_rows * e.n_routed_experts  # the router's selection bias: f32 model state, not a bf16 weight
    routed = moe_rows * e.n_routed_experts * 3 * m.d_model * e.d_ff_expert
    one = serving_memory(cfg, _layout(), batch=8, context=64)
    assert one["weights"] == (counts["total"] + counts["mtp"] - bias) * 2 + bias * 4
    ep4 = serving_memory(cfg, _layout(expert=4), batch=8, context=64)
    # The routed experts split four ways (the bias may split too: it is the only other expert-indexed leaf).
    assert abs((one["weights"] - ep4["weights"]) - routed * 2 * 3 // 4) <= bias * 4


def test_kv_cache_keeps_mla_latent_and_gqa_heads():
    big = load_config(CONFIGS / "deepseek_v3_671b.py")
    served = serving_memory(big, _layout(expert=64), batch=256, context=32768)
    assert (served["kv_bytes_per_position_per_layer"], served["expanded_kv_bytes_per_position_per_layer"]) == (
        (512 + 64) * 2, 128 * (192 + 128) * 2)
    assert served["rows_per_device"] == 4
    assert served["kv_cache"] == 61 * 4 * 32768 * 1152
    mixtral = load_config(CONFIGS / "mixtral_8x7b.py")
    kv_heads, head_dim = mixtral.model.n_kv_heads, mixtral.model.head_dim
    whole = serving_memory(mixtral, _layout(data=8), batch=16, context=4096)
    split = serving_memory(mixtral, _layout(data=4, tensor=2), batch=16, context=4096)
    assert whole["kv_cache"] == 32 * 2 * 4096 * 2 * kv_heads * head_dim * 2
    assert split["kv_cache"] == 32 * 4 * 4096 * kv_heads * head_dim * 2  # twice the rows, half the heads
    with pytest.raises(ValueError, match="stage = context = 1"):
        serving_memory(mixtral, _layout(data=4, tensor=1, context=2), batch=16, context=4096)
