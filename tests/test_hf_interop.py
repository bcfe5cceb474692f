"""Hugging Face interop against the reference implementations in transformers (CPU torch, f32).

For each family a tiny random model is built in transformers (every norm, router bias and RoPE-scaling knob
perturbed away from its default), saved, imported by moejax and compared on random tokens; then exported
by moejax and reloaded by transformers. Qwen3-MoE is also built with dense layers among its MoE layers
(`mlp_only_layers`, `decoder_sparse_step`). DeepSeek-V3's MTP module, which transformers lacks, is checked
against a reference composed here from the paper's equations out of transformers' own decoder layer.
"""

import json
import shutil
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from moejax.config import default_config  # noqa: E402
from moejax.interop import CheckpointFormatError, load_hf, save_hf  # noqa: E402
from moejax.model.accounting import param_counts  # noqa: E402

TOL = 1e-4
VOCAB, SEQ = 96, 12

def _qwen3_moe(**layers):
    return lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=64, **{"num_hidden_layers": 2, **layers})


# Qwen3-MoE with dense layers among the MoE layers: the layer kinds transformers builds, one letter per layer
# (D dense, M MoE), and how moejax's config writes them (model.first_k_dense, model.interleaved_dense_layers).
DENSE_AMONG_MOE = {
    "qwen3_moe_mlp_only": ("MDMM", 0, "1"),
    "qwen3_moe_sparse_step2": ("DMDM", 1, "2"),
}

FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64),
    "qwen3_moe": _qwen3_moe(),
    "qwen3_moe_mlp_only": _qwen3_moe(num_hidden_layers=4, mlp_only_layers=[1]),
    "qwen3_moe_sparse_step2": _qwen3_moe(num_hidden_layers=4, decoder_sparse_step=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 8}),
}


def _perturbed_model(name):
    torch.manual_seed(zlib.crc32(name.encode()))  # not hash(): str hashes differ between processes
    cfg = FAMILIES[name]()
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.1 * torch.randn_like(mod.e_score_correction_bias))
    return model


def _tokens(seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (2, SEQ))


@nnx.jit
def _jit_forward(model, tokens):
    return model(tokens)


def _forward(model, tokens):
    """Our model's ModelOutput, jitted: one compile per structure (both layouts of a checkpoint share it)."""
    return _jit_forward(model, jnp.asarray(tokens))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _base():
    base = default_config()
    base.moe.capacity_factor = 0.0  # never drop: transformers' reference is dropless
    return base


def _ours(directory):
    model, cfg = load_hf(directory, base_config=_base())
    return model, cfg


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    model = _perturbed_model(name)
    per_expert = tmp_path_factory.mktemp(f"{name}_per_expert")
    model.save_pretrained(per_expert)  # transformers writes per-expert tensors (the 4.x layout)
    packed = tmp_path_factory.mktemp(f"{name}_packed")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, packed / "model.safetensors")
    shutil.copy(per_expert / "config.json", packed / "config.json")
    return name, model, per_expert, packed


def test_import_matches_transformers_logits(family):
    name, hf_model, per_expert, packed = family
    tokens = _tokens()
    ref = _hf_logits(hf_model, tokens)
    assert any(k.endswith("gate_up_proj") for k in load_file(packed / "model.safetensors"))
    for directory in (per_expert, packed):
        model, _ = _ours(directory)
        ours = np.asarray(_forward(model, tokens).logits_BxLxV)
        assert np.abs(ours - ref).max() < TOL, (name, directory.name, np.abs(ours - ref).max())


