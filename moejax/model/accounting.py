"""Parameter counts and model FLOPs per token, from the config alone (nothing is allocated).

FLOPs follow Megatron-Core's `num_floating_point_operations`, so our TFLOP/s compare with NVIDIA's tables:
every GEMM counts 6 FLOPs per multiply-add (forward, weight grad, data grad); SwiGLU counts 3 matrices;
core attention counts only the causal half (QK^T and PV each seq/2 multiply-adds per query element); the
router, norms, embedding lookup, recompute and padding are not counted; the LM head is.
"""

from __future__ import annotations

FLOPS_PER_MAC_TRAIN = 6  # 2 FLOPs per multiply-add x 3 GEMMs (fwd, dgrad, wgrad)


def _attention_macs_per_token(m, seq_len: int) -> float:
    qkv_o = 4 * m.d_model * m.n_heads * m.head_dim  # q, k, v and o projections (MHA)
    core = seq_len * m.n_heads * m.head_dim / 2 * 2  # QK^T and PV, causal half each
    return qkv_o + core


def macs_per_token(cfg, seq_len: int) -> float:
    """Forward multiply-adds per token of one training sequence of length seq_len."""
    m, e = cfg.model, cfg.moe
    n_moe = m.n_layers - m.first_k_dense
    dense_ffn = 3 * m.d_model * m.d_ff
    moe_ffn = 3 * m.d_model * e.d_ff_expert * (e.top_k + e.n_shared_experts)
    head = m.d_model * m.vocab_size
    return (m.n_layers * _attention_macs_per_token(m, seq_len) + m.first_k_dense * dense_ffn
            + n_moe * moe_ffn + head)


def flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Model training FLOPs per token (Megatron-Core convention)."""
    return FLOPS_PER_MAC_TRAIN * macs_per_token(cfg, cfg.train.seq_len if seq_len is None else seq_len)


def param_counts(cfg) -> dict[str, int]:
    """Total parameters, and those active for one token (top-k routed experts instead of all)."""
    m, e = cfg.model, cfg.moe
    n_moe = m.n_layers - m.first_k_dense
    attn = 4 * m.d_model * m.n_heads * m.head_dim + 2 * m.d_model  # projections + two norms
    dense_ffn = 3 * m.d_model * m.d_ff
    expert = 3 * m.d_model * e.d_ff_expert
    shared = expert * e.n_shared_experts
    router = m.d_model * e.n_routed_experts
    embed_head = 2 * m.vocab_size * m.d_model + m.d_model  # embedding, head, final norm
    common = m.n_layers * attn + m.first_k_dense * dense_ffn + n_moe * (shared + router) + embed_head
    return {
        "total": int(common + n_moe * e.n_routed_experts * expert),
        "active": int(common + n_moe * e.top_k * expert),
    }
