"""CPU default: a small DeepSeek-style MoE (1 dense layer, then shared + 16 routed experts, top-4, sigmoid
router with aux-loss-free bias) on the embedded stdlib corpus, 8 emulated devices as data=2 x expert=4.
Finishes in a few minutes on 2 cores."""

from moejax.config import cpu_run, default_config


def get_config():
    c = cpu_run(default_config(), steps=250)
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.first_k_dense = 1
    c.model.n_heads = 4
    c.model.head_dim = 32
    c.model.d_ff = 512
    c.moe.n_routed_experts = 16
    c.moe.n_shared_experts = 1
    c.moe.top_k = 4
    c.moe.d_ff_expert = 128
    c.moe.bias_update_rate = 3e-2  # a 250-step run needs faster balancing than DeepSeek-V3's 1e-3
    return c
