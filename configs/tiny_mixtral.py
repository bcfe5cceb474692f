"""Mixtral-style model at CPU size: GQA (4 query / 2 key-value heads), 8 experts top-2 with softmax routing
and renormalised weights, no shared experts, no dense layers, a batch-wise auxiliary balance loss instead of
the selection bias. 8 emulated devices as data=2 x expert=4."""

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
    m.rope_theta = 1e6
    m.norm_eps = 1e-5
    e.n_routed_experts = 8
    e.n_shared_experts = 0
    e.top_k = 2
    e.d_ff_expert = 256
    e.score_func = "softmax"
    e.norm_topk_prob = True
    e.bias_update_rate = 0.0
    e.seq_aux_loss_coef = 0.0
    e.batch_aux_loss_coef = 0.02  # transformers' router_aux_loss_coef, as in mixtral_8x7b.py
    return c
