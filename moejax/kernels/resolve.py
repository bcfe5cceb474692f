"""Which kernel runs each hot path: `kernels.*` in the config, `auto` resolved from the platform of the mesh's
devices (never from `jax.devices()[0]`: a deviceless GPU compile runs in a CPU process).

A kernel the platform, the shapes or the installed packages cannot run is a ConfigError naming what to change
or install; nothing falls back silently. The entry points (moejax.api, the dry run) resolve once against the
mesh, print the choice and write it into the config, so WORKDIR/config.json says what ran. A model built
directly from a config with `auto` (load_hf, tests) resolves against jax's default backend: the platform that
will run it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from moejax.config.schema import ConfigError

KERNEL_FIELDS = ("attention", "expert_gemm", "loss")
GPU_EXTRA = "pip install 'moejax[gpu]' (Python >= 3.12)"
# cuDNN's fused attention as jax calls it: head dims up to 128 (jax refuses larger ones before Hopper, and in a
# deviceless compile it checks the CPU process, so 192 is refused there too).
CUDNN_MAX_HEAD_DIM = 128


TE_INSTALL = ("`make install-te` (a virtualenv .venv-te with jax's CUDA 13 plugin and TE, its JAX extension built from "
              "source; on GPU hosts NVIDIA's JAX containers ship it: docs/kernels.md)")
# Transformer Engine's grouped GEMM: which model.fp8 formats it runs (its JAX side has no DeepSeek 128 x 128 blockwise
# and no rowwise scaling), and the row/dim alignment its MXFP8 kernels need (32-element blocks, scales padded to
# 128 x 4; the cuBLAS grouped GEMM's setup reads each group's scales at 128-row offsets).
TE_FP8_FORMATS = ("none", "tensorwise", "mxfp8")
TE_ALIGN = 128


def tokamax_available() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def te_available() -> bool:
    """Transformer Engine with its JAX extension (the `transformer_engine_jax` module: installed inside TE's package
    by the PyPI sdist, on the path in NVIDIA's containers). Found without importing TE (its import loads CUDA)."""
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None:
        return False
    if importlib.util.find_spec("transformer_engine_jax") is not None:
        return True
    roots = spec.submodule_search_locations or ()
    return any(next(Path(root).rglob("transformer_engine_jax*.so"), None) for root in roots)


def _platform(platform: str | None) -> str:
    if platform is None:
        import jax

        platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _need_tokamax(field: str, value: str, why: str):
    if not tokamax_available():
        raise ConfigError(f"kernels.{field}={value!r}{why} needs tokamax, which is not installed: {GPU_EXTRA}, "
                          f"or choose another kernels.{field}")


def _need_gpu(field: str, value: str, platform: str):
    if platform != "gpu":
        raise ConfigError(f"kernels.{field}={value!r} runs on NVIDIA GPUs only; the mesh's devices are {platform}")


def qk_v_head_dims(model_cfg) -> tuple[int, int]:
    if model_cfg.attention == "mla":
        return model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim, model_cfg.v_head_dim
    return model_cfg.head_dim, model_cfg.head_dim


def _attention(cfg, platform: str) -> str:
    kernel = cfg.kernels.attention
    if kernel == "auto":
        if platform != "gpu":
            return "xla"
        _need_tokamax("attention", kernel, " on gpu (flash attention: tokamax_mosaic)")
        return "tokamax_mosaic"
    if kernel == "cudnn":
        _need_gpu("attention", kernel, platform)
        qk, v = qk_v_head_dims(cfg.model)
        if max(qk, v) > CUDNN_MAX_HEAD_DIM:
            raise ConfigError(f"kernels.attention='cudnn' takes head dims up to {CUDNN_MAX_HEAD_DIM}, this model's are "
                              f"q/k {qk}, v {v}; use kernels.attention='tokamax_mosaic'")
        if cfg.model.dtype != "bfloat16":
            raise ConfigError("kernels.attention='cudnn' needs model.dtype='bfloat16' (cuDNN's fused attention "
                              "has no float32 kernel)")
    elif kernel.startswith("tokamax_"):
        _need_gpu("attention", kernel, platform)
        _need_tokamax("attention", kernel, "")
    return kernel


# tokamax's Mosaic GPU grouped GEMM loads its operands in tiles of 64 along every dimension: a weight dim must be
# below 64 or a multiple of it (XLA:GPU compile for H200: "dimension 2 must have size smaller or a multiple of its
# tiling 64"); dropless.py rounds the rows it passes (grouped_gemm.row_multiple). Here, not in grouped_gemm: this
# module is imported without jax.
TOKAMAX_GEMM_TILE = 64


def _fp8(cfg, platform: str, compute_capability: float | None) -> str:
    """model.fp8 checked against the platform: FP8 tensor cores from compute capability 8.9 (blockwise and rowwise
    e4m3), block-scaled MXFP8 GEMMs from 10.0 (Blackwell). On CPU all run emulated by XLA (tests, numerics)."""
    fmt = cfg.model.get("fp8", "none")
    if fmt == "none":
        return fmt
    if platform not in ("cpu", "gpu"):
        raise ConfigError(f"model.fp8={fmt!r} targets NVIDIA GPUs (and CPU emulation); the mesh's devices are {platform}")
    need = {"blockwise": 8.9, "rowwise": 8.9, "tensorwise": 8.9, "mxfp8": 10.0}[fmt]
    if platform == "gpu" and compute_capability is not None and compute_capability < need:
        raise ConfigError(f"model.fp8={fmt!r} needs compute capability >= {need} (FP8 tensor cores"
                          f"{', block-scaled: Blackwell' if fmt == 'mxfp8' else ''}); these GPUs are "
                          f"{compute_capability}: use " + ("model.fp8='rowwise', 'blockwise' or " if compute_capability >= 8.9
                                                           else "") + "model.fp8='none'")
    return fmt


def _expert_gemm(cfg, platform: str, compute_capability: float | None = None) -> str:
    kernel = cfg.kernels.expert_gemm
    ragged = cfg.moe.dispatch == "dropless"
    fmt = cfg.model.get("fp8", "none")
    if kernel == "te" or (kernel == "auto" and fmt in TE_FP8_FORMATS[1:] and platform == "gpu"
                          and _te_dims_problem(cfg) is None and te_available()):
        return _te(cfg, platform)
    if fmt != "none":
        # FP8 expert GEMMs are Transformer Engine's grouped GEMM (above) or qwix-quantised einsums (kernels/fp8.py).
        # tokamax 0.0.17 has no FP8 x FP8 ragged kernel: its sm100 "fp8" kernel takes e4m3 activations with int4
        # weights, its other quantised kernels (sm90, sm100) dequantise int weights to bf16, and its bf16 kernels
        # check for bf16/f16 operands.
        if kernel in ("tokamax", "ragged_dot", "tile_loop"):
            raise ConfigError(f"kernels.expert_gemm={kernel!r} with model.fp8={fmt!r}: the FP8 expert GEMMs are "
                              "Transformer Engine's grouped GEMM ('te') or qwix's einsum (tokamax 0.0.17 has no e4m3 "
                              "x e4m3 grouped GEMM); use kernels.expert_gemm='te', 'einsum' or 'auto'")
        return "einsum"
    if kernel == "auto":
        # Capacity and allgather buffers are [E_local, C, D] with equal groups: a batched GEMM (cuBLAS on GPU)
        # is the grouped GEMM, with no wasted work. Dropless groups are ragged: on GPU a grouped-GEMM kernel; on
        # CPU the tile loop, which skips the window's empty tiles (a loop iteration costs microseconds there; on
        # GPU it would serialise small kernels).
        if not ragged:
            return "einsum"
        if platform != "gpu":
            return "tile_loop"
        _need_tokamax("expert_gemm", kernel, " with moe.dispatch='dropless' on gpu (grouped GEMM: tokamax)")
        kernel = "tokamax"
    elif kernel == "ragged_dot" and platform == "gpu":
        raise ConfigError("kernels.expert_gemm='ragged_dot' on gpu: XLA:GPU rewrites lax.ragged_dot into masked "
                          "dense dots (n_experts x the FLOPs); use kernels.expert_gemm='tokamax' or 'einsum'")
    elif kernel == "tokamax":
        _need_gpu("expert_gemm", kernel, platform)
        _need_tokamax("expert_gemm", kernel, "")
    if kernel == "tokamax":
        tensor = max(1, int(cfg.mesh.tensor))
        dims = {"model.d_model": int(cfg.model.d_model), "moe.d_ff_expert": int(cfg.moe.d_ff_expert) // tensor}
        for name, dim in dims.items():
            if dim >= TOKAMAX_GEMM_TILE and dim % TOKAMAX_GEMM_TILE:
                raise ConfigError(f"kernels.expert_gemm='tokamax' tiles the expert weights by {TOKAMAX_GEMM_TILE}: "
                                  f"{name} ({dim} per tensor shard) must be below or a multiple of it; change it or "
                                  "use kernels.expert_gemm='einsum'")
    return kernel


def _te(cfg, platform: str) -> str:
    """kernels.expert_gemm='te' (asked, or `auto` with FP8 on GPUs where it is installed) checked."""
    fmt = cfg.model.get("fp8", "none")
    _need_gpu("expert_gemm", "te", platform)
    if not te_available():
        raise ConfigError(f"kernels.expert_gemm='te' needs NVIDIA Transformer Engine with its JAX extension, which is "
                          f"not installed: {TE_INSTALL}")
    if fmt not in TE_FP8_FORMATS:
        raise ConfigError(f"kernels.expert_gemm='te' with model.fp8={fmt!r}: Transformer Engine's JAX grouped GEMM "
                          "has no blockwise or rowwise scaling; use model.fp8='mxfp8' (Blackwell), 'tensorwise' "
                          "(Hopper) or 'none', or kernels.expert_gemm='einsum'")
    if problem := _te_dims_problem(cfg):
        raise ConfigError(f"kernels.expert_gemm='te': {problem} (Transformer Engine's grouped GEMM layouts); change "
                          "it or use kernels.expert_gemm='einsum'")
    return "te"


def _te_dims_problem(cfg) -> str | None:
    """Why the expert dims do not fit TE's layouts (multiples of TE_ALIGN per tensor shard), or None."""
    tensor = max(1, int(cfg.mesh.tensor))
    dims = {"model.d_model": int(cfg.model.d_model), "moe.d_ff_expert": int(cfg.moe.d_ff_expert) // tensor}
    for name, dim in dims.items():
        if dim % TE_ALIGN:
            return f"{name} ({dim} per tensor shard) must be a multiple of {TE_ALIGN}"
    return None


# moe.exchange_chunks=0 (auto) for dropless on GPUs with expert parallelism: two slices per exchange. In the
# scheduled XLA:GPU step (DeepSeek-V3-small, 8 H200s, benchmarks/RESULTS.md "Exchange in slices") a GEMM runs under
# 66% of the exchange's bytes with two slices, 50% with one, 53% with four; capacity's all-to-all got less GEMM
# under it with two slices (34%) than with one (56%), so capacity keeps one.
GPU_EXCHANGE_CHUNKS = 2


def resolve_exchange_chunks(asked: int, platform: str | None, expert: int, dispatch: str) -> int:
    """moe.exchange_chunks resolved: `asked` when set; auto (0): GPU_EXCHANGE_CHUNKS for dropless dispatch on GPUs
    with an `expert` axis, else 1 (capacity: measured above; allgather: no all-to-all; CPU: every collective runs
    synchronously, nothing to hide behind)."""
    if asked:
        return int(asked)
    split = _platform(platform) == "gpu" and expert > 1 and dispatch == "dropless"
    return GPU_EXCHANGE_CHUNKS if split else 1


def exchange_chunks(cfg, platform: str | None = None) -> int:
    """resolve_exchange_chunks for a config (platform None: jax's default backend)."""
    return resolve_exchange_chunks(int(cfg.moe.get("exchange_chunks", 0)), platform, int(cfg.mesh.expert),
                                   cfg.moe.dispatch)


def devices_compute_capability(devices) -> float | None:
    """The NVIDIA compute capability of a mesh's GPUs (e.g. 9.0 H100/H200, 10.0 B200, 10.3 GB300); None elsewhere."""
    found = {getattr(d, "compute_capability", None) for d in devices}
    found.discard(None)
    return min(float(c) for c in found) if found else None


def devices_platform(devices) -> str:
    """The one platform of a mesh's devices ('cpu', 'gpu', 'tpu')."""
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ConfigError(f"the mesh mixes device platforms {sorted(platforms)}; one platform per mesh")
    return _platform(platforms.pop())


def resolve_kernels(cfg, platform: str | None = None, compute_capability: float | None = None) -> dict[str, str]:
    """{'attention', 'expert_gemm', 'loss'} -> the concrete kernel each runs on `platform` ('cpu', 'gpu', 'tpu';
    None: jax's default backend) and, for GPUs, their compute capability when known."""
    platform = _platform(platform)
    _fp8(cfg, platform, compute_capability)
    return {k: _kernel(cfg, k, platform, compute_capability) for k in KERNEL_FIELDS}


def resolve_kernel(cfg, field: str, platform: str | None = None, compute_capability: float | None = None) -> str:
    """The concrete kernel kernels.<field> runs, as resolve_kernels resolves it, the other fields unchecked: what a
    benchmark of one kernel measures (benchmarks/kernels.py, moe_layer.py)."""
    platform = _platform(platform)
    _fp8(cfg, platform, compute_capability)
    return _kernel(cfg, field, platform, compute_capability)


def _kernel(cfg, field: str, platform: str, compute_capability: float | None) -> str:
    if field == "attention":
        return _attention(cfg, platform)
    if field == "expert_gemm":
        return _expert_gemm(cfg, platform, compute_capability)
    if field != "loss":
        raise ValueError(f"kernel field {field!r}: one of {', '.join(KERNEL_FIELDS)}")
    loss = cfg.kernels.loss
    return "chunked" if loss == "auto" else loss


def kernel_label(kernel: str, asked: str | None) -> str:
    """A resolved kernel as printed: 'tile_loop (auto)' when `auto` chose it, else its name."""
    return kernel + (" (auto)" if asked == "auto" else "")


def model_kernels(cfg) -> dict[str, str]:
    """The kernels a model built from cfg runs: concrete choices as given (the entry points checked them against
    the mesh's platform, which may differ from this process's: a deviceless GPU compile), `auto` resolved
    against jax's default backend (a model built directly, e.g. by load_hf)."""
    asked = {k: cfg.kernels[k] for k in KERNEL_FIELDS}
    # Only the `auto` fields: a concrete choice would be checked against this process's platform, not the mesh's.
    return {k: resolve_kernel(cfg, k) if v == "auto" else v for k, v in asked.items()}


def apply_kernels(cfg, platform: str, compute_capability: float | None = None) -> str:
    """Resolves cfg.kernels against `platform` IN PLACE (config.json then records what ran); returns the line to
    print, e.g. 'kernels on gpu: attention=tokamax_mosaic (auto), expert_gemm=einsum (auto), loss=chunked'."""
    asked = {k: cfg.kernels[k] for k in KERNEL_FIELDS}
    resolved = resolve_kernels(cfg, platform, compute_capability)
    for k, v in resolved.items():
        cfg.kernels[k] = v
    asked["exchange_chunks"] = "auto" if not cfg.moe.get("exchange_chunks", 0) else None
    cfg.moe.exchange_chunks = exchange_chunks(cfg, platform)
    return describe(cfg, platform, asked)


def describe(cfg, platform: str, asked: dict | None = None) -> str:
    parts = [f"{k}={kernel_label(cfg.kernels[k], asked and asked[k])}" for k in KERNEL_FIELDS]
    chunks = str(exchange_chunks(cfg, platform))
    parts.append(f"exchange_chunks={kernel_label(chunks, asked and asked.get('exchange_chunks'))}")
    fmt = cfg.model.get("fp8", "none")
    return f"kernels on {_platform(platform)}: " + ", ".join(parts) + (f", gemms=fp8 {fmt}" if fmt != "none" else "")

