"""Kernel choices: `auto` by platform, concrete choices checked against platform, shapes and installed packages
(one-line ConfigError, never a silent fallback), and the document mask every attention kernel is given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError, default_config
from moejax.kernels import resolve
from moejax.kernels.attention import attention, document_start


def document_mask(segment_ids_BxL):
    """[B, 1, Lq, Lk] True where query and key are in the same document: the definition by segment id."""
    return (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]


def mla_config():
    c = default_config()
    m = c.model
    m.attention, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = "mla", 32, 128, 64, 128
    m.dtype = "bfloat16"
    return c


def test_auto_on_cpu_and_gpu(monkeypatch):
    c = mla_config()
    assert resolve.resolve_kernels(c, "cpu") == {"attention": "xla", "expert_gemm": "einsum", "loss": "chunked"}
    monkeypatch.setattr(resolve, "tokamax_available", lambda: True)
    c.moe.dispatch = "dropless"
    assert resolve.resolve_kernels(c, "cpu")["expert_gemm"] == "tile_loop"  # ragged groups: skip the empty tiles
    assert resolve.resolve_kernels(c, "gpu") == {"attention": "tokamax_mosaic", "expert_gemm": "tokamax",
                                                 "loss": "chunked"}
    monkeypatch.setattr(resolve, "tokamax_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs tokamax, which is not installed: pip install 'moejax\[gpu\]'"):
        resolve.resolve_kernels(c, "gpu")


@pytest.mark.parametrize("field,value,platform,message", [
    ("attention", "cudnn", "cpu", "runs on NVIDIA GPUs only"),
    ("attention", "cudnn", "gpu", "head dims up to 128, this model's are q/k 192, v 128"),
    ("attention", "tokamax_triton", "cpu", "runs on NVIDIA GPUs only"),
    ("expert_gemm", "ragged_dot", "gpu", "rewrites lax.ragged_dot into masked dense dots"),
    ("expert_gemm", "tokamax", "cpu", "runs on NVIDIA GPUs only"),
])
def test_a_kernel_that_cannot_run_is_a_config_error(field, value, platform, message, monkeypatch):
    monkeypatch.setattr(resolve, "tokamax_available", lambda: True)
    c = mla_config()
    c.kernels[field] = value
    with pytest.raises(ConfigError, match=message):
        resolve.resolve_kernels(c, platform)


def test_tokamax_grouped_gemm_needs_tileable_expert_dims(monkeypatch):
    monkeypatch.setattr(resolve, "tokamax_available", lambda: True)
    c = mla_config()
    c.moe.dispatch, c.moe.d_ff_expert, c.model.d_model = "dropless", 72, 128
    with pytest.raises(ConfigError, match=r"moe.d_ff_expert \(72 per tensor shard\) must be below or a multiple"):
        resolve.resolve_kernels(c, "gpu")
    c.moe.d_ff_expert = 192
    assert resolve.resolve_kernels(c, "gpu")["expert_gemm"] == "tokamax"
    assert resolve.resolve_kernels(c, "gpu", 9.0)["expert_gemm"] == "tokamax"
    # Blackwell too (its weight gradient as tiled GEMMs, grouped_gemm.tokamax_weight_grad_form); the tiled einsum
    # stays selectable.
    assert resolve.resolve_kernels(c, "gpu", 10.3)["expert_gemm"] == "tokamax"
    c.kernels.expert_gemm = "einsum"
    assert resolve.resolve_kernels(c, "gpu", 10.3)["expert_gemm"] == "einsum"
    # FP8 expert GEMMs are qwix einsums: tokamax has no e4m3 x e4m3 grouped GEMM
    c.model.fp8, c.kernels.expert_gemm = "mxfp8", "auto"
    assert resolve.resolve_kernels(c, "gpu", 10.3)["expert_gemm"] == "einsum"
    c.kernels.expert_gemm = "tokamax"
    with pytest.raises(ConfigError, match="tokamax 0.0.17 has no e4m3 x e4m3 grouped GEMM"):
        resolve.resolve_kernels(c, "gpu", 10.3)


def test_apply_kernels_writes_what_runs_and_says_so():
    c = mla_config()
    line = resolve.apply_kernels(c, "cpu")
    assert (c.kernels.attention, c.kernels.expert_gemm, c.kernels.loss) == ("xla", "einsum", "chunked")
    assert line == ("kernels on cpu: attention=xla (auto), expert_gemm=einsum (auto), loss=chunked (auto), "
                    "exchange_chunks=1 (auto)")
    assert c.moe.exchange_chunks == 1  # resolved into the config: config.json says what ran


@pytest.mark.parametrize("dispatch,expert,platform,asked,chunks", [
    ("dropless", 4, "gpu", 0, resolve.GPU_EXCHANGE_CHUNKS),
    ("capacity", 8, "gpu", 0, 1),  # its compiled step hid less under two slices than under one
    ("dropless", 1, "gpu", 0, 1),  # no exchange to hide
    ("allgather", 4, "gpu", 0, 1),  # no all-to-all
    ("dropless", 4, "cpu", 0, 1),  # XLA:CPU runs collectives synchronously: nothing to hide behind
    ("dropless", 4, "cpu", 3, 3), ("capacity", 1, "gpu", 4, 4),  # a set value is what runs
])
def test_exchange_chunks_auto_from_the_devices(dispatch, expert, platform, asked, chunks, monkeypatch):
    monkeypatch.setattr(resolve, "tokamax_available", lambda: True)
    c = mla_config()
    c.moe.dispatch, c.mesh.expert, c.moe.exchange_chunks = dispatch, expert, asked
    line = resolve.apply_kernels(c, platform)
    assert c.moe.exchange_chunks == chunks
    assert line.endswith(f"exchange_chunks={chunks}" + (" (auto)" if not asked else ""))


def test_exchange_chunks_with_allgather_is_a_config_error():
    from moejax.config import validate

    c = default_config()
    c.moe.dispatch, c.moe.exchange_chunks = "allgather", 2
    with pytest.raises(ConfigError, match="allgather has no all-to-all to split"):
        validate(c, 8)


def test_document_start_is_the_segment_mask_under_causality():
    rng = np.random.default_rng(0)
    seg = np.cumsum(rng.random((3, 40)) < 0.15, axis=1).astype(np.int32)  # contiguous documents, packed rows
    start = np.asarray(document_start(jnp.asarray(seg)))
    q, k = np.arange(40)[:, None], np.arange(40)[None, :]
    from_start = (k >= start[:, :, None]) & (k <= q)
    from_mask = np.asarray(document_mask(jnp.asarray(seg)))[:, 0] & (k <= q)
    np.testing.assert_array_equal(from_start, from_mask)


def test_xla_attention_with_mla_head_dims():
    """The reference kernel: v's head dim (128) below q/k's (192), causal within documents."""
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (2, 16, 4, 24))
    k = jax.random.normal(kk, (2, 16, 4, 24))
    v = jax.random.normal(kv, (2, 16, 4, 8))
    seg = jnp.asarray(np.repeat([[0, 0, 1, 1]], 2, axis=0).repeat(4, axis=1), jnp.int32)
    out = attention(q, k, v, seg, 0.3, kernel="xla")
    logits = jnp.einsum("bqhk,bshk->bhqs", q, k) * 0.3
    allowed = np.asarray(document_mask(seg)) & np.tril(np.ones((16, 16), bool))
    ref = jnp.einsum("bhqs,bshv->bqhv", jax.nn.softmax(jnp.where(allowed, logits, -1e30), axis=-1), v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_gpu_target_without_the_gpu_extra_is_one_line_and_touches_nothing(tmp_path):
    """In an environment without jax's CUDA plugin or tokamax (the CPU suite's), --dry_run_target names what to
    install and exits 2 before jax starts; the workdir is not created."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("tokamax") and importlib.util.find_spec("jax_plugins"):
        pytest.skip("the gpu extra is installed here: tests/test_gpu_compile.py covers the compile")
    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "w"
    r = subprocess.run([sys.executable, "-m", "moejax.cli.train", "--config", str(root / "configs/tiny.py"),
                        "--dry_run", "--dry_run_target", "h200", "--workdir", str(work)],
                       capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--dry_run_target h200 compiles with XLA:GPU, which needs" in lines[0], r.stderr
    assert "pip install 'moejax[gpu]'" in lines[0]
    assert not work.exists()
