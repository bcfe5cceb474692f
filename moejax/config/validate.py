"""Validation of a config on its own: every field's type, range and the relations between fields, before
anything compiles. Pure: no file, device or data is looked at.

The range of every numeric field is one table in `moejax.config.ranges`, checked first; this module adds
the choices of the string fields and the relations between fields.

Checks that need facts living elsewhere (the data's vocabulary and files, the known topologies, a weights
directory) live beside those facts and are composed with this one by the entry points (`moejax.api`).
`validate` raises `ConfigError` with one sentence saying what is wrong and what to change.
"""

from __future__ import annotations

import math

from moejax.config.layers import check_pipeline_layers, layer_plan, pipeline_in_flight
from moejax.config.ranges import check_choice, check_ranges
from moejax.config.schema import (ATTENTION_KERNELS, ATTENTION_KINDS, DISPATCH_MODES, DROP_POLICIES, DTYPES,
                                  EXPERT_GEMM_KERNELS, FP8_FORMATS, LOSS_KERNELS, MESH_AXES, ON_BAD_CHECKPOINT,
                                  OPTIMIZER_STATE_SHARDINGS, PIPELINE_SCHEDULES, REMAT_POLICIES, ROPE_SCALINGS, SCORE_FUNCS, WANDB_MODES,
                                  ConfigError)


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


def _validate_attention(m):
    if m.attention == "gqa":
        kv = m.n_kv_heads or m.n_heads
        if m.n_heads % kv:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    else:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(m[name]) <= 0:
                raise ConfigError(f"model.{name}={m[name]} must be positive for model.attention='mla'")
    rope_dim = m.qk_rope_head_dim if m.attention == "mla" else m.head_dim
    if rope_dim % 2:
        raise ConfigError(f"the RoPE dimension ({rope_dim}) must be even")


