"""The table between Hugging Face tensor names and moejax parameters, for one model config.

Each `Link` ties ONE Hugging Face tensor (a name, plus an expert index when the file packs all experts of a
layer in one tensor, transformers-5 style) to one or more moejax pieces (a parameter path, plus the layer
index inside a scanned stack and the expert index inside an expert-stacked parameter), with the two
layout changes between them. HF `nn.Linear` weights are [out, in]; ours are [in, out] with heads split out.

The table is complete by construction: every moejax parameter piece appears in exactly one link, and the
importer fails on any HF tensor that no link names (`known_duplicates` aside) and on any link without a
tensor, so no expert is ever dropped silently.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from moejax.config.layers import layer_plan
from moejax.interop.hf_config import hf_format_of


class Piece(NamedTuple):
    path: tuple  # path in the model's nnx state, e.g. ("moe_layers", "attn", "w_q_DxHxK")
    layer: int | None  # index in the scanned 'layers' dim, None for unstacked parameters
    expert: int | None  # index in the expert dim, None for non-expert parameters


class Link(NamedTuple):
    hf_name: str
    hf_expert: int | None  # packed expert tensors: the expert's row of the HF tensor
    pieces: tuple[Piece, ...]
    to_ours: Callable  # hf array -> tuple of arrays, one per piece
    to_hf: Callable  # (tuple of piece arrays, array module) -> hf array; jnp under eval_shape for shapes


def _t(x):
    return x.swapaxes(-1, -2)


def _tr():
    return (lambda w: (_t(w),)), (lambda parts, xp=np: _t(parts[0]))


def _linear(shape_in_out: tuple[int, ...]):
    """HF [out, in] <-> ours [*in_dims, *out_dims] where the shape is given as ours."""

    def to_ours(w):
        return (_t(w).reshape(shape_in_out),)

    def to_hf(parts, xp=np):
        (w,) = parts
        n_in = shape_in_out[0]
        return _t(w.reshape(n_in, -1))

    return to_ours, to_hf


def _linear_in_split(shape_ours: tuple[int, ...], n_in: int):
    """HF [out, n_in_flat] <-> ours [*in_dims(shape[:-1]), out]: o_proj ([D, H*K] -> [H, K, D])."""

    def to_ours(w):
        return (_t(w).reshape(shape_ours),)

    def to_hf(parts, xp=np):
        (w,) = parts
        return _t(w.reshape(n_in, -1))

    return to_ours, to_hf


def _identity():
    return (lambda w: (w,)), (lambda parts, xp=np: parts[0])


def _one(hf_name, piece, fns, hf_expert=None):
    return Link(hf_name, hf_expert, (piece,), *fns)


def _attention_links(cfg, prefix: str, stack: str, layer: int | None) -> list[Link]:
    m = cfg.model
    d, h = m.d_model, m.n_heads

    def p(*names):
        return Piece((stack, *names) if stack else names, layer, None)

    a = f"{prefix}.self_attn"
    links = [
        _one(f"{prefix}.input_layernorm.weight", p("attn_norm", "scale_D"), _identity()),
        _one(f"{prefix}.post_attention_layernorm.weight", p("ffn_norm", "scale_D"), _identity()),
    ]
    if m.attention == "mla":
        n, r, v, c = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            q = m.q_lora_rank
            links += [
                _one(f"{a}.q_a_proj.weight", p("attn", "w_qa_DxQ"), _linear((d, q))),
                _one(f"{a}.q_a_layernorm.weight", p("attn", "q_norm", "scale_D"), _identity()),
                _one(f"{a}.q_b_proj.weight", p("attn", "w_qb_QxHxK"), _linear((q, h, n + r))),
            ]
        else:
            links.append(_one(f"{a}.q_proj.weight", p("attn", "w_q_DxHxK"), _linear((d, h, n + r))))

        def kva_to_ours(w):  # [C + R, D] -> latent [D, C] and shared rope key [D, R]
            return _t(w[:c]), _t(w[c:])

        def kvb_to_ours(w):  # [H * (N + V), C] -> k [C, H, N], v [C, H, V]
            w = w.reshape(h, n + v, c)
            return w[:, :n].transpose(2, 0, 1), w[:, n:].transpose(2, 0, 1)

        def kvb_to_hf(parts, xp=np):
            k, vv = parts
            return xp.concatenate([k.transpose(1, 2, 0), vv.transpose(1, 2, 0)], axis=1).reshape(h * (n + v), c)

        links += [
            Link(f"{a}.kv_a_proj_with_mqa.weight", None, (p("attn", "w_kva_DxC"), p("attn", "w_kr_DxR")),
                 kva_to_ours, lambda parts, xp=np: xp.concatenate([_t(parts[0]), _t(parts[1])], axis=0)),
            _one(f"{a}.kv_a_layernorm.weight", p("attn", "kv_norm", "scale_D"), _identity()),
            Link(f"{a}.kv_b_proj.weight", None, (p("attn", "w_kb_CxHxN"), p("attn", "w_vb_CxHxV")),
                 kvb_to_ours, kvb_to_hf),
            _one(f"{a}.o_proj.weight", p("attn", "w_o_HxVxD"), _linear_in_split((h, v, d), h * v)),
        ]
    else:
        k, g = m.head_dim, m.n_kv_heads or m.n_heads
        links += [
            _one(f"{a}.q_proj.weight", p("attn", "w_q_DxHxK"), _linear((d, h, k))),
            _one(f"{a}.k_proj.weight", p("attn", "w_k_DxGxK"), _linear((d, g, k))),
            _one(f"{a}.v_proj.weight", p("attn", "w_v_DxGxK"), _linear((d, g, k))),
            _one(f"{a}.o_proj.weight", p("attn", "w_o_HxKxD"), _linear_in_split((h, k, d), h * k)),
        ]
        if m.qk_norm:
            links += [_one(f"{a}.q_norm.weight", p("attn", "q_norm", "scale_D"), _identity()),
                      _one(f"{a}.k_norm.weight", p("attn", "k_norm", "scale_D"), _identity())]
    return links


def _dense_mlp_links(prefix: str, p) -> list[Link]:
    return [
        _one(f"{prefix}.gate_proj.weight", p("w_gate_DxF"), _tr()),
        _one(f"{prefix}.up_proj.weight", p("w_up_DxF"), _tr()),
        _one(f"{prefix}.down_proj.weight", p("w_down_FxD"), _tr()),
    ]


def _moe_links(cfg, prefix: str, stack: str, layer: int | None, fmt: str, packed) -> list[Link]:
    """packed: a bool, or the set of tensor names in the files (decided per layer: a file may mix both)."""
    e = cfg.moe
    if not isinstance(packed, bool):
        packed = f"{prefix}.mlp.experts.gate_up_proj" in packed
    f = e.d_ff_expert

    def p(*names, expert=None):
        return Piece((stack, *names) if stack else names, layer, expert)

    mlp = f"{prefix}.block_sparse_moe" if fmt == "mixtral" and not packed else f"{prefix}.mlp"
    tr = _tr()
    links = [_one(f"{mlp}.gate.weight", p("ffn", "router", "w_DxE"), tr)]
    if fmt == "deepseek_v3":
        links.append(_one(f"{mlp}.gate.e_score_correction_bias", p("ffn", "router", "bias_E"), _identity()))
    if e.n_shared_experts:
        links += _dense_mlp_links(f"{mlp}.shared_experts", lambda name: p("ffn", "shared", name))
    names = ("w1", "w3", "w2") if fmt == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for x in range(e.n_routed_experts):
        gate, up, down = (p("ffn", w, expert=x) for w in ("w_gate_ExDxF", "w_up_ExDxF", "w_down_ExFxD"))
        if packed:  # transformers 5: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
            links += [
                Link(f"{mlp}.experts.gate_up_proj", x, (gate, up), lambda w: (_t(w[:f]), _t(w[f:])),
                     lambda parts, xp=np: xp.concatenate([_t(parts[0]), _t(parts[1])], axis=0)),
                Link(f"{mlp}.experts.down_proj", x, (down,), *tr),
            ]
        else:
            links += [
                Link(f"{mlp}.experts.{x}.{names[0]}.weight", None, (gate,), *tr),
                Link(f"{mlp}.experts.{x}.{names[1]}.weight", None, (up,), *tr),
                Link(f"{mlp}.experts.{x}.{names[2]}.weight", None, (down,), *tr),
            ]
    return links


def hf_links(cfg, *, packed_experts) -> list[Link]:
    """Every link for this config, in HF tensor order (embedding, layers, MTP modules, norm, head).
    packed_experts: True/False for writing; the set of names present when reading."""
    m = cfg.model
    fmt = hf_format_of(cfg)
    plan = layer_plan(m)
    links = [_one("model.embed_tokens.weight", Piece(("embed", "table_VxD"), None, None), _identity())]
    for i in range(m.n_layers):
        prefix = f"model.layers.{i}"
        moe, j = plan.stack_index(i)  # HF layer i is layer j of our dense or MoE stack
        if not moe:
            links += _attention_links(cfg, prefix, "dense_layers", j)
            links += _dense_mlp_links(f"{prefix}.mlp", lambda name, j=j: Piece(("dense_layers", "ffn", name), j, None))
        else:
            links += _attention_links(cfg, prefix, "moe_layers", j)
            links += _moe_links(cfg, prefix, "moe_layers", j, fmt, packed_experts)
    for k in range(m.mtp_depth):  # DeepSeek-V3 stores MTP module k as layer n_layers + k
        prefix = f"model.layers.{m.n_layers + k}"
        mtp = ("mtp", k)
        links += [
            _one(f"{prefix}.enorm.weight", Piece((*mtp, "emb_norm", "scale_D"), None, None), _identity()),
            _one(f"{prefix}.hnorm.weight", Piece((*mtp, "hidden_norm", "scale_D"), None, None), _identity()),
            _one(f"{prefix}.eh_proj.weight", Piece((*mtp, "w_eh_2DxD"), None, None), _tr()),
            _one(f"{prefix}.shared_head.norm.weight", Piece((*mtp, "out_norm", "scale_D"), None, None), _identity()),
        ]
        block = _attention_links(cfg, prefix, "", None) + _moe_links(cfg, prefix, "", None, fmt, packed_experts)
        links += [l._replace(pieces=tuple(pc._replace(path=(*mtp, "block", *pc.path)) for pc in l.pieces))
                  for l in block]
    links += [
        _one("model.norm.weight", Piece(("final_norm", "scale_D"), None, None), _identity()),
        _one("lm_head.weight", Piece(("head_DxV",), None, None), _tr()),
    ]
    return links


def known_duplicates(cfg) -> dict[str, tuple]:
    """HF tensors that repeat a moejax parameter (DeepSeek-V3's MTP layer stores its own copies of the shared
    embedding and head): name -> the piece path it must equal in shape."""
    out = {}
    for k in range(cfg.model.mtp_depth):
        prefix = f"model.layers.{cfg.model.n_layers + k}"
        out[f"{prefix}.embed_tokens.weight"] = ("embed", "table_VxD")
        out[f"{prefix}.shared_head.head.weight"] = ("head_DxV",)
    return out


def zero_initialised(cfg) -> set[tuple]:
    """moejax state the HF format does not hold and that starts at zero: the router's selection bias for
    formats whose routers have none (mixtral, qwen3_moe). Export refuses a non-zero one."""
    if hf_format_of(cfg) == "deepseek_v3" or layer_plan(cfg.model).n_moe == 0:
        return set()
    return {("moe_layers", "ffn", "router", "bias_E")}
