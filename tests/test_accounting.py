"""Model FLOPs per token against hand-computed values (Megatron-Core convention) and parameter counts."""

import pytest

from moejax.config import default_config
from moejax.model.accounting import flops_per_token, param_counts


def small_moe():
    c = default_config()
    m, e = c.model, c.moe
    m.d_model, m.n_layers, m.first_k_dense, m.n_heads, m.head_dim, m.d_ff, m.vocab_size = 64, 2, 1, 4, 16, 256, 300
    e.n_routed_experts, e.top_k, e.d_ff_expert, e.n_shared_experts = 8, 2, 32, 1
    return c


def mixtral_like():
    c = default_config()
    m, e = c.model, c.moe
    m.d_model, m.n_layers, m.first_k_dense, m.n_heads, m.head_dim, m.vocab_size = 4096, 32, 0, 32, 128, 32000
    e.n_routed_experts, e.top_k, e.d_ff_expert, e.n_shared_experts = 8, 2, 14336, 0
    return c


def test_flops_small_moe_by_hand():
    # per token, multiply-adds: attention 2 x (4*64*64 + 128*64), dense FFN 3*64*256,
    # MoE FFN 3*64*32*(2 routed + 1 shared), head 64*300; x6 for fwd + two bwd GEMMs.
    assert flops_per_token(small_moe(), seq_len=128) == 6 * (2 * (16384 + 8192) + 49152 + 18432 + 19200) == 815616


def test_flops_small_moe_matches_megatron_expression():
    # Megatron-Core's num_floating_point_operations written out for this config (MHA, SwiGLU, no MTP).
    h, s, layers, V = 64, 128, 2, 300
    attn = 12 * layers * h * h * (1 + 1 + s / h / 2)
    mlp = 12 * layers * h * (256 * 1.5 * 0.5 + 32 * 2 * 1.5 * 0.5 + 32 * 1.5 * 0.5)
    logits = 6 * h * V
    assert flops_per_token(small_moe(), seq_len=128) == pytest.approx(attn + mlp + logits, rel=1e-12)


def test_flops_mixtral_like_by_hand():
    attn = 32 * (4 * 4096 * 4096 + 4096 * 4096)  # seq 4096: causal half of QK^T and PV
    moe = 32 * 3 * 4096 * 14336 * 2
    head = 4096 * 32000
    assert flops_per_token(mixtral_like(), seq_len=4096) == 6 * (attn + moe + head) == 84_538_294_272


def test_param_counts_small_moe():
    counts = param_counts(small_moe())
    attn = 4 * 64 * 64 + 2 * 64
    expert = 3 * 64 * 32
    common = 2 * attn + 3 * 64 * 256 + (expert + 64 * 8 + 8) + 2 * 300 * 64 + 64  # router weight + bias
    assert counts == {"total": common + 8 * expert, "active": common + 2 * expert, "mtp": 0, "mtp_active": 0}


def test_param_counts_match_the_model():
    import jax
    from flax import nnx

    from moejax.program.state import create_model

    cfg = small_moe()
    model = nnx.eval_shape(lambda: create_model(cfg, 0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))  # params and the router's selection bias
    assert n == param_counts(cfg)["total"]


def _config_file(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_deepseek_v3_671b_matches_the_published_numbers():
    from moejax.model.accounting import accounting_report

    report = accounting_report(_config_file("deepseek_v3_671b"))
    assert abs(report["params_total"] / 1e9 - 671.0) <= 0.5
    assert 36.5 <= report["params_active"] / 1e9 <= 38.0  # "about 37B activated"
    assert report["seq_len"] == 4096
    assert report["flops_per_token"] / 1e9 == pytest.approx(259.99, rel=1e-3)
    assert report["flops_per_token_without_mtp"] / 1e9 == pytest.approx(249.81, rel=1e-3)


@pytest.mark.parametrize("name, total_b, active_b", [("mixtral_8x7b", 46.7, 12.9), ("qwen3_moe_30b_a3b", 30.5, 3.3)])
def test_published_sizes_of_the_other_families(name, total_b, active_b):
    counts = param_counts(_config_file(name))
    assert counts["total"] / 1e9 == pytest.approx(total_b, abs=0.1)
    assert counts["active"] / 1e9 == pytest.approx(active_b, abs=0.1)


@pytest.mark.parametrize("name", ["deepseek_v3_small", "tiny_mixtral", "tiny_qwen3_moe", "tiny"])
def test_param_counts_match_every_family_model(name):
    import jax
    from flax import nnx

    from moejax.program.state import create_model

    cfg = _config_file(name)
    model = nnx.eval_shape(lambda: create_model(cfg, 0))
    counts = param_counts(cfg)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == counts["total"] + counts["mtp"]
    mtp = sum(x.size for x in jax.tree.leaves(nnx.state(model.mtp))) if cfg.model.mtp_depth else 0
    assert mtp == counts["mtp"]


def test_moejax_plan_json_reports_the_accounting():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "moejax.cli.plan", "--config", str(root / "configs/deepseek_v3_671b.py"),
                           "--json"], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = json.loads(proc.stdout)["model"]
    assert round(model["params_total"] / 1e9, 1) == 671.0
    assert round(model["flops_per_token"] / 1e9, 2) == 259.99
