"""Hugging Face config.json <-> moejax model config, for the three checkpoint formats we read and write:
`deepseek_v3` (MLA, shared experts, sigmoid group-limited router, MTP), `mixtral` (GQA, softmax top-k) and
`qwen3_moe` (GQA with q/k norm, softmax top-k, dense layers anywhere: `mlp_only_layers`, `decoder_sparse_step`,
read into model.first_k_dense and model.interleaved_dense_layers). Both transformers 4.x (`rope_theta`,
`rope_scaling`) and 5.x (`rope_parameters`) spellings are read. The HF `model_type` names a file format here, not a
code path in the model: the model is built from the resulting config fields alone.
"""

from __future__ import annotations

from moejax.config import ConfigError, default_config
from moejax.config.layers import dense_layer_fields, layer_plan

HF_FORMATS = ("deepseek_v3", "mixtral", "qwen3_moe")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either transformers spelling."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise ConfigError(f"config.json: RoPE scaling {kind!r} is not supported (only YaRN)")
    return float(theta), scaling


def _require(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise ConfigError(f"config.json has no {key!r}, which a {hf.get('model_type')} checkpoint needs")
    return hf[key]


def _qwen3_is_moe(n_layers: int, sparse_step: int, mlp_only_layers, n_experts: int) -> tuple[bool, ...]:
    """Per layer, whether transformers' Qwen3MoeDecoderLayer builds the sparse MoE block (else a dense MLP of
    intermediate_size): i not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    return tuple(i not in mlp_only_layers and n_experts > 0 and (i + 1) % sparse_step == 0 for i in range(n_layers))


def _qwen3_sparsity(is_moe: tuple[bool, ...]) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) that transformers builds this plan from: a step alone where one does,
    else step 1 with the dense layers listed."""
    for step in range(2, len(is_moe) + 1):
        if _qwen3_is_moe(len(is_moe), step, (), 1) == is_moe:
            return step, []
    return 1, [i for i, moe in enumerate(is_moe) if not moe]


def from_hf_config(hf: dict, base=None):
    """A moejax config (base's training fields, model/moe fields from the HF config; without a base, dropless
    dispatch: the imported model computes what transformers' does)."""
    fmt = hf.get("model_type")
    if fmt not in HF_FORMATS:
        raise ConfigError(f"config.json model_type={fmt!r} is not one of {', '.join(HF_FORMATS)}")
    if hf.get("tie_word_embeddings"):
        raise ConfigError("config.json: tied input/output embeddings are not supported")
    cfg = (base if base is not None else default_config()).copy_and_resolve_references()
    m, e = cfg.model, cfg.moe
    with cfg.unlocked():
        m.vocab_size = _require(hf, "vocab_size")
        m.d_model = _require(hf, "hidden_size")
        m.n_layers = _require(hf, "num_hidden_layers")
        m.n_heads = _require(hf, "num_attention_heads")
        m.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
        m.max_seq_len = int(hf.get("max_position_embeddings", m.max_seq_len))
        m.init_std = float(hf.get("initializer_range", m.init_std))
        m.interleaved_dense_layers = ""  # qwen3_moe's dense layers below; the other formats have only first-k
        theta, scaling = _rope(hf)
        m.rope_theta = theta
        m.rope_scaling = "yarn" if scaling else "none"
        if scaling:
            m.yarn.factor = float(scaling["factor"])
            m.yarn.original_max_position = int(scaling["original_max_position_embeddings"])
            m.yarn.beta_fast = float(scaling.get("beta_fast") or 32)
            m.yarn.beta_slow = float(scaling.get("beta_slow") or 1)
            m.yarn.mscale = float(scaling.get("mscale") or 0)
            m.yarn.mscale_all_dim = float(scaling.get("mscale_all_dim") or 0)
        if fmt == "deepseek_v3":
            m.attention = "mla"
            m.q_lora_rank = int(hf.get("q_lora_rank") or 0)
            for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                m[key] = int(_require(hf, key))
            m.rope_interleave = bool(hf.get("rope_interleave", True))
            m.first_k_dense = int(hf.get("first_k_dense_replace", 0))
            m.d_ff = _require(hf, "intermediate_size")
            m.mtp_depth = int(hf.get("num_nextn_predict_layers", 0) or 0)
            e.n_routed_experts = _require(hf, "n_routed_experts")
            e.n_shared_experts = int(hf.get("n_shared_experts") or 0)
            e.d_ff_expert = _require(hf, "moe_intermediate_size")
            e.score_func = hf.get("scoring_func", "sigmoid")
            e.n_groups = int(hf.get("n_group") or 1)
            e.topk_groups = int(hf.get("topk_group") or 1)
            e.routed_scaling = float(hf.get("routed_scaling_factor", 1.0))
            e.norm_topk_prob = bool(hf.get("norm_topk_prob", True))
        else:
            m.attention = "gqa"
            m.n_kv_heads = int(hf.get("num_key_value_heads") or m.n_heads)
            m.head_dim = int(hf.get("head_dim") or m.d_model // m.n_heads)
            m.qk_norm = fmt == "qwen3_moe"
            m.rope_interleave = False
            m.first_k_dense = 0
            m.mtp_depth = 0
            if hf.get("sliding_window") and hf.get("use_sliding_window", True):
                raise ConfigError("config.json: sliding-window attention is not supported")
            e.n_shared_experts = 0
            e.score_func = "softmax"
            e.n_groups = e.topk_groups = 1
            e.routed_scaling = 1.0
            if fmt == "mixtral":
                e.n_routed_experts = _require(hf, "num_local_experts")
                e.d_ff_expert = _require(hf, "intermediate_size")
                e.norm_topk_prob = True  # softmax over the top-k logits == renormalised top-k probabilities
            else:
                e.n_routed_experts = int(hf.get("num_experts") or _require(hf, "num_local_experts"))
                e.d_ff_expert = _require(hf, "moe_intermediate_size")
                e.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
                step = hf.get("decoder_sparse_step")
                step = 1 if step is None else int(step)
                if step < 1:
                    raise ConfigError(f"config.json: decoder_sparse_step={step} must be >= 1")
                mlp_only = {int(i) for i in hf.get("mlp_only_layers") or ()}
                is_moe = _qwen3_is_moe(m.n_layers, step, mlp_only, e.n_routed_experts)
                if not all(is_moe):  # dense layers: Qwen3MoeMLP(intermediate_size)
                    m.d_ff = _require(hf, "intermediate_size")
                    m.first_k_dense, m.interleaved_dense_layers = dense_layer_fields(is_moe)
        e.top_k = _require(hf, "num_experts_per_tok")
        if base is None:
            e.dispatch = "dropless"  # transformers' MoE blocks drop nothing: an imported model computes what they do
        if fmt == "mixtral" or fmt == "qwen3_moe":
            e.bias_update_rate = 0.0  # these routers have no selection bias to train or to export
    return cfg


def hf_format_of(cfg) -> str:
    """Which HF format holds this model; raises ConfigError when none does."""
    m, e = cfg.model, cfg.moe
    plan = layer_plan(m)

    def need(condition, what):
        if not condition:
            raise ConfigError(f"no Hugging Face format holds this model: {what}")

    if m.attention == "mla":
        need(e.score_func == "sigmoid", "deepseek_v3 routers score with a sigmoid")
        need(plan.n_moe > 0, "deepseek_v3 needs at least one MoE layer")
        need(plan.dense_first, "deepseek_v3's dense layers are its first layers (first_k_dense_replace), "
                               "not model.interleaved_dense_layers")
        return "deepseek_v3"
    need(m.mtp_depth == 0, "mixtral/qwen3_moe have no MTP")
    need(e.n_shared_experts == 0, "mixtral/qwen3_moe have no shared experts")
    need(e.score_func == "softmax" and e.n_groups == 1 and e.routed_scaling == 1.0,
         "mixtral/qwen3_moe route by plain softmax top-k")
    if m.qk_norm:
        return "qwen3_moe"
    need(plan.n_dense == 0, "mixtral has no dense layers")
    need(e.norm_topk_prob, "mixtral renormalises the top-k weights")
    return "mixtral"


def to_hf_config(cfg) -> dict:
    m, e = cfg.model, cfg.moe
    fmt = hf_format_of(cfg)
    plan = layer_plan(m)
    hf = {
        "model_type": fmt, "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "rms_norm_eps": m.norm_eps,
        "max_position_embeddings": m.max_seq_len, "num_experts_per_tok": e.top_k, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "initializer_range": m.init_std, "torch_dtype": "float32",
    }
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        y = m.yarn
        rope.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_position,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta + rope_scaling.
    hf["rope_parameters"] = dict(rope)
    hf["rope_theta"] = m.rope_theta
    hf["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_theta"}, "type": "yarn"} \
        if m.rope_scaling == "yarn" else None
    if fmt == "deepseek_v3":
        hf.update(
            architectures=["DeepseekV3ForCausalLM"], q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
            num_key_value_heads=m.n_heads, rope_interleave=m.rope_interleave, first_k_dense_replace=plan.n_dense,
            intermediate_size=m.d_ff, moe_intermediate_size=e.d_ff_expert, n_routed_experts=e.n_routed_experts,
            n_shared_experts=e.n_shared_experts, n_group=e.n_groups, topk_group=e.topk_groups,
            routed_scaling_factor=e.routed_scaling, norm_topk_prob=e.norm_topk_prob, scoring_func="sigmoid",
            topk_method="noaux_tc", num_nextn_predict_layers=m.mtp_depth,
        )
    else:
        hf.update(num_key_value_heads=m.n_kv_heads or m.n_heads, head_dim=m.head_dim, sliding_window=None)
        if fmt == "mixtral":
            hf.update(architectures=["MixtralForCausalLM"], num_local_experts=e.n_routed_experts,
                      intermediate_size=e.d_ff_expert)
        else:
            step, mlp_only = _qwen3_sparsity(plan.is_moe)
            # intermediate_size: the dense layers' width; without any, the total of the active experts
            hf.update(architectures=["Qwen3MoeForCausalLM"], num_experts=e.n_routed_experts,
                      moe_intermediate_size=e.d_ff_expert,
                      intermediate_size=m.d_ff if plan.n_dense else e.d_ff_expert * e.top_k,
                      norm_topk_prob=e.norm_topk_prob, decoder_sparse_step=step, mlp_only_layers=mlp_only,
                      use_sliding_window=False)
    return hf
