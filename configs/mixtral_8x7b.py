"""Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, GQA 32 query / 8 key-value heads,
8 experts top-2 with softmax routing, no shared experts, RoPE theta 1e6, vocab 32000. For `moejax-plan`,
`--dry_run` and HF import/export; it does not fit on a laptop."""

from moejax.config import default_config


def get_config():
    c = default_config()
    m, e = c.model, c.moe
    m.vocab_size = 32000
    m.d_model = 4096
    m.n_layers = 32
    m.first_k_dense = 0
    m.attention = "gqa"
    m.n_heads = 32
    m.n_kv_heads = 8
    m.head_dim = 128
    m.rope_theta = 1e6
    m.norm_eps = 1e-5
    m.max_seq_len = 32768
    m.dtype = "bfloat16"
    m.remat = "full"
    e.n_routed_experts = 8
    e.n_shared_experts = 0
    e.top_k = 2
    e.d_ff_expert = 14336
    e.score_func = "softmax"
    e.norm_topk_prob = True
    e.bias_update_rate = 0.0  # Mixtral balances with an aux loss; no bias: top-k of the softmax, as HF
    # config.json router_aux_loss_coef; the same loss as transformers' load_balancing_loss_func (once over
    # all layers' router logits; tests/test_balance_loss_hf.py), so the HF value is used unconverted.
    e.batch_aux_loss_coef = 0.02
    e.seq_aux_loss_coef = 0.0
    e.dispatch = "dropless"  # as published: no token is dropped
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 8
    c.train.seq_len = 4096
    c.train.global_batch = 1024
    return c
