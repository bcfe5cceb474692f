"""The config schema: every field with its default, and the choices a field may take.

Config files in `configs/` start from `default_config()` and override fields; `moejax.config.validate`
checks a config before anything compiles.
"""

from __future__ import annotations

import ml_collections

from moejax.errors import InputError

MESH_AXES = ("stage", "data", "fsdp", "context", "expert", "tensor")
# float16 is not offered: its 5-bit exponent needs dynamic loss scaling, which moejax does not implement;
# bfloat16 has float32's range and trains without it.
DTYPES = ("float32", "bfloat16")
FP8_FORMATS = ("none", "blockwise", "rowwise", "tensorwise", "mxfp8")  # moejax.kernels.fp8.FORMATS (this module stays jax-free)
SCORE_FUNCS = ("sigmoid", "softmax")
DISPATCH_MODES = ("capacity", "allgather", "dropless")
PIPELINE_SCHEDULES = ("circular", "1f1b")
DROP_POLICIES = ("position", "probability")
# Kernels (moejax/kernels/): `auto` resolves from the platform of the mesh's devices (kernels.resolve).
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "tokamax_mosaic", "tokamax_triton")
EXPERT_GEMM_KERNELS = ("auto", "einsum", "tile_loop", "ragged_dot", "tokamax", "te")
LOSS_KERNELS = ("auto", "dense", "chunked")
# Remat policies (docs/memory.md): none keeps everything; full keeps each block's input only; dots keeps the
# unbatched matmul outputs; attention keeps core attention's output; moe keeps that, the expert all-to-all results
# and the routed GEMM outputs (recomputing norms, projections, router and shared expert).
REMAT_POLICIES = ("none", "full", "dots", "attention", "moe")
# Where the Adam moments live (docs/memory.md): like the parameters, or also split over `data` (a distributed
# optimizer: ZeRO-1, Megatron-Core's distributed optimizer).
OPTIMIZER_STATE_SHARDINGS = ("params", "data")
ON_BAD_CHECKPOINT = ("fall_back", "refuse")  # moejax/training/resume_point.py
ATTENTION_KINDS = ("gqa", "mla")  # gqa covers MHA (n_kv_heads == n_heads); mla is DeepSeek's latent attention
ROPE_SCALINGS = ("none", "yarn")
# Weights & Biases (docs/observability.md): disabled (wandb is never imported), online (live in the W&B app),
# offline (written under the run's directory; `wandb sync` uploads it later).
WANDB_MODES = ("disabled", "online", "offline")


