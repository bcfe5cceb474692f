"""A DeepSeek-V3-shaped model that trains on the CPU mesh in minutes: every architectural part of the 671B
config (MLA with q/kv low-rank + norms and a decoupled shared RoPE key, YaRN, interleaved RoPE, first-k dense
layers, 1 shared + 32 fine-grained routed experts, top-4 of 8 groups limited to 4, sigmoid scores, routed
scaling, aux-loss-free bias, sequence-wise aux loss, one MTP module) at small width.
8 emulated devices as data=2 x expert=4."""

from moejax.config import default_config


def get_config():
    c = default_config()
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
    m.remat = "none"
    e.n_routed_experts = 32
    e.n_shared_experts = 1
    e.top_k = 4
    e.d_ff_expert = 64
    e.score_func = "sigmoid"
    e.n_groups = 8
    e.topk_groups = 4
    e.routed_scaling = 2.5
    e.capacity_factor = 1.25
    e.bias_update_rate = 3e-2  # a short run needs faster balancing than DeepSeek-V3's 1e-3
    c.mesh.data = -1
    c.mesh.expert = 4
    c.train.steps = 200
    c.train.global_batch = 16
    c.train.seq_len = 128
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.expert_load_every = 10
    c.optim.lr = 4e-3
    c.optim.warmup_steps = 20
    return c
