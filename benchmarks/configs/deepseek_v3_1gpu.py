"""DeepSeek-V3 on one GPU: the whole training step (forward, backward, AdamW) at DeepSeek-V3's real widths, with
only the layer and expert counts cut so that the model, its f32 AdamW state and the activations fill one GPU. What
a step measures is the per-GPU work of the 671B model's layers: the same GEMM shapes (hidden 7168; MLA with 128
heads, q_lora 1536, kv_lora 512, nope/rope/v 128/64/128; expert FFN 2048 and one shared expert; the dense FFN
18432), the same router (sigmoid scores, 8 groups limited to 4, routed scaling 2.5, top-8, aux-loss-free bias),
the 129,280-token vocabulary and one MTP module, on 4,096-token sequences with full recompute, dropless.

    get_config("h200")   # default: 4 layers (first dense), 16 routed experts, 4 x 4096 tokens per step
    get_config("h100")   # 80 GB: 1 MoE layer (no dense one), 16 routed experts, 2 x 4096 tokens per step
    get_config("smoke")  # the same code paths at toy widths for a CPU (benchmarks/gpu_check.sh --smoke, CI)

Sizes are what `moejax-plan` computes for one GPU of that kind (16 bytes per parameter: f32 parameters, AdamW
moments and gradient, no accumulation; plus the remat'd activations), checked by XLA:GPU's compile of the step:

    moejax-plan --config benchmarks/configs/deepseek_v3_1gpu.py:h200 --topology hgx-h200 --gpus 1 --remat full

benchmarks/train_step.py prints the plan for the config it runs. Routing 8 of 16 experts gives each
expert more rows per step than 8 of 256 at EP32 (16,384 x 8 / 16 = 8,192 rows against the EP32 GPU's 1,024 per
expert per 4,096 tokens): the grouped GEMMs here are the better-shaped end of what a 671B rank runs."""

from pathlib import Path

from moejax.api import load_config

# variant -> (n_layers, first_k_dense, n_routed_experts, global_batch, seq_len)
VARIANTS = {"h200": (4, 1, 16, 4, 4096), "h100": (1, 0, 16, 2, 4096), "smoke": (3, 1, 8, 8, 64)}
FULL_MODEL = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3_671b.py"


def get_config(variant: str = "h200"):
    if variant not in VARIANTS:
        raise ValueError(f"deepseek_v3_1gpu: unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    n_layers, first_k_dense, n_experts, batch, seq = VARIANTS[variant]
    c = load_config(FULL_MODEL)  # every width, the router, MTP, dtypes, remat and optimizer as published
    m, e = c.model, c.moe
    m.n_layers, m.first_k_dense = n_layers, first_k_dense
    e.n_routed_experts = n_experts
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, 1, 1, 1  # one GPU
    c.train.global_batch, c.train.seq_len = batch, seq
    c.train.steps = 20
    if variant == "smoke":  # toy widths, same structure (MLA, groups, shared expert, MTP); f32 on a CPU
        m.vocab_size, m.d_model, m.d_ff, m.n_heads = 512, 64, 128, 4
        m.q_lora_rank, m.kv_lora_rank = 32, 16
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 16, 8, 16
        m.max_seq_len, m.dtype = seq, "float32"
        e.d_ff_expert = 32
        e.top_k = 4
    return c
