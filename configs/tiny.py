"""CPU default: a small DeepSeek-style MoE (1 dense layer, then shared + 16 routed experts, top-4, sigmoid
router with aux-loss-free bias) on the embedded stdlib corpus, 8 emulated devices as data=2 x expert=4.
Finishes in a few minutes on 2 cores."""

from moejax.config import default_config


def get_config():
    c = default_config()
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.first_k_dense = 1
    c.model.n_heads = 4
    c.model.head_dim = 32
    c.model.d_ff = 512
    c.model.remat = "none"
    c.moe.n_routed_experts = 16
    c.moe.n_shared_experts = 1
    c.moe.top_k = 4
    c.moe.d_ff_expert = 128
    c.moe.capacity_factor = 1.25
    c.mesh.data = -1
    c.mesh.expert = 4
    c.train.steps = 250
    c.train.global_batch = 16
    c.train.seq_len = 128
    c.train.log_every = 10
    c.train.expert_load_every = 10
    c.train.eval_every = 50
    c.optim.lr = 4e-3
    c.optim.warmup_steps = 20
    c.moe.bias_update_rate = 3e-2  # a 250-step run needs faster balancing than DeepSeek-V3's 1e-3
    return c
