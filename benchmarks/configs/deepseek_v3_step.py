"""The DeepSeek-V3-shaped training step the dispatch benchmarks measure (benchmarks/train_step.py --dispatches):
MLA with q/kv low-rank (4 heads; q_lora 128, kv_lora 64, nope 64, rope 32, v 64), d_model 256, 4 layers with
the first dense (FFN 1024), 16 routed experts top-4 + 1 shared (FFN 512), sigmoid router with routed scaling
2.5, vocabulary 32,000, 16 x 256 tokens per step, full remat, on 8 emulated devices as expert=8."""

from moejax.config import cpu_run, default_config


def get_config():
    c = cpu_run(default_config(), steps=20)
    m, e = c.model, c.moe
    m.vocab_size = 32000
    m.d_model = 256
    m.n_layers = 4
    m.first_k_dense = 1
    m.d_ff = 1024
    m.attention = "mla"
    m.n_heads = 4
    m.q_lora_rank = 128
    m.kv_lora_rank = 64
    m.qk_nope_head_dim = 64
    m.qk_rope_head_dim = 32
    m.v_head_dim = 64
    m.remat = "full"
    e.n_routed_experts = 16
    e.n_shared_experts = 1
    e.top_k = 4
    e.d_ff_expert = 512
    e.score_func = "sigmoid"
    e.routed_scaling = 2.5
    e.dispatch = "dropless"
    c.train.global_batch, c.train.seq_len = 16, 256
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, 1, 8, 1
    return c
