"""The config schema: defaults for every field, and validation that runs before anything compiles.

Config files in `configs/` start from `default_config()` and override fields. `validate(cfg, n_devices)`
raises `ConfigError` with one sentence saying what is wrong and what to change; the CLI turns that into
exit code 2 without touching the workdir.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_collections

from moejax.data.corpus import BYTE_VOCAB

MESH_AXES = ("data", "fsdp", "expert", "tensor")
DTYPES = ("float32", "bfloat16", "float16")
SCORE_FUNCS = ("sigmoid", "softmax")
DISPATCH_MODES = ("capacity", "allgather", "dropless")
DROP_POLICIES = ("position", "probability")
GMM_BACKENDS = ("auto", "einsum", "ragged_dot")
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_KINDS = ("gqa", "mla")  # gqa covers MHA (n_kv_heads == n_heads); mla is DeepSeek's latent attention
ROPE_SCALINGS = ("none", "yarn")


class ConfigError(ValueError):
    """A configuration or input the run cannot use; the message is shown to the user as is."""


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = m = ml_collections.ConfigDict()
    m.vocab_size = 264  # 256 bytes + specials, padded to a multiple of 8
    m.d_model = 128
    m.n_layers = 4
    m.first_k_dense = 1  # DeepSeek-style: the first k layers use a dense FFN
    m.attention = "gqa"
    m.n_heads = 4
    m.n_kv_heads = 0  # gqa: key/value heads; 0 means n_heads (plain multi-head attention)
    m.head_dim = 32
    m.qk_norm = False  # gqa: RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # mla (DeepSeek-V2/V3): q through a low-rank bottleneck with a norm (q_lora_rank 0: full-rank q),
    # k/v from one compressed latent with a norm, and a decoupled RoPE key shared by all heads.
    m.q_lora_rank = 0
    m.kv_lora_rank = 0
    m.qk_nope_head_dim = 0
    m.qk_rope_head_dim = 0
    m.v_head_dim = 0
    m.d_ff = 512  # dense-layer FFN width
    m.rope_theta = 10000.0
    m.rope_interleave = False  # rotate pairs (2i, 2i+1) (DeepSeek checkpoints) instead of (i, i + K/2)
    m.rope_scaling = "none"
    m.yarn = y = ml_collections.ConfigDict()
    y.factor = 1.0
    y.original_max_position = 4096
    y.beta_fast = 32.0
    y.beta_slow = 1.0
    y.mscale = 1.0
    y.mscale_all_dim = 0.0
    m.mtp_depth = 0  # multi-token prediction modules (DeepSeek-V3: 1)
    m.mtp_loss_weight = 0.3
    m.norm_eps = 1e-6
    m.max_seq_len = 4096
    m.dtype = "float32"  # compute dtype; params stay in param_dtype
    m.param_dtype = "float32"
    m.remat = "full"
    m.init_std = 0.02

    c.moe = e = ml_collections.ConfigDict()
    e.n_routed_experts = 16
    e.n_shared_experts = 1
    e.top_k = 4
    e.d_ff_expert = 128
    e.score_func = "sigmoid"
    e.n_groups = 1  # group-limited routing (DeepSeek-V3: 8 groups, top-4 groups)
    e.topk_groups = 1
    e.routed_scaling = 1.0
    e.norm_topk_prob = True
    e.dispatch = "capacity"  # capacity: all-to-all of capacity-padded buffers; allgather: gather + reduce-scatter
    e.drop_policy = "position"  # over capacity, drop the latest tokens (position) or the lowest-weight ones
    e.backend = "auto"
    e.capacity_factor = 2.0  # <= 0 means worst case: no token is ever dropped
    e.dropless_recv_factor = 0.0  # dropless receive buffer: <= 0 worst case, else x the balanced load
    e.seq_aux_loss_coef = 1e-4  # DeepSeek-V3 sequence-wise balance loss (alpha)
    e.batch_aux_loss_coef = 0.0  # the same balance loss over the whole global batch (Switch/GShard style)
    e.z_loss_coef = 0.0
    e.bias_update_rate = 1e-3  # aux-loss-free balancing; 0 disables it

    c.mesh = ms = ml_collections.ConfigDict()
    ms.data = -1  # -1: whatever the other axes leave
    ms.fsdp = 1
    ms.expert = 1
    ms.tensor = 1
    ms.topology = "auto"  # NVLink layout (moejax/parallel/topology.py): auto = from the device kind
    ms.domain_size = 0  # devices per NVLink domain; 0: device.slice_index or the topology's (72 on NVL72)
    ms.allow_cross_domain_experts = False  # True: let an expert group span two domains (all-to-all over NICs)

    c.train = t = ml_collections.ConfigDict()
    t.steps = 1000
    t.global_batch = 32
    t.micro_batches = 1  # gradient accumulation: each step runs global_batch / micro_batches rows at a time
    t.seq_len = 256
    t.log_every = 10
    t.eval_every = 100
    t.eval_batches = 4
    t.expert_load_every = 100  # write the full tokens-per-expert matrix (layers x experts) every N steps

    c.optim = o = ml_collections.ConfigDict()
    o.lr = 3e-3
    o.min_lr_ratio = 0.1
    o.warmup_steps = 50
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.weight_decay = 0.1
    o.clip_norm = 1.0

    c.checkpoint = ck = ml_collections.ConfigDict()
    ck.every_steps = 0  # 0: only at the end of the run (and on SIGTERM/SIGINT)
    ck.every_minutes = 0.0  # also save when this much wall time passed since the last save; 0: off
    ck.keep = 2  # the latest K checkpoints are kept...
    ck.keep_every_steps = 0  # ...plus, permanently, every one whose step is a multiple of this; 0: none
    ck.init_from = ""  # a weights directory (moejax-convert import) to start step 0 from; "": random init

    c.data = d = ml_collections.ConfigDict()
    # 'stdlib': the Python standard library's own sources, found at run time; or 'DIR[:WEIGHT],...':
    # token directories written by `moejax-data tokenize`, mixed in proportion to their weights.
    d.corpus = "stdlib"
    d.max_bytes = 16_000_000  # stdlib only
    d.eval_every_nth_file = 20  # stdlib only
    d.verify_checksums = True  # CRC32 of every token file at start (one read of the data)

    c.guards = g = ml_collections.ConfigDict()
    g.max_bad_steps = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    g.step_timeout_s = 1800.0  # watchdog: no step finished for this long -> dump stacks, exit 5; 0: off
    g.inject_nan_steps = ""  # testing the guards: comma-separated steps whose loss is made NaN

    c.profile = pr = ml_collections.ConfigDict()
    pr.start_step = -1  # >= 0: trace steps [start_step, start_step + num_steps) into WORKDIR/profile
    pr.num_steps = 3

    c.hardware = h = ml_collections.ConfigDict()
    h.peak_tflops = 0.0  # per device; 0: look up the GPU, or measure on CPU
    return c


def cpu_run(c: ml_collections.ConfigDict, *, steps: int) -> ml_collections.ConfigDict:
    """The run settings every CPU-size config shares: 8 emulated devices as data x expert=4, 16 x 128-token
    batches, logging every 10 steps, a short warmup and a higher learning rate for a few hundred steps."""
    c.mesh.data, c.mesh.expert = -1, 4
    c.train.steps, c.train.global_batch, c.train.seq_len = steps, 16, 128
    c.train.log_every, c.train.expert_load_every, c.train.eval_every = 10, 10, 50
    c.optim.lr, c.optim.warmup_steps = 4e-3, 20
    c.model.remat = "none"
    c.moe.capacity_factor = 1.25
    return c


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
        _check_choice(f"model.{name}", m[name], DTYPES)
    _check_choice("model.remat", m.remat, REMAT_POLICIES)
    _check_choice("model.attention", m.attention, ATTENTION_KINDS)
    _check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    _validate_attention(m)
    _check_choice("moe.score_func", e.score_func, SCORE_FUNCS)
    _check_choice("moe.dispatch", e.dispatch, DISPATCH_MODES)
    _check_choice("moe.drop_policy", e.drop_policy, DROP_POLICIES)
    _check_choice("moe.backend", e.backend, GMM_BACKENDS)
    from moejax.parallel.topology import TOPOLOGIES

    _check_choice("mesh.topology", cfg.mesh.topology, ("auto", *TOPOLOGIES))
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
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.data.corpus == "stdlib" and m.vocab_size < BYTE_VOCAB:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB} ids")
    _validate_data_and_run_guards(cfg)
    if cfg.profile.start_step >= 0 and cfg.profile.num_steps <= 0:
        raise ConfigError("profile.num_steps must be positive when profile.start_step is set")
    if cfg.hardware.peak_tflops < 0:
        raise ConfigError("hardware.peak_tflops must be >= 0 (0 means look up or measure)")
    return sizes


def _validate_data_and_run_guards(cfg):
    """data.corpus parses and its directories exist; checkpoint and guard settings make sense. (The token
    files themselves are opened and checked against the vocabulary by moejax.data.sources.open_sources.)"""
    from moejax.data.shards import DataError
    from moejax.data.sources import check_corpus_paths

    try:
        check_corpus_paths(cfg.data)
    except DataError as e:
        raise ConfigError(str(e)) from None
    ck, g = cfg.checkpoint, cfg.guards
    for name, v in (("checkpoint.every_steps", ck.every_steps), ("checkpoint.every_minutes", ck.every_minutes),
                    ("checkpoint.keep_every_steps", ck.keep_every_steps), ("guards.step_timeout_s", g.step_timeout_s)):
        if v < 0:
            raise ConfigError(f"{name}={v} must be >= 0 (0 turns it off)")
    if ck.init_from and not (Path(ck.init_from) / "weights").is_dir():
        raise ConfigError(f"checkpoint.init_from={ck.init_from!r} is not a weights directory (moejax-convert import "
                          "writes one: config.json + weights/)")
    if ck.keep < 1:
        raise ConfigError(f"checkpoint.keep={ck.keep} must be at least 1")
    if g.max_bad_steps < 1:
        raise ConfigError(f"guards.max_bad_steps={g.max_bad_steps} must be at least 1")
    try:
        [int(x) for x in str(g.inject_nan_steps).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"guards.inject_nan_steps={g.inject_nan_steps!r} is not a comma-separated list of steps") from None
