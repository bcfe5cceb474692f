"""Qwen3-MoE-style model at CPU size: GQA (4 query / 2 key-value heads) with q/k RMSNorm, 32 small experts
top-4 with softmax routing and normalised weights, no shared experts, no dense layers, a batch-wise
auxiliary balance loss. 8 emulated devices as data=2 x expert=4."""

from moejax.config import cpu_run, default_config


def get_config():
    c = cpu_run(default_config(), steps=200)
    m, e = c.model, c.moe
    m.d_model = 128
    m.n_layers = 4
    m.first_k_dense = 0
    m.attention = "gqa"
    m.n_heads = 4
    m.n_kv_heads = 2
    m.head_dim = 32
    m.qk_norm = True
    m.rope_theta = 1e6
    e.n_routed_experts = 32
    e.n_shared_experts = 0
    e.top_k = 4
    e.d_ff_expert = 64
    e.score_func = "softmax"
    e.norm_topk_prob = True
    e.bias_update_rate = 0.0
    e.seq_aux_loss_coef = 0.0
    e.batch_aux_loss_coef = 1e-3  # transformers' router_aux_loss_coef, as in qwen3_moe_30b_a3b.py
    return c
