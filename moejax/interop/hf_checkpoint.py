"""Import a Hugging Face safetensors checkpoint into moejax parameters, and export them back.

Import never holds the model in host memory: every moejax parameter is created with
`jax.make_array_from_callback`, whose callback fills only the slice one device holds, reading just the
(memory-mapped) HF tensors that slice needs. On the training mesh of a multi-host job each process thus
reads only its own shards; on one host the peak is one device's shard. Before any data is read, the whole
name/shape table is checked: a missing, unexpected or wrongly shaped tensor is an error naming it.

Export walks the same table in HF order and writes shards of bounded size (per-expert tensors by default,
which transformers 4.x and 5.x, vLLM and SGLang all read; `packed_experts=True` for transformers-5 style).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import ConfigError
from moejax.interop.hf_config import from_hf_config, to_hf_config
from moejax.interop.hf_names import Link, Piece, hf_links, known_duplicates, zero_initialised
from moejax.interop.safetensors_io import FP8_BLOCK, CheckpointFormatError, SafetensorsDir, ShardedWriter
from moejax.kernels.fp8 import quantize_weight_blocks
from moejax.model.transformer import Transformer

STACKED_ROOTS = ("dense_layers", "moe_layers")


def _is_expert_stacked(path) -> bool:
    return str(path[-1]).startswith("w_") and "_Ex" in str(path[-1])


def _leaf_dims(path) -> tuple[bool, bool]:
    """(has a leading layers dim, has an experts dim next)."""
    return path[0] in STACKED_ROOTS, _is_expert_stacked(path)


def _piece_shape(path, shape) -> tuple[int, ...]:
    layered, expert = _leaf_dims(path)
    return tuple(shape[int(layered) + int(expert):])


def _flat_variables(state) -> dict[tuple, nnx.Variable]:
    return {tuple(k): v for k, v in nnx.to_flat_state(state)}


def read_hf_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise CheckpointFormatError(f"{hf_dir}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None


def _detect_packed(files: SafetensorsDir) -> bool:
    return any(n.endswith(".experts.gate_up_proj") for n in files.names())


def _fmt_names(names, limit=5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_table(files: SafetensorsDir, links: list[Link], piece_shapes: dict[Piece, tuple], duplicates: dict,
                leaf_shapes: dict[tuple, tuple]):
    """Every linked tensor present with the right shape; nothing in the files left unclaimed."""
    names = files.names()
    wanted = {l.hf_name for l in links}
    missing = wanted - names
    if missing:
        raise CheckpointFormatError(f"{len(missing)} tensors the config needs are missing: {_fmt_names(missing)}")
    scales = {n for n in names if n.endswith(".weight_scale_inv") and n.replace("_scale_inv", "") in wanted}
    unexpected = names - wanted - set(duplicates) - scales
    if unexpected:
        raise CheckpointFormatError(f"{len(unexpected)} tensors are not part of this model (wrong config?): "
                                    f"{_fmt_names(unexpected)}")
    rows = defaultdict(set)
    for link in links:
        parts = tuple(jax.ShapeDtypeStruct(piece_shapes[p], jnp.float32) for p in link.pieces)
        expected = jax.eval_shape(lambda *a, link=link: link.to_hf(a, jnp), *parts).shape
        got = files.shape(link.hf_name)
        if link.hf_expert is not None:
            rows[link.hf_name].add(link.hf_expert)
            got = got[1:]
        if tuple(got) != tuple(expected):
            raise CheckpointFormatError(f"tensor {link.hf_name} has shape {files.shape(link.hf_name)}, "
                                        f"the config needs {expected}")
    for name, experts in rows.items():
        if files.shape(name)[0] != len(experts):
            raise CheckpointFormatError(f"tensor {name} packs {files.shape(name)[0]} experts, the config has {len(experts)}")
    for name, path in duplicates.items():
        want = leaf_shapes[path]
        got = files.shape(name)
        if sorted(got) != sorted(want):
            raise CheckpointFormatError(f"tensor {name} has shape {got}, the shared {'.'.join(path)} is {want}")


class _PieceReader:
    def __init__(self, files: SafetensorsDir, links: list[Link]):
        self.files = files
        self.by_piece = {p: (link, i) for link in links for i, p in enumerate(link.pieces)}

    def __call__(self, piece: Piece) -> np.ndarray:
        link, i = self.by_piece[piece]
        return np.asarray(link.to_ours(self.files.read(link.hf_name, link.hf_expert))[i])


def _leaf_callback(path, shape, dtype, reader: _PieceReader):
    layered, expert = _leaf_dims(path)
    lead = int(layered) + int(expert)

    def fill(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        layers = range(*index[0].indices(shape[0])) if layered else [None]
        experts = range(*index[int(layered)].indices(shape[int(layered)])) if expert else [None]
        rest = index[lead:]
        out = None
        for li, layer in enumerate(layers):
            for xi, x in enumerate(experts):
                block = reader(Piece(path, layer, x))[rest].astype(dtype)
                if out is None:
                    out = np.empty((len(layers),) * layered + (len(experts),) * expert + block.shape, dtype)
                out[(li,) * layered + (xi,) * expert] = block
        return out

    return fill


def _checked_table(files: SafetensorsDir, cfg, abstract_model):
    """(links, {path: abstract Variable}, zero-initialised paths) after checking names and shapes."""
    links = hf_links(cfg, packed_experts=files.names())
    leaves = _flat_variables(nnx.state(abstract_model))
    leaf_shapes = {path: tuple(v.get_value().shape) for path, v in leaves.items()}
    piece_shapes = {p: _piece_shape(p.path, leaf_shapes[p.path]) for l in links for p in l.pieces}
    unknown = {p.path for p in piece_shapes} - set(leaf_shapes)
    if unknown:
        raise ConfigError(f"internal: the HF table names parameters the model lacks: {sorted(unknown)[:3]}")
    zeros = zero_initialised(cfg)
    unlinked = set(leaf_shapes) - {p.path for p in piece_shapes} - zeros
    if unlinked:
        raise ConfigError(f"this model has parameters no {cfg.model.attention} HF format holds: "
                          f"{_fmt_names('.'.join(map(str, p)) for p in unlinked)}")
    check_table(files, links, piece_shapes, known_duplicates(cfg), leaf_shapes)
    return links, leaves, zeros


def check_hf_dir(hf_dir, base_config=None):
    """The moejax config of an HF directory, after checking every tensor name and shape (headers only)."""
    files = SafetensorsDir(hf_dir)
    cfg = without_absent_mtp(from_hf_config(read_hf_config(hf_dir), base_config), files.names())
    _checked_table(files, cfg, nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return cfg, files


def load_hf_state(hf_dir, cfg, abstract_model, shardings=None):
    """(graphdef, params, model_state) for `cfg`'s model filled from the HF checkpoint in hf_dir.

    `shardings` (a State of NamedShardings matching the model's variables) places every slice on its
    device; without it all arrays land on the first local device.
    """
    files = SafetensorsDir(hf_dir)
    links, leaves, zeros = _checked_table(files, cfg, abstract_model)
    graphdef, params, _ = nnx.split(abstract_model, nnx.Param, ...)
    reader = _PieceReader(files, links)
    flat_shardings = _flat_variables(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def make(path, variable):
        abstract = variable.get_value()
        sharding = flat_shardings[path].get_value() if path in flat_shardings else default
        if path in zeros:
            fill = lambda index, a=abstract: np.zeros(a.shape, a.dtype)[index]  # noqa: E731
        else:
            fill = _leaf_callback(path, abstract.shape, abstract.dtype, reader)
        arr = jax.make_array_from_callback(abstract.shape, sharding, fill)
        return variable.replace(arr)

    param_paths = set(_flat_variables(params))
    filled = {path: make(path, v) for path, v in leaves.items()}  # params and router bias
    params_out = nnx.from_flat_state({p: v for p, v in filled.items() if p in param_paths})
    rest_out = nnx.from_flat_state({p: v for p, v in filled.items() if p not in param_paths})
    return graphdef, params_out, rest_out


def without_absent_mtp(cfg, names: set[str]):
    """transformers' DeepSeek-V3 declares num_nextn_predict_layers but neither loads nor saves the MTP layer;
    when NO tensor of the MTP layers is in the files, the model is built without MTP (stated on stderr).
    A partly present MTP layer is still an error (check_table names the missing tensors)."""
    m = cfg.model
    prefixes = tuple(f"model.layers.{m.n_layers + k}." for k in range(m.mtp_depth))
    if m.mtp_depth and not any(n.startswith(prefixes) for n in names):
        print(f"moejax: the checkpoint has no MTP weights (config says {m.mtp_depth} module(s)); "
              "loading it without MTP", file=sys.stderr)
        cfg = cfg.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.model.mtp_depth = 0
    return cfg


def load_hf(hf_dir, *, base_config=None, shardings=None):
    """(model, cfg): the moejax model of an HF checkpoint directory, weights loaded (see load_hf_state)."""
    cfg = from_hf_config(read_hf_config(hf_dir), base_config)
    cfg = without_absent_mtp(cfg, SafetensorsDir(hf_dir).names())
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = load_hf_state(hf_dir, cfg, abstract, shardings)
    return nnx.merge(graphdef, params, rest), cfg


def _piece_array(leaves: dict, piece: Piece) -> np.ndarray:
    arr = leaves[piece.path][...]
    index = tuple(i for i in (piece.layer, piece.expert) if i is not None)
    return np.asarray(jax.device_get(arr[index] if index else arr), dtype=np.float32)


# DeepSeek-V3's FP8 release: these linear weights are e4m3 with a `weight_scale_inv` per 128 x 128 block; the
# embedding, norms, router gate, LM head and MTP projection stay bf16.
FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj")
FP8_EXPORT = "float8_e4m3fn"


def _is_fp8_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in FP8_PROJECTIONS


def fp8_weight_blocks(w_OxI: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's FP8 checkpoint layout of one [out, in] weight: (e4m3 values, f32 `weight_scale_inv`
    [ceil(out / 128), ceil(in / 128)]), value x scale_inv of its block = the weight to e4m3 precision. Quantised
    by qwix (kernels/fp8.py, the training recipe's 128 x 128 weight blocks)."""
    q = quantize_weight_blocks(jnp.asarray(w_OxI, jnp.float32)[None])
    values = np.asarray(q.qvalue[0, :, : w_OxI.shape[1]])
    block_rows = min(FP8_BLOCK, w_OxI.shape[0])  # the scale is repeated over each block's rows
    return values, np.asarray(q.scale[0, ::block_rows], np.float32)


def save_hf(model, cfg, out_dir, *, packed_experts: bool = False, dtype: str = "float32",
            max_shard_bytes: int = 5 * 2**30):
    """Writes config.json and safetensors shards for `model` into out_dir (created; must not hold a model).

    dtype 'float8_e4m3fn' writes DeepSeek's FP8 layout (DeepSeek-V3 family only, per-expert tensors): the
    projection weights in e4m3 with 128 x 128 block `weight_scale_inv`, everything else bf16, and the
    `quantization_config` DeepSeek's config.json carries. load_hf reads it back (dequantising the blocks).

    Shards are written as `*.partial` and renamed at the end, so an interrupted export never looks complete.
    """
    out = Path(out_dir)
    if out.exists() and any(out.glob("*.safetensors")):
        raise ConfigError(f"{out} already holds safetensors files; export into a new directory")
    hf_config = to_hf_config(cfg)
    fp8 = dtype == FP8_EXPORT
    if fp8 and (hf_config["model_type"] != "deepseek_v3" or packed_experts):
        raise ConfigError("--dtype float8_e4m3fn writes DeepSeek-V3's FP8 checkpoint layout: a deepseek_v3 model with "
                          "per-expert tensors (drop --packed_experts)")
    if fp8:
        hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    _, params, rest = nnx.split(model, nnx.Param, ...)
    leaves = {**_flat_variables(params), **_flat_variables(rest)}
    if hf_config["model_type"] != "deepseek_v3":
        bias = [v for p, v in leaves.items() if p[-1] == "bias_E"]
        if any(float(jnp.max(jnp.abs(b[...]))) > 0 for b in bias):
            raise ConfigError(f"the router selection bias is non-zero but {hf_config['model_type']} has none; "
                              "train with moe.bias_update_rate=0 to export to this format")
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out, max_shard_bytes=max_shard_bytes, dtype=jnp.dtype("bfloat16" if fp8 else dtype))
    links = hf_links(cfg, packed_experts=packed_experts)
    by_name: dict[str, list[Link]] = defaultdict(list)
    for link in links:
        by_name[link.hf_name].append(link)
    duplicates = known_duplicates(cfg)
    for name, group in by_name.items():
        tensors = [np.asarray(l.to_hf(tuple(_piece_array(leaves, p) for p in l.pieces))) for l in group]
        if fp8 and _is_fp8_projection(name):
            values, scale_inv = fp8_weight_blocks(tensors[0])
            writer.add(name, values, dtype=jnp.float8_e4m3fn)
            writer.add(name.replace(".weight", ".weight_scale_inv"), scale_inv, dtype=np.float32)
            continue
        writer.add(name, np.stack(tensors) if group[0].hf_expert is not None else tensors[0])
        if name.endswith("eh_proj.weight"):  # DeepSeek's MTP layer carries its own copies of embed and head
            prefix = name[: -len("eh_proj.weight")]
            for dup, path in duplicates.items():
                if dup.startswith(prefix):
                    arr = np.asarray(jax.device_get(leaves[path][...]), np.float32)
                    writer.add(dup, arr.T if path == ("head_DxV",) else arr)
    writer.close()
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out