@pytest.mark.parametrize("packed_experts", [False, True])
def test_export_reloads_in_transformers(family, tmp_path, packed_experts):
    name, hf_model, per_expert, _ = family
    model, cfg = _ours(per_expert)
    out = save_hf(model, cfg, tmp_path / "export", packed_experts=packed_experts, max_shard_bytes=20_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded, with an index
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = _tokens(1)
    assert np.abs(_hf_logits(reloaded, tokens) - _hf_logits(hf_model, tokens)).max() < TOL


@pytest.mark.parametrize("family", sorted(DENSE_AMONG_MOE), indirect=True)
def test_dense_layers_among_moe_layers_round_trip(family, tmp_path):
    """The layer plan survives import and export (config.json's own spelling of it), the parameter count is
    transformers' (plus the router's selection bias, one row per MoE layer) and a re-import computes the same."""
    name, hf_model, per_expert, _ = family
    kinds, first_k, interleaved = DENSE_AMONG_MOE[name]
    assert "".join("M" if "Sparse" in type(layer.mlp).__name__ else "D" for layer in hf_model.model.layers) == kinds
    model, cfg = _ours(per_expert)
    assert (cfg.model.first_k_dense, cfg.model.interleaved_dense_layers, cfg.model.d_ff) == (first_k, interleaved, 48)
    n_moe = kinds.count("M")
    hf_params = sum(p.numel() for p in hf_model.parameters())
    assert param_counts(cfg)["total"] == hf_params + n_moe * cfg.moe.n_routed_experts
    tokens = _tokens(3)
    out = _forward(model, tokens)
    assert out.stats.tokens_per_expert_E.shape == (n_moe, cfg.moe.n_routed_experts)
    exported = save_hf(model, cfg, tmp_path / "export")
    hf_cfg, original = (json.loads((d / "config.json").read_text()) for d in (exported, per_expert))
    for key in ("decoder_sparse_step", "mlp_only_layers", "intermediate_size"):
        assert hf_cfg[key] == original[key], key
    again, cfg_again = _ours(exported)
    assert (cfg_again.model.first_k_dense, cfg_again.model.interleaved_dense_layers) == (first_k, interleaved)
    assert np.array_equal(np.asarray(_forward(again, tokens).logits_BxLxV), np.asarray(out.logits_BxLxV))


def _mtp_checkpoint(tmp_path):
    """A DeepSeek-V3 checkpoint with its MTP layer, laid out as the released weights are (layer n_layers)."""
    hf_model = _perturbed_model("deepseek_v3")
    cfg = hf_model.config
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(7)
    layer = type(hf_model.model.layers[-1])(cfg, layer_idx=n).eval()
    mtp = {"eh_proj": torch.nn.Linear(2 * d, d, bias=False)}
    norms = {k: type(hf_model.model.norm)(d, eps=cfg.rms_norm_eps) for k in ("enorm", "hnorm", "shared_head.norm")}
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.02 * torch.randn_like(p) + (1.0 if p.ndim == 1 else 0.0))
        layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
        mtp["eh_proj"].weight.copy_(0.05 * torch.randn(d, 2 * d))
        for m in norms.values():
            m.weight.copy_(1 + 0.2 * torch.randn(d))
    directory = tmp_path / "dsv3_mtp"
    hf_model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    prefix = f"model.layers.{n}."
    tensors.update({prefix + k: v for k, v in layer.state_dict().items()})
    tensors[prefix + "eh_proj.weight"] = mtp["eh_proj"].weight.detach()
    for k, m in norms.items():
        tensors[prefix + k + ".weight"] = m.weight.detach()
    tensors[prefix + "embed_tokens.weight"] = hf_model.model.embed_tokens.weight.detach()
    tensors[prefix + "shared_head.head.weight"] = hf_model.lm_head.weight.detach()
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    return hf_model, layer, mtp, norms, directory


def _reference_mtp_logits(hf_model, layer, mtp, norms, tokens):
    """DeepSeek-V3 eq. 21-23 with transformers' modules: h' = W [norm(emb(t_{i+1})); norm(h_i)], one block,
    the shared head after the module's own norm. h_i is the main model's last hidden state before its norm."""
    captured = {}
    hook = hf_model.model.norm.register_forward_pre_hook(lambda mod, args: captured.setdefault("h", args[0]))
    with torch.no_grad():
        hf_model(torch.tensor(tokens))
        hook.remove()
        next_tokens = torch.tensor(np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1))
        emb = hf_model.model.embed_tokens(next_tokens)
        x = mtp["eh_proj"](torch.cat([norms["enorm"](emb), norms["hnorm"](captured["h"])], dim=-1))
        positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
        cos_sin = hf_model.model.rotary_emb(x, positions)
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return hf_model.lm_head(norms["shared_head.norm"](out)).numpy()


def test_deepseek_mtp_matches_paper_reference(tmp_path):
    hf_model, layer, mtp, norms, directory = _mtp_checkpoint(tmp_path)
    model, cfg = _ours(directory)
    assert cfg.model.mtp_depth == 1
    tokens = _tokens(2)
    out = _forward(model, tokens)
    assert np.abs(np.asarray(out.logits_BxLxV) - _hf_logits(hf_model, tokens)).max() < TOL
    ref = _reference_mtp_logits(hf_model, layer, mtp, norms, tokens)
    assert np.abs(np.asarray(out.mtp_logits_DxBxLxV[0]) - ref).max() < TOL
    # The MTP layer (and its copies of the shared embedding/head) survives an export.
    exported = save_hf(model, cfg, tmp_path / "export")
    names = set(json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"])
    assert {f"model.layers.{cfg.model.n_layers}.{k}" for k in
            ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight")} <= names
    again, _ = _ours(exported)
    assert np.abs(np.asarray(_forward(again, tokens).mtp_logits_DxBxLxV) - np.asarray(out.mtp_logits_DxBxLxV)).max() == 0


def _rewrite(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_good")
    _perturbed_model("deepseek_v3").save_pretrained(directory)
    return directory


@pytest.mark.parametrize("case", ["missing_expert", "extra_expert", "wrong_shape", "truncated", "bad_config"])
def test_bad_checkpoints_fail_with_the_tensor_named(deepseek_dir, tmp_path, case):
    directory = tmp_path / "bad"
    per_expert = deepseek_dir
    shutil.copytree(per_expert, directory)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    if case == "missing_expert":
        _rewrite(directory, lambda t: t.pop(key))
        match = "missing: " + key
    elif case == "extra_expert":
        _rewrite(directory, lambda t: t.update({key.replace(".3.", ".8."): t[key].clone()}))
        match = "not part of this model.*experts.8"
    elif case == "wrong_shape":
        _rewrite(directory, lambda t: t.update({key: t[key][:, :-1].contiguous()}))
        match = f"{key} has shape"
    elif case == "truncated":
        path = directory / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
        match = "truncated"
    else:
        (directory / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                           "model_type": "llama"}))
        match = "model_type='llama'"
    with pytest.raises((CheckpointFormatError, ValueError), match=match):
        _ours(directory)
