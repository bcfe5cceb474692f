"""Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, GQA 32 query / 4 key-value heads of 128
with q/k RMSNorm, 128 experts of width 768, top-8 softmax routing with normalised weights, no shared
experts, RoPE theta 1e6, vocab 151936. For `moejax-plan`, `--dry_run` and HF import/export."""

from moejax.config import default_config


def get_config():
    c = default_config()
    m, e = c.model, c.moe
    m.vocab_size = 151936
    m.d_model = 2048
    m.n_layers = 48
    m.first_k_dense = 0
    m.attention = "gqa"
    m.n_heads = 32
    m.n_kv_heads = 4
    m.head_dim = 128
    m.qk_norm = True
    m.rope_theta = 1e6
    m.norm_eps = 1e-6
    m.max_seq_len = 40960
    m.dtype = "bfloat16"
    m.remat = "full"
    e.n_routed_experts = 128
    e.n_shared_experts = 0
    e.top_k = 8
    e.d_ff_expert = 768
    e.score_func = "softmax"
    e.norm_topk_prob = True
    e.bias_update_rate = 0.0  # Qwen3-MoE balances with an aux loss; no bias: top-k of the softmax, as HF
    # config.json router_aux_loss_coef; the same loss as transformers' load_balancing_loss_func (once over
    # all layers' router logits; tests/test_balance_loss_hf.py), so the HF value is used unconverted.
    e.batch_aux_loss_coef = 1e-3
    e.seq_aux_loss_coef = 0.0
    e.dispatch = "dropless"  # as published: no token is dropped
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 8
    c.train.seq_len = 4096
    c.train.global_batch = 1024
    return c
