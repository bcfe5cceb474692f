"""Parameter counts and model FLOPs per token, from the config alone (nothing is allocated).

FLOPs follow Megatron-Core's `num_floating_point_operations` term by term, so our TFLOP/s compare with
NVIDIA's published tables: every GEMM counts 6 FLOPs per multiply-add (forward, weight grad, data grad);
SwiGLU counts 3 matrices; core attention counts only the causal half (QK^T and PV, seq/2 multiply-adds per
query element each); the router, norms, embedding lookup, recompute and padding are not counted; the LM
head is, once per MTP module too. Megatron's MLA term keeps two quirks we reproduce on purpose: the q/kv
down-projection norms count as one extra column (`rank * 1`), and each MTP module adds `3 * d_model` for its
three norms. With those, DeepSeek-V3 at sequence 4096 gives 249.81 GFLOP/token (259.99 with its MTP module).
MTP modules are counted as full MoE layers (attention + routed/shared experts), as Megatron does.
"""

from __future__ import annotations

from moejax.config.layers import layer_plan

FLOPS_PER_MAC_TRAIN = 6  # 2 FLOPs per multiply-add x 3 GEMMs (fwd, dgrad, wgrad)


def _kv_heads(m) -> int:
    return m.n_kv_heads or m.n_heads


def _attention_macs_per_token(m, seq_len: int) -> float:
    """Forward multiply-adds per token of one attention layer (projections + causal core)."""
    return sum(_attention_macs_split(m, seq_len))


def _attention_macs_split(m, seq_len: int) -> tuple[float, float]:
    """(projections, causal core) forward multiply-adds per token of one attention layer."""
    if m.attention == "mla":
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = m.q_lora_rank * (m.d_model + m.n_heads * qk_head + 1)
        else:
            q = m.d_model * m.n_heads * qk_head
        kv = (m.kv_lora_rank * (m.d_model + m.n_heads * (m.qk_nope_head_dim + m.v_head_dim) + 1)
              + m.d_model * m.qk_rope_head_dim)
        o = m.n_heads * m.v_head_dim * m.d_model
        core = seq_len * m.n_heads * qk_head / 2 + seq_len * m.n_heads * m.v_head_dim / 2
        return q + kv + o, core
    q_o = 2 * m.d_model * m.n_heads * m.head_dim
    k_v = 2 * m.d_model * _kv_heads(m) * m.head_dim
    core = seq_len * m.n_heads * m.head_dim / 2 * 2  # QK^T and PV, causal half each
    return q_o + k_v, core


def macs_per_token(cfg, seq_len: int) -> float:
    """Forward multiply-adds per token of one training sequence of length seq_len (MTP included)."""
    m, e = cfg.model, cfg.moe
    n_layers = m.n_layers + m.mtp_depth  # each MTP module runs one more (MoE) block
    n_dense = layer_plan(m).n_dense
    n_moe = n_layers - n_dense
    dense_ffn = 3 * m.d_model * m.d_ff
    moe_ffn = 3 * m.d_model * e.d_ff_expert * (e.top_k + e.n_shared_experts)
    mtp_extra = m.mtp_depth * (3 * m.d_model + 2 * m.d_model * m.d_model)  # norms (Megatron) + eh_proj
    heads = (1 + m.mtp_depth) * m.d_model * m.vocab_size
    return (n_layers * _attention_macs_per_token(m, seq_len) + n_dense * dense_ffn
            + n_moe * moe_ffn + mtp_extra + heads)


def _moe_layer_macs_per_token(m, e, seq_len: int) -> float:
    return _attention_macs_per_token(m, seq_len) + 3 * m.d_model * e.d_ff_expert * (e.top_k + e.n_shared_experts)


def pipelined_macs_fraction(cfg, seq_len: int) -> float:
    """The share of macs_per_token in the decoder's MoE layers: what pipeline stages split (mesh.stage > 1); the
    embedding, the dense layers, MTP and the heads run outside the pipeline."""
    m = cfg.model
    per_layer = _moe_layer_macs_per_token(m, cfg.moe, seq_len)
    return layer_plan(m).n_moe * per_layer / macs_per_token(cfg, seq_len)


def mtp_blocks_macs_fraction(cfg, seq_len: int) -> float:
    """The share of macs_per_token in the MTP modules' blocks and projections (not their heads): what pipeline stages
    split by micro-batch (their MoE statistics are per micro-batch pass)."""
    m = cfg.model
    per_module = _moe_layer_macs_per_token(m, cfg.moe, seq_len) + 2 * m.d_model * m.d_model
    return m.get("mtp_depth", 0) * per_module / macs_per_token(cfg, seq_len)