def validate(cfg, n_devices: int) -> dict[str, int]:
    """Checks everything a user can get wrong before compile; returns the resolved mesh shape."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    check_ranges(cfg)
    sizes = resolve_mesh_shape(cfg.mesh, n_devices)
    for name in ("dtype", "param_dtype"):
        if m[name] == "float16":
            raise ConfigError(f"model.{name}='float16' needs loss scaling, which moejax does not do; use "
                              "'bfloat16' (same speed on GPUs since Ampere, float32's exponent range)")
        check_choice(f"model.{name}", m[name], DTYPES)
    check_choice("model.remat", m.remat, REMAT_POLICIES)
    check_choice("optim.state_sharding", cfg.optim.get("state_sharding", "params"), OPTIMIZER_STATE_SHARDINGS)
    if cfg.optim.get("master_weights", False) and m.param_dtype == "float32":
        raise ConfigError("optim.master_weights keeps f32 copies of narrower weights, but model.param_dtype is "
                          "'float32': set model.param_dtype='bfloat16' with it, or leave master_weights off")
    check_choice("checkpoint.on_bad_checkpoint", cfg.checkpoint.get("on_bad_checkpoint", "fall_back"),
                 ON_BAD_CHECKPOINT)
    ck = cfg.checkpoint
    if bool(ck.get("local_dir", "")) != (ck.get("local_every_steps", 0) > 0):
        raise ConfigError("checkpoint.local_dir and checkpoint.local_every_steps go together: give a node-local "
                          f"directory and a step interval for the local tier, or neither (local_dir={ck.get('local_dir', '')!r}, "
                          f"local_every_steps={ck.get('local_every_steps', 0)})")
    check_choice("model.attention", m.attention, ATTENTION_KINDS)
    check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    _validate_attention(m)
    check_choice("moe.score_func", e.score_func, SCORE_FUNCS)
    check_choice("moe.dispatch", e.dispatch, DISPATCH_MODES)
    check_choice("mesh.pipeline_schedule", cfg.mesh.get("pipeline_schedule", "circular"), PIPELINE_SCHEDULES)
    check_choice("moe.drop_policy", e.drop_policy, DROP_POLICIES)
    if e.get("exchange_chunks", 0) > 1 and e.dispatch == "allgather":
        raise ConfigError(f"moe.exchange_chunks={e.exchange_chunks} splits the all-to-all of capacity and dropless "
                          "dispatch; allgather has no all-to-all to split: use 0 (auto) or 1")
    check_choice("model.grad_reduce_dtype", m.grad_reduce_dtype, DTYPES)
    check_choice("model.fp8", m.fp8, FP8_FORMATS)
    k = cfg.kernels
    check_choice("kernels.attention", k.attention, ATTENTION_KERNELS)
    check_choice("kernels.expert_gemm", k.expert_gemm, EXPERT_GEMM_KERNELS)
    check_choice("kernels.loss", k.loss, LOSS_KERNELS)
    if m.first_k_dense > m.n_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} must lie in [0, model.n_layers={m.n_layers}]")
    n_moe_layers = layer_plan(m).n_moe  # also parses model.interleaved_dense_layers
    if n_moe_layers and e.n_routed_experts <= 0:
        raise ConfigError("moe.n_routed_experts must be positive when there are MoE layers")
    if e.top_k > e.n_routed_experts:
        raise ConfigError(f"moe.top_k={e.top_k} exceeds moe.n_routed_experts={e.n_routed_experts}")
    if e.n_routed_experts % e.n_groups:
        raise ConfigError(f"moe.n_routed_experts={e.n_routed_experts} does not divide into moe.n_groups={e.n_groups}")
    if e.topk_groups > e.n_groups:
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
    if t.global_batch % (batch_shards * t.micro_batches):
        raise ConfigError(
            f"train.micro_batches={t.micro_batches} must divide the per-device batch: "
            f"train.global_batch={t.global_batch} / batch-parallel size {batch_shards}"
        )
    _validate_pipeline(cfg, sizes, n_moe_layers)
    if sizes["context"] > 1 and t.seq_len % (2 * sizes["context"]):
        raise ConfigError(
            f"train.seq_len={t.seq_len} does not split into 2 x mesh.context = {2 * sizes['context']} equal pieces "
            f"(each context shard holds a front and a back piece); use a sequence length that divides by "
            f"{2 * sizes['context']} or another mesh.context")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    try:
        [int(x) for x in str(cfg.guards.inject_nan_steps).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"guards.inject_nan_steps={cfg.guards.inject_nan_steps!r} is not a comma-separated list "
                          "of steps") from None
    _validate_wandb(cfg)
    return sizes


def _validate_wandb(cfg):
    """observability.wandb's mode; whether wandb is installed is a fact of the environment, checked by the entry
    points (moejax.training.wandb_logger.check_wandb_installed). A config saved before the group existed (an
    older checkpoint loaded for inference) has none: nothing to check."""
    wandb = cfg.get("observability", {}).get("wandb")
    if wandb is not None:
        check_choice("observability.wandb.mode", wandb.mode, WANDB_MODES)


def _validate_pipeline(cfg, sizes: dict[str, int], n_moe_layers: int):
    """Pipeline stages split the MoE layers into stage x virtual-stage chunks of ceil(L / chunks) layer slots, each
    holding one layer at least (the dense layers and embedding run before the pipeline, MTP and the head after it),
    and need a micro-batch per stage at least."""
    stages, virtual, micro = sizes["stage"], int(cfg.mesh.virtual_stages), int(cfg.train.micro_batches)
    if int(cfg.mesh.stage) == -1:
        raise ConfigError("mesh.stage=-1: set the pipeline stage count explicitly (the layer split depends on it)")
    if stages == 1:
        if virtual > 1:
            raise ConfigError(f"mesh.virtual_stages={virtual} needs pipeline stages: set mesh.stage > 1")
        return
    if not n_moe_layers:
        raise ConfigError(f"mesh.stage={stages}: pipeline stages split the MoE layers and this model has none")
    check_pipeline_layers(cfg.model, stages)
    chunks = stages * virtual
    if n_moe_layers < chunks:
        raise ConfigError(
            f"mesh.stage={stages} x mesh.virtual_stages={virtual} = {chunks} chunks are more than the "
            f"{n_moe_layers} MoE layers (model.n_layers={cfg.model.n_layers} less the dense layers, which run "
            f"before the pipeline, MTP after it): every chunk needs "
            f"a layer; use stages x virtual stages <= {n_moe_layers}")
    if micro < stages:
        raise ConfigError(f"train.micro_batches={micro} is fewer than mesh.stage={stages}: every stage needs a "
                          f"micro-batch in flight; set train.micro_batches >= {stages} (bubble (S-1)/(M x V))")
    in_flight = pipeline_in_flight(cfg)
    if in_flight < stages or micro % in_flight:
        raise ConfigError(f"mesh.pipeline_in_flight={cfg.mesh.pipeline_in_flight} must be 0 (all) or at least "
                          f"mesh.stage={stages} and divide train.micro_batches={micro}")
    rows_split = stages * sizes["data"] * sizes["fsdp"] * sizes["expert"] * (micro // in_flight)
    if int(cfg.train.global_batch) % rows_split:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by stage*data*fsdp*expert x passes "
            f"(train.micro_batches / mesh.pipeline_in_flight)={rows_split}: outside the pipeline stages (embedding, "
            f"dense layers, head, loss) the rows of each pass are split over the stages too; use a global batch that "
            f"is a multiple of {rows_split}")
