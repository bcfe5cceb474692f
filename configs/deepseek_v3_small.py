"""A DeepSeek-V3-shaped model that trains on the CPU mesh in minutes: every architectural part of the 671B
config (MLA with q/kv low-rank + norms and a decoupled shared RoPE key, YaRN, interleaved RoPE, first-k dense
layers, 1 shared + 32 fine-grained routed experts, top-4 of 8 groups limited to 4, sigmoid scores, routed
scaling, aux-loss-free bias, sequence-wise aux loss, one MTP module) at small width.
8 emulated devices as data=2 x expert=4."""

from moejax.config import cpu_run, default_config


def get_config():
    c = cpu_run(default_config(), steps=200)
    m, e = c.model, c.moe
    m.d_model = 128
    m.n_layers = 4
    m.first_k_dense = 1
    m.d_ff = 384
    m.attention = "mla"
    m.n_heads = 4
    m.q_lora_rank = 64
    m.kv_lora_rank = 32
    m.qk_nope_head_dim = 32
    m.qk_rope_head_dim = 16
    m.v_head_dim = 32
    m.rope_interleave = True
    m.rope_scaling = "yarn"
    m.yarn.factor = 4.0
    m.yarn.original_max_position = 128
    m.yarn.mscale = 1.0
    m.yarn.mscale_all_dim = 1.0
    m.max_seq_len = 512
    m.mtp_depth = 1
    m.mtp_loss_weight = 0.3
    e.n_routed_experts = 32
    e.n_shared_experts = 1
    e.top_k = 4
    e.d_ff_expert = 64
    e.score_func = "sigmoid"
    e.n_groups = 8
    e.topk_groups = 4
    e.routed_scaling = 2.5
    e.bias_update_rate = 3e-2  # a short run needs faster balancing than DeepSeek-V3's 1e-3
    e.dispatch = "dropless"  # as published: no token is dropped
    return c