class ConfigError(InputError, ValueError):
    """A configuration or input the run cannot use; the message is shown to the user as is."""


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = m = ml_collections.ConfigDict()
    m.vocab_size = 264  # the byte tokenizer's 256 bytes + specials, padded to a multiple of 8
    m.d_model = 128
    m.n_layers = 4
    m.first_k_dense = 1  # DeepSeek-style: the first k layers use a dense FFN
    # Later layers that also use a dense FFN (d_ff wide), among the MoE layers (Qwen3-MoE's mlp_only_layers /
    # decoder_sparse_step): comma-separated 0-based layer indices, ascending, each >= first_k_dense, e.g. "3,7";
    # "": none. Not with pipeline stages (they run the MoE layers only). moejax/config/layers.py reads it.
    m.interleaved_dense_layers = ""
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
    # dtype of the weight gradients' reductions over data/fsdp (README, "Mixed precision"): float32 keeps the
    # sum of many bf16 partial gradients exact to f32; bfloat16 halves those bytes.
    m.grad_reduce_dtype = "float32"
    m.param_dtype = "float32"
    # FP8 GEMMs in training (README, "FP8"): none | blockwise (DeepSeek-V3: 1x128 / 128x128 e4m3, Hopper+; below
    # bf16 speed on GPUs, measured) | rowwise (one e4m3 scale per row along each GEMM's contraction, Hopper+: the
    # fast one on Hopper) | tensorwise (one scale per tensor from its current amax, e4m3 forward, e5m2 gradients:
    # Transformer Engine's current scaling, its FP8 grouped GEMM on Hopper) | mxfp8 (32-element E8M0 blocks,
    # Blackwell). Projections, dense/shared/routed expert FFNs; not the router, norms, attention softmax, embedding
    # or LM head.
    m.fp8 = "none"
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
    e.capacity_factor = 2.0  # <= 0 means worst case: no token is ever dropped
    # dropless: rows a device receives per round, x its balanced load T*K (buffers are sized for it); a step whose
    # largest load exceeds it runs extra rounds (never drops). > 0; at ep x min(K, E_local) or more: one round.
    e.dropless_window = 1.25
    # capacity and dropless: exchanges per MoE layer and direction; each moves a slice of every expert's rows, so
    # one slice's all-to-all runs under another's expert GEMMs (exact: the same rows meet the same experts).
    # 0 = auto, from the mesh's devices: dropless on GPUs with expert parallelism 2, otherwise 1 (one exchange);
    # printed at start with the kernels and written resolved into WORKDIR/config.json. allgather: 1 only.
    e.exchange_chunks = 0
    e.seq_aux_loss_coef = 1e-4  # DeepSeek-V3 sequence-wise balance loss (alpha)
    # transformers' router_aux_loss_coef, same definition: load_balancing_loss_func over every MoE layer's tokens
    # of the global batch together (Switch/Mixtral/Qwen3-MoE), once per pass
    e.batch_aux_loss_coef = 0.0
    e.z_loss_coef = 0.0
    e.bias_update_rate = 1e-3  # aux-loss-free balancing; 0 disables it

    # Which kernel runs each hot path (README, "Kernels"). auto: from the platform of the mesh's devices, printed
    # at start and written resolved into WORKDIR/config.json; a kernel the platform cannot run is a ConfigError.
    c.kernels = k = ml_collections.ConfigDict()
    k.attention = "auto"  # cpu: xla; gpu: tokamax_mosaic (flash attention, MLA's 192/128 head dims, segments)
    # expert_gemm auto: equal groups (capacity, allgather): einsum; dropless: tokamax on gpu, tile_loop on cpu; with
    # FP8 on gpu: te (NVIDIA Transformer Engine's grouped GEMM) where installed, else einsum (qwix)
    k.expert_gemm = "auto"
    k.loss = "auto"  # chunked: LM head + cross-entropy per chunk, no [B, L, V] logits; dense: whole logits
    k.loss_chunk = 512  # chunked loss: sequence positions of every row per chunk

    c.mesh = ms = ml_collections.ConfigDict()
    ms.stage = 1  # pipeline stages (moejax/parallel/pipeline.py): the MoE layers split over them, across NVLink domains
    ms.virtual_stages = 1  # chunks of MoE layers per stage (circular / interleaved schedule); bubble (S-1)/(M x V)
    # micro-batches one pipeline pass carries (0: all train.micro_batches, GPipe). k >= stages, dividing
    # train.micro_batches: passes of k micro-batches with the gradient accumulated over M / k of them, so the
    # activations of k micro-batches are live instead of M; bubble (S-1)/(k x V) per pass (docs/pipeline.md)
    ms.pipeline_in_flight = 0
    # circular: every micro-batch's forward, then every backward (MaxText's, parallel/pipeline.py); 1f1b: interleaved
    # 1F1B with an explicit backward (Megatron's order): live activations bounded by the stages, not the micro-batches
    ms.pipeline_schedule = "circular"
    ms.data = -1  # -1: whatever the other axes leave
    ms.fsdp = 1
    ms.expert = 1
    ms.tensor = 1
    # context parallelism (docs/parallelism.md): every sequence's positions split over this many devices, each
    # holding a front and a back piece (causal load balance); attention all-gathers MLA's latent (GQA's K/V heads)
    # over the axis. Placed inside an NVLink domain with expert x tensor. train.seq_len must divide by 2 x context.
    ms.context = 1
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
    # params: Adam moments sharded like their parameters | data: also split over the `data` mesh axis, each data
    # rank updating its slice and the new parameters all-gathered over data (costs one all-gather of the
    # parameters per step; no effect where mesh.data is 1)
    o.state_sharding = "data"
    # With model.param_dtype='bfloat16': the optimizer keeps f32 master copies of the weights (split like the Adam
    # moments), the model stores bf16 ones (their rounding) and the gradient is formed in f32. Megatron's layout of
    # memory: 2 bytes a weight on every replica + 4 bytes in the optimizer's slice, where f32 weights take 4 on every
    # replica. Fixed for a run's checkpoints (the optimizer state holds the masters).
    o.master_weights = False

    c.checkpoint = ck = ml_collections.ConfigDict()
    ck.every_steps = 0  # 0: only at the end of the run (and on SIGTERM/SIGINT)
    ck.every_minutes = 0.0  # also save when this much wall time passed since the last save; 0: off
    ck.keep = 2  # the latest K checkpoints are kept...
    ck.keep_every_steps = 0  # ...plus, permanently, every one whose step is a multiple of this; 0: none
    ck.init_from = ""  # a weights directory (moejax-convert import) to start step 0 from; "": random init
    # a resume whose newest checkpoint fails its integrity check or does not read back: 'fall_back' to the newest
    # older one that passes (one line on stderr; the bad one moved to WORKDIR/bad_checkpoints/) | 'refuse' (exit 2)
    ck.on_bad_checkpoint = "fall_back"
    # the local tier (moejax/training/local_checkpoint.py): every local_every_steps steps each process writes its own
    # shards to node-local storage under local_dir, plus a copy of another node's shards, so that a lost node costs at
    # most local_every_steps steps; "" / 0: off. Restarts restore from it when it is newer than the persistent tier.
    ck.local_dir = ""
    ck.local_every_steps = 0
    ck.local_keep = 2  # local steps kept per process (the newest complete one survives a save cut short)

    c.data = d = ml_collections.ConfigDict()
    # 'stdlib': the Python standard library's own sources, found at run time; or 'PATH[:WEIGHT],...' (or Megatron's
    # 'WEIGHT PATH WEIGHT PATH ...'): token directories written by `moejax-data tokenize` and Megatron indexed
    # datasets (PATH.bin + PATH.idx), mixed in proportion to their weights.
    d.corpus = "stdlib"
    d.max_bytes = 16_000_000  # stdlib only
    d.eval_every_nth_file = 20  # stdlib only
    d.eval_every_nth_doc = 20  # Megatron datasets only: document i is held out when i % n == n - 1; 0: none
    d.verify_checksums = True  # CRC32 of every token file at start (one read of the data)

    c.guards = g = ml_collections.ConfigDict()
    g.max_bad_steps = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    g.step_timeout_s = 1800.0  # watchdog: no step finished for this long -> dump stacks, exit 5; 0: off
    # multi-process jobs: another process sent no heartbeat for this long (it died, or its node did) -> exit 6 at once,
    # before jax's coordination service aborts the survivors (100 s, SIGABRT); 0: off
    g.peer_timeout_s = 30.0
    g.inject_nan_steps = ""  # testing the guards: comma-separated steps whose loss is made NaN

    c.profile = pr = ml_collections.ConfigDict()
    pr.start_step = -1  # >= 0: trace steps [start_step, start_step + num_steps) into WORKDIR/profile
    pr.num_steps = 3
    pr.python_tracer = False  # also record every Python call in every thread (costly; see ProfileWindow)

    c.hardware = h = ml_collections.ConfigDict()
    h.peak_tflops = 0.0  # per device; 0: look up the GPU, or measure on CPU

    # Where a run's metrics go besides metrics.jsonl, TensorBoard and the console.
    c.observability = ob = ml_collections.ConfigDict()
    # Weights & Biases: process 0 logs every metrics.jsonl record (scalars, expert-load heatmaps as images) to one
    # W&B run, whose id WORKDIR/wandb_run_id keeps so that a resumed run continues it. Needs the `wandb` extra.
    ob.wandb = w = ml_collections.ConfigDict()
    w.mode = "disabled"
    w.project = "moejax"
    w.entity = ""  # user or team; "": the logged-in user's default entity
    w.name = ""  # the run's display name; "": the workdir's name
    w.group = ""  # groups runs in the W&B app; "": none
    w.tags = ""  # comma-separated, e.g. "tiny,dropless"
    w.dir = ""  # wandb writes DIR/wandb/[offline-]run-*; "": $WANDB_DIR if set, else WORKDIR
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
