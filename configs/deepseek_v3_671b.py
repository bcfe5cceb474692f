"""DeepSeek-V3 671B as published (config.json of deepseek-ai/DeepSeek-V3 and the technical report):
61 layers (first 3 dense), MLA, 256 routed + 1 shared experts top-8 with group-limited sigmoid routing,
aux-loss-free balancing, one MTP module. This is PRE-TRAINING as published: sequence 4096 with plain RoPE.
YaRN belongs to the later context-extension stages (configs/deepseek_v3_671b_context.py), which continue
from this run's checkpoint; the released checkpoint's config.json has YaRN because it comes after them.
Training hyper-parameters follow the report where it states them (AdamW betas 0.9/0.95, weight decay 0.1,
clip 1.0, bias rate 1e-3, alpha 1e-4).

The mesh is a GB300 NVL72 starting point (expert 32 inside a rack, fsdp across); `moejax-plan` ranks layouts.
This config does not fit on a laptop: use it with `moejax-plan` or `moejax-train --dry_run`."""

from moejax.config import default_config


def get_config():
    c = default_config()
    m, e = c.model, c.moe
    m.vocab_size = 129280
    m.d_model = 7168
    m.n_layers = 61
    m.first_k_dense = 3
    m.d_ff = 18432
    m.attention = "mla"
    m.n_heads = 128
    m.q_lora_rank = 1536
    m.kv_lora_rank = 512
    m.qk_nope_head_dim = 128
    m.qk_rope_head_dim = 64
    m.v_head_dim = 128
    m.rope_theta = 10000.0
    m.rope_interleave = True
    m.rope_scaling = "none"
    m.max_seq_len = 4096
    m.norm_eps = 1e-6
    m.init_std = 0.006
    m.mtp_depth = 1
    m.mtp_loss_weight = 0.3  # 0.3 for the first 10T tokens, 0.1 for the rest (report, section 4.2)
    m.dtype = "bfloat16"
    m.param_dtype = "float32"
    m.remat = "full"

    e.n_routed_experts = 256
    e.n_shared_experts = 1
    e.top_k = 8
    e.d_ff_expert = 2048
    e.score_func = "sigmoid"
    e.n_groups = 8
    e.topk_groups = 4
    e.routed_scaling = 2.5
    e.norm_topk_prob = True
    e.seq_aux_loss_coef = 1e-4
    e.bias_update_rate = 1e-3
    e.dispatch = "dropless"  # as published: no token is dropped

    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 32
    c.mesh.tensor = 1

    c.train.seq_len = 4096
    c.train.global_batch = 4096  # NVIDIA's record row uses GBS 4096 at sequence 4096
    c.train.steps = 100_000
    c.optim.lr = 2.2e-4
    c.optim.warmup_steps = 2000
    c.optim.weight_decay = 0.1
    c.optim.clip_norm = 1.0
    return c