def fp8_macs_fraction(cfg, seq_len: int) -> float:
    """The share of macs_per_token that model.fp8 runs in FP8: the attention projections, dense / shared / routed
    FFNs and the MTP projection; not the attention core, the LM heads or the counted norms. 0 without FP8."""
    m, e = cfg.model, cfg.moe
    if m.get("fp8", "none") == "none":
        return 0.0
    n_layers, n_dense = m.n_layers + m.mtp_depth, layer_plan(m).n_dense
    proj, _ = _attention_macs_split(m, seq_len)
    fp8 = (n_layers * proj + n_dense * 3 * m.d_model * m.d_ff
           + (n_layers - n_dense) * 3 * m.d_model * e.d_ff_expert * (e.top_k + e.n_shared_experts)
           + m.mtp_depth * 2 * m.d_model * m.d_model)
    return fp8 / macs_per_token(cfg, seq_len)


def expert_ffn_macs_fractions(cfg, seq_len: int) -> tuple[float, float]:
    """(routed, shared): the shares of macs_per_token in the MoE layers' routed-expert GEMMs (what waits on the
    expert exchange) and their shared experts (what does not), MTP modules included."""
    m, e = cfg.model, cfg.moe
    n_moe = m.n_layers + m.get("mtp_depth", 0) - layer_plan(m).n_dense
    per_expert = n_moe * 3 * m.d_model * e.d_ff_expert / macs_per_token(cfg, seq_len)
    return per_expert * e.top_k, per_expert * e.n_shared_experts


def flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Model training FLOPs per token (Megatron-Core convention)."""
    return FLOPS_PER_MAC_TRAIN * macs_per_token(cfg, cfg.train.seq_len if seq_len is None else seq_len)


def attention_params(m) -> int:
    """Parameters of one attention sub-layer, its input norm included."""
    if m.attention == "mla":
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = m.d_model * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.n_heads * qk_head
        else:
            q = m.d_model * m.n_heads * qk_head
        kv = (m.d_model * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
              + m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim))
        o = m.n_heads * m.v_head_dim * m.d_model
        return q + kv + o + m.d_model
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    return (2 * m.d_model * m.n_heads * m.head_dim + 2 * m.d_model * _kv_heads(m) * m.head_dim + qk_norm
            + m.d_model)


def param_counts(cfg) -> dict[str, int]:
    """Parameter counts of the main model (`total`, `active` for one token: top-k routed experts instead of
    all) and of the MTP modules (`mtp`, `mtp_active`; they share the embedding and head). The router's
    selection bias is counted (it is in every checkpoint)."""
    m, e = cfg.model, cfg.moe
    plan = layer_plan(m)
    n_moe = plan.n_moe
    attn = attention_params(m)
    ffn_norm = m.d_model
    dense_ffn = 3 * m.d_model * m.d_ff + ffn_norm
    expert = 3 * m.d_model * e.d_ff_expert
    moe_common = expert * e.n_shared_experts + m.d_model * e.n_routed_experts + e.n_routed_experts + ffn_norm
    embed_head = 2 * m.vocab_size * m.d_model + m.d_model  # embedding, head, final norm
    common = m.n_layers * attn + plan.n_dense * dense_ffn + n_moe * moe_common + embed_head
    # An MTP module: enorm, hnorm, eh_proj [2D -> D], one block, its own norm before the shared head.
    mtp_is_moe = n_moe > 0  # the module's block is a MoE block when the decoder has MoE layers
    mtp_ffn_total = (moe_common + e.n_routed_experts * expert) if mtp_is_moe else dense_ffn
    mtp_ffn_active = (moe_common + e.top_k * expert) if mtp_is_moe else dense_ffn
    mtp_common = 3 * m.d_model + 2 * m.d_model * m.d_model + attn
    return {
        "total": int(common + n_moe * e.n_routed_experts * expert),
        "active": int(common + n_moe * e.top_k * expert),
        "mtp": int(m.mtp_depth * (mtp_common + mtp_ffn_total)),
        "mtp_active": int(m.mtp_depth * (mtp_common + mtp_ffn_active)),
    }


def accounting_report(cfg, seq_len: int | None = None) -> dict:
    """Everything above in one JSON-ready dict (what `moejax-plan --json` prints under `model`)."""
    seq = cfg.train.seq_len if seq_len is None else seq_len
    counts = param_counts(cfg)
    no_mtp = cfg.copy_and_resolve_references()
    with no_mtp.unlocked():
        no_mtp.model.mtp_depth = 0
    return {
        "params_total": counts["total"],
        "params_active": counts["active"],
        "params_mtp": counts["mtp"],
        "params_mtp_active": counts["mtp_active"],
        "seq_len": seq,
        "flops_per_token": flops_per_token(cfg, seq),
        "flops_per_token_without_mtp": flops_per_token(no_mtp, seq),
        "convention": "Megatron-Core num_floating_point_operations: 6 FLOPs per multiply-add, causal half of "
                      "core attention, SwiGLU = 3 GEMMs, LM head included, no recompute or padding",
    }
