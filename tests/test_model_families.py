"""Model families on the mesh: MLA + YaRN + MTP (DeepSeek-V3-shaped) and GQA with q/k norm and a dense layer
among its MoE layers (Qwen3-MoE-style) give the same loss and gradients on a sharded mesh as on one device; packed documents never see each
other; the DeepSeek-V3-shaped CPU config trains through the CLI with its MTP loss reported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import default_config, validate
from moejax.model.loss import lm_loss
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.program.state import create_model, state_shardings
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]


def mla_mtp_config():
    c = default_config()
    m, e = c.model, c.moe
    m.d_model, m.n_layers, m.first_k_dense, m.d_ff, m.n_heads = 32, 2, 1, 64, 4
    m.attention, m.q_lora_rank, m.kv_lora_rank = "mla", 16, 8
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 8, 4, 8
    m.rope_interleave, m.rope_scaling = True, "yarn"
    m.yarn.factor, m.yarn.original_max_position, m.yarn.mscale_all_dim = 4.0, 8, 1.0
    m.mtp_depth, m.mtp_loss_weight = 1, 0.3
    m.init_std, m.remat = 0.1, "none"  # remat is tested elsewhere; here it would only double compile time
    e.n_routed_experts, e.top_k, e.d_ff_expert, e.n_groups, e.topk_groups = 8, 2, 16, 4, 2
    e.routed_scaling, e.capacity_factor, e.seq_aux_loss_coef = 2.5, 0.0, 1e-2
    c.train.global_batch, c.train.seq_len = 8, 16
    return c


def gqa_qknorm_config():
    c = default_config()
    m, e = c.model, c.moe
    m.d_model, m.n_layers, m.first_k_dense, m.n_heads, m.n_kv_heads, m.head_dim = 32, 3, 0, 4, 2, 8
    m.interleaved_dense_layers, m.d_ff = "1", 64  # MoE, dense, MoE (Qwen3-MoE's mlp_only_layers=[1])
    m.qk_norm, m.init_std, m.remat = True, 0.1, "none"
    e.n_routed_experts, e.top_k, e.d_ff_expert, e.n_shared_experts = 8, 2, 16, 0
    e.score_func, e.capacity_factor, e.batch_aux_loss_coef = "softmax", 0.0, 1e-2
    c.train.global_batch, c.train.seq_len = 8, 16
    return c


def loss_grads_stats(cfg, devices, tokens, segments, hlo: bool = False):
    """((total, ce, mtp ce, MoE stats, gradients), the compiled program's text if `hlo`) of lm_loss on `devices`."""
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    graphdef, params, model_state = nnx.split(create_model(cfg, 3), nnx.Param, ...)
    # The same initial values on both layouts, placed by the parameters' logical axes.
    params = jax.device_put(params, state_shardings(params, mesh))
    model_state = jax.device_put(model_state, state_shardings(model_state, mesh))

    def f(params, model_state, tokens, segments):
        def loss(p, s):
            return lm_loss(nnx.merge(graphdef, p, s), tokens, segments, mtp_weight=cfg.model.mtp_loss_weight)

        (total, parts), (grads, _) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, model_state)
        return total, parts.ce, parts.mtp_ce_D, parts.stats, grads

    with jax.set_mesh(mesh):
        sharding = batch_sharding(mesh)
        args = (params, model_state, jax.device_put(tokens, sharding), jax.device_put(segments, sharding))
        compiled = jax.jit(f).lower(*args).compile()
        total, ce, mtp, stats, grads = jax.device_get(compiled(*args))
    return (total, ce, mtp, stats, nnx.to_pure_dict(grads)), (compiled.as_text() if hlo else None)


def loss_and_grads(cfg, devices, tokens, segments):
    total, ce, mtp, _, grads = loss_grads_stats(cfg, devices, tokens, segments)[0]
    return total, ce, mtp, grads


