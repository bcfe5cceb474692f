"""Validation of a config on its own: every field's type, range and the relations between fields, before
anything compiles. Pure: no file, device or data is looked at.

Checks that need facts living elsewhere (the data's vocabulary and files, the known topologies, a weights
directory) live beside those facts and are composed with this one by the entry points (`moejax.api`).
`validate` raises `ConfigError` with one sentence saying what is wrong and what to change.
"""

from __future__ import annotations

import math

from moejax.config.schema import (ATTENTION_KERNELS, ATTENTION_KINDS, DISPATCH_MODES, DROP_POLICIES, DTYPES,
                                  EXPERT_GEMM_KERNELS, FP8_FORMATS, LOSS_KERNELS, MESH_AXES, REMAT_POLICIES, ROPE_SCALINGS,
                                  SCORE_FUNCS, ConfigError)


def resolve_mesh_shape(mesh_cfg, n_devices: int) -> dict[str, int]:
    """Sizes of every mesh axis, with the single -1 axis filled in."""
    sizes = {a: int(mesh_cfg[a]) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {', '.join(free)}")
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ConfigError(f"mesh.{a}={s}: axis sizes must be positive (or -1 for the rest)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh: {n_devices} devices do not divide by the fixed axes' product {fixed} "
                f"({_fmt(sizes)})"
            )
        sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(
            f"mesh: axis sizes multiply to {fixed} ({_fmt(sizes)}) but there are {n_devices} devices; "
            "make the product equal the device count or set one axis to -1"
        )
    return sizes


def _fmt(sizes):
    return " x ".join(f"{a}={s}" for a, s in sizes.items())


def _check_choice(name, value, choices):
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def _validate_attention(m):
    if m.attention == "gqa":
        kv = m.n_kv_heads or m.n_heads
        if kv <= 0 or m.n_heads % kv:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    else:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(m[name]) <= 0:
                raise ConfigError(f"model.{name}={m[name]} must be positive for model.attention='mla'")
        if m.q_lora_rank < 0:
            raise ConfigError(f"model.q_lora_rank={m.q_lora_rank} must be >= 0 (0: full-rank queries)")
    rope_dim = m.qk_rope_head_dim if m.attention == "mla" else m.head_dim
    if rope_dim % 2:
        raise ConfigError(f"the RoPE dimension ({rope_dim}) must be even")
    if m.rope_scaling == "yarn" and (m.yarn.factor < 1 or m.yarn.original_max_position <= 0):
        raise ConfigError("model.yarn.factor must be >= 1 and model.yarn.original_max_position positive")
    if m.mtp_depth < 0 or m.mtp_loss_weight < 0:
        raise ConfigError("model.mtp_depth and model.mtp_loss_weight must be >= 0")


def validate(cfg, n_devices: int) -> dict[str, int]:
    """Checks everything a user can get wrong before compile; returns the resolved mesh shape."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    sizes = resolve_mesh_shape(cfg.mesh, n_devices)
    for name in ("dtype", "param_dtype"):
        if m[name] == "float16":
            raise ConfigError(f"model.{name}='float16' needs loss scaling, which moejax does not do; use "
                              "'bfloat16' (same speed on GPUs since Ampere, float32's exponent range)")
        _check_choice(f"model.{name}", m[name], DTYPES)
    _check_choice("model.remat", m.remat, REMAT_POLICIES)
    _check_choice("model.attention", m.attention, ATTENTION_KINDS)
    _check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    _validate_attention(m)
    _check_choice("moe.score_func", e.score_func, SCORE_FUNCS)
    _check_choice("moe.dispatch", e.dispatch, DISPATCH_MODES)
    _check_choice("moe.drop_policy", e.drop_policy, DROP_POLICIES)
    if not float(e.dropless_window) > 0:
        raise ConfigError(f"moe.dropless_window={e.dropless_window} must be > 0 (rows received per dropless round, "
                          "x the balanced load; larger loads run more rounds, nothing is dropped)")
    _check_choice("model.grad_reduce_dtype", m.grad_reduce_dtype, DTYPES)
    _check_choice("model.fp8", m.fp8, FP8_FORMATS)
    k = cfg.kernels
    _check_choice("kernels.attention", k.attention, ATTENTION_KERNELS)
    _check_choice("kernels.expert_gemm", k.expert_gemm, EXPERT_GEMM_KERNELS)
    _check_choice("kernels.loss", k.loss, LOSS_KERNELS)
    if int(k.loss_chunk) <= 0:
        raise ConfigError(f"kernels.loss_chunk={k.loss_chunk} must be positive (sequence positions per chunk)")
    if cfg.mesh.domain_size < 0:
        raise ConfigError(f"mesh.domain_size={cfg.mesh.domain_size} must be >= 0 (0: from the devices)")
    positive = {
        "model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads, "model.head_dim": m.head_dim, "model.d_ff": m.d_ff,
        "moe.top_k": e.top_k, "moe.d_ff_expert": e.d_ff_expert, "train.steps": t.steps,
        "train.global_batch": t.global_batch, "train.seq_len": t.seq_len, "train.log_every": t.log_every,
    }
    for name, v in positive.items():
        if int(v) <= 0:
            raise ConfigError(f"{name}={v} must be positive")
    if not 0 <= m.first_k_dense <= m.n_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} must lie in [0, model.n_layers={m.n_layers}]")
    n_moe_layers = m.n_layers - m.first_k_dense
    if n_moe_layers and e.n_routed_experts <= 0:
        raise ConfigError("moe.n_routed_experts must be positive when there are MoE layers")
    if e.top_k > e.n_routed_experts:
        raise ConfigError(f"moe.top_k={e.top_k} exceeds moe.n_routed_experts={e.n_routed_experts}")
    if e.n_routed_experts % e.n_groups:
        raise ConfigError(f"moe.n_routed_experts={e.n_routed_experts} does not divide into moe.n_groups={e.n_groups}")
    if not 1 <= e.topk_groups <= e.n_groups:
        raise ConfigError(f"moe.topk_groups={e.topk_groups} must lie in [1, moe.n_groups={e.n_groups}]")
    if e.topk_groups * (e.n_routed_experts // e.n_groups) < e.top_k:
        raise ConfigError("moe.top_k exceeds the experts inside moe.topk_groups groups")
    if n_moe_layers and e.n_routed_experts % sizes["expert"]:
        raise ConfigError(
            f"moe.n_routed_experts={e.n_routed_experts} is not divisible by the expert axis "
            f"(mesh.expert={sizes['expert']}); pick an expert-parallel size that divides it"
        )
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if t.global_batch % batch_shards:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by the batch-parallel size "
            f"data*fsdp*expert={batch_shards}"
        )
    if t.micro_batches < 1 or t.global_batch % (batch_shards * t.micro_batches):
        raise ConfigError(
            f"train.micro_batches={t.micro_batches} must be >= 1 and divide the per-device batch: "
            f"train.global_batch={t.global_batch} / batch-parallel size {batch_shards}"
        )
    _validate_pipeline(cfg, sizes, n_moe_layers)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    _validate_run_guards(cfg)
    if cfg.profile.start_step >= 0 and cfg.profile.num_steps <= 0:
        raise ConfigError("profile.num_steps must be positive when profile.start_step is set")
    if cfg.hardware.peak_tflops < 0:
        raise ConfigError("hardware.peak_tflops must be >= 0 (0 means look up or measure)")
    return sizes


def _validate_pipeline(cfg, sizes: dict[str, int], n_moe_layers: int):
    """Pipeline stages split the MoE layers into stage x virtual-stage chunks of ceil(L / chunks) layer slots, each
    holding one layer at least (the dense layers and embedding run before the pipeline, MTP and the head after it),
    and need a micro-batch per stage at least."""
    stages, virtual, micro = sizes["stage"], int(cfg.mesh.virtual_stages), int(cfg.train.micro_batches)
    if int(cfg.mesh.stage) == -1:
        raise ConfigError("mesh.stage=-1: set the pipeline stage count explicitly (the layer split depends on it)")
    if virtual < 1:
        raise ConfigError(f"mesh.virtual_stages={virtual} must be >= 1")
    if stages == 1:
        if virtual > 1:
            raise ConfigError(f"mesh.virtual_stages={virtual} needs pipeline stages: set mesh.stage > 1")
        return
    if not n_moe_layers:
        raise ConfigError(f"mesh.stage={stages}: pipeline stages split the MoE layers and this model has none")
    chunks = stages * virtual
    if n_moe_layers < chunks:
        raise ConfigError(
            f"mesh.stage={stages} x mesh.virtual_stages={virtual} = {chunks} chunks are more than the "
            f"{n_moe_layers} MoE layers (model.n_layers={cfg.model.n_layers} - model.first_k_dense="
            f"{cfg.model.first_k_dense}; the dense layers run before the pipeline, MTP after it): every chunk needs "
            f"a layer; use stages x virtual stages <= {n_moe_layers}")
    if micro < stages:
        raise ConfigError(f"train.micro_batches={micro} is fewer than mesh.stage={stages}: every stage needs a "
                          f"micro-batch in flight; set train.micro_batches >= {stages} (bubble (S-1)/(M x V))")
    rows_split = stages * sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if int(cfg.train.global_batch) % rows_split:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by stage*data*fsdp*expert={rows_split}: "
            f"outside the pipeline stages (embedding, dense layers, head, loss) the rows are split over the stages "
            f"too; use a global batch that is a multiple of {rows_split}")


def _validate_run_guards(cfg):
    """Checkpoint and guard settings make sense."""
    ck, g = cfg.checkpoint, cfg.guards
    for name, v in (("checkpoint.every_steps", ck.every_steps), ("checkpoint.every_minutes", ck.every_minutes),
                    ("checkpoint.keep_every_steps", ck.keep_every_steps), ("guards.step_timeout_s", g.step_timeout_s)):
        if v < 0:
            raise ConfigError(f"{name}={v} must be >= 0 (0 turns it off)")
    if ck.keep < 1:
        raise ConfigError(f"checkpoint.keep={ck.keep} must be at least 1")
    if g.max_bad_steps < 1:
        raise ConfigError(f"guards.max_bad_steps={g.max_bad_steps} must be at least 1")
    try:
        [int(x) for x in str(g.inject_nan_steps).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"guards.inject_nan_steps={g.inject_nan_steps!r} is not a comma-separated list of steps") from None