@pytest.mark.parametrize("make_config, layout", [
    (mla_mtp_config, {"data": 2, "expert": 2, "tensor": 2, "fsdp": 1}),
    (gqa_qknorm_config, {"data": 2, "expert": 4, "fsdp": 1, "tensor": 1}),
], ids=["mla_yarn_mtp_data2_expert2_tensor2", "gqa_qknorm_data2_expert4"])
def test_sharded_loss_and_grads_equal_single_device(devices, make_config, layout):
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 259, size=(8, 17), dtype=np.int32)
    # Two documents per row with a different split in each row: packing and positions are exercised too.
    cuts = rng.integers(3, 14, size=8)
    segments = (np.arange(17)[None, :] >= cuts[:, None]).astype(np.int32)
    single = make_config()
    single.mesh.data = 1
    ref = loss_and_grads(single, devices[:1], tokens, segments)
    multi = make_config()
    for axis, size in layout.items():
        multi.mesh[axis] = size
    got = loss_and_grads(multi, devices, tokens, segments)
    for name, a, b in zip(("total", "ce", "mtp_ce"), got[:3], ref[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=name)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref[3]))
    for path, g in jax.tree_util.tree_leaves_with_path(got[3]):
        np.testing.assert_allclose(g, flat_ref[path], rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert np.abs(flat_ref[next(iter(flat_ref))]).max() > 0


@pytest.mark.parametrize("make_config", [mla_mtp_config, gqa_qknorm_config], ids=["mla", "gqa"])
def test_packed_documents_do_not_see_each_other(make_config):
    cfg = make_config()
    cfg.model.mtp_depth = 2 if cfg.model.mtp_depth else 0  # two chained MTP modules, forward only
    model = create_model(cfg, 0)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 259, size=(1, 7)), rng.integers(0, 259, size=(1, 9))
    packed = jnp.asarray(np.concatenate([a, b], axis=1))
    segments = jnp.asarray([[0] * 7 + [1] * 9])
    @nnx.jit
    def forward(m, t, s):
        out = m(t, s)
        return out.logits_BxLxV, out.mtp_logits_DxBxLxV
    logits, mtp = forward(model, packed, segments)
    # Document b alone, at positions 0..8, gives the same logits as inside the packed row.
    alone, alone_mtp = forward(model, jnp.asarray(b), jnp.zeros_like(jnp.asarray(b)))
    np.testing.assert_allclose(logits[0, 7:], alone[0], atol=2e-5)
    if mtp is not None:  # MTP inputs of b's positions come from b only, except where they run past its end
        np.testing.assert_allclose(mtp[:, 0, 7:-2], alone_mtp[:, 0, :-2], atol=2e-5)
    # Changing document a leaves document b untouched, and changes a's own logits.
    other, _ = forward(model, packed.at[0, :7].set(jnp.asarray(rng.integers(0, 259, size=7))), segments)
    np.testing.assert_allclose(logits[0, 7:], other[0, 7:], atol=2e-5)
    assert np.abs(np.asarray(logits[0, :7] - other[0, :7])).max() > 1e-3


def test_mtp_targets_are_masked_at_the_row_end_and_across_documents():
    from moejax.model.loss import target_mask

    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1]])  # 6 inputs + 1 target
    np.testing.assert_array_equal(target_mask(segments, 0)[0], [1, 1, 0, 1, 1, 1])
    np.testing.assert_array_equal(target_mask(segments, 1)[0], [1, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(target_mask(segments, 2)[0], [0, 0, 0, 1, 0, 0])


def test_deepseek_v3_small_trains_with_mla_and_mtp(tmp_path):
    env = cpu_env(8)
    proc = subprocess.run(
        [sys.executable, "-m", "moejax.train", "--config", str(ROOT / "configs/deepseek_v3_small.py"),
         "--workdir", str(tmp_path / "run"), "--config.train.steps=16", "--config.train.log_every=4",
         "--config.train.eval_every=0", "--config.train.seq_len=32", "--config.train.global_batch=8",
         "--config.model.n_layers=2", "--config.data.max_bytes=1000000", "--config.optim.warmup_steps=4"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12, 16]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, [r["loss"] for r in records]
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"]
    assert len(records[-1]["expert_imbalance_per_layer"]) == 1 + 1  # 1 MoE layer + the MTP module's


def test_dense_layers_among_moe_layers_are_counted_and_refused_where_unsupported():
    from moejax.config import ConfigError
    from moejax.config.layers import layer_plan
    from moejax.model.accounting import flops_per_token, param_counts
    from moejax.planner.predict import stage_options

    cfg = gqa_qknorm_config()
    plan = layer_plan(cfg.model)
    assert (plan.is_moe, plan.runs) == ((True, False, True), ((True, 0, 1), (False, 0, 1), (True, 1, 1)))
    model = nnx.eval_shape(lambda: create_model(cfg, 0))
    assert model.dense_layers.ffn.w_up_DxF.shape == (1, 32, 64)
    assert model.moe_layers.ffn.router.bias_E.shape == (2, 8)  # one router-bias row per MoE layer
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == param_counts(cfg)["total"]
    first = gqa_qknorm_config()  # the same layers, the dense one first: the same parameters and FLOPs
    first.model.first_k_dense, first.model.interleaved_dense_layers = 1, ""
    assert (param_counts(cfg), flops_per_token(cfg)) == (param_counts(first), flops_per_token(first))
    assert stage_options(cfg, 8, 8) == [(1, 1)] and len(stage_options(first, 8, 8)) > 1
    cfg.mesh.stage, cfg.train.micro_batches = 2, 2
    with pytest.raises(ConfigError, match="pipeline stages run the MoE layers only"):
        create_model(cfg, 0)
    for bad, match in (("2,1", "ascending"), ("1,1", "ascending"), ("3", r"\[model.first_k_dense=0"),
                       ("x", "comma-separated")):
        cfg.model.interleaved_dense_layers = bad
        with pytest.raises(ConfigError, match=match):
            layer_plan(cfg.model)
