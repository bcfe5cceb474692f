"""`moejax-convert` — Hugging Face safetensors checkpoints <-> moejax weights directories.

  moejax-convert import --hf_dir HF_DIR --out DIR [--config BASE.py]
      HF_DIR: config.json + *.safetensors (deepseek_v3, mixtral or qwen3_moe; per-expert or packed experts;
      DeepSeek FP8 block-scaled weights are dequantised). DIR gets config.json + weights/ (orbax), usable by
      `moejax-convert export` and by training (`--config.checkpoint.init_from=DIR`). Training fields (mesh,
      optimizer, dispatch ...) come from --config; model fields from HF_DIR/config.json.
  moejax-convert export --from DIR --hf_dir OUT [--packed_experts] [--dtype bfloat16|float8_e4m3fn] [--max_shard_gb 5]
      Writes OUT/config.json + model-0000i-of-0000n.safetensors + model.safetensors.index.json.
  moejax-convert check --hf_dir HF_DIR [--json]
      Reads only headers: checks every tensor name and shape against the config and prints the model.

Exit codes: 0 done; 2 bad input (one line on stderr; nothing existing is overwritten). Nothing in a
checkpoint is ever executed: config.json is read as JSON and tensors as raw bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "moejax-convert"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF safetensors -> moejax weights directory")
    imp.add_argument("--hf_dir", required=True)
    imp.add_argument("--out", required=True)
    imp.add_argument("--config", help="base moejax config file for the training fields")
    exp = sub.add_parser("export", help="moejax weights directory -> HF safetensors")
    exp.add_argument("--from", dest="src", required=True)
    exp.add_argument("--hf_dir", required=True)
    exp.add_argument("--packed_experts", action="store_true", help="transformers-5 packed expert tensors")
    exp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float8_e4m3fn"),
                     help="float8_e4m3fn: DeepSeek-V3's FP8 release layout (e4m3 projections with 128x128 "
                          "weight_scale_inv blocks, the rest bf16)")
    exp.add_argument("--max_shard_gb", type=float, default=5.0)
    chk = sub.add_parser("check", help="check an HF checkpoint's names and shapes (headers only)")
    chk.add_argument("--hf_dir", required=True)
    chk.add_argument("--json", action="store_true")
    return p


def _load_base(path):
    if path is None:
        return None
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("moejax_base_config", path)
    if spec is None or not Path(path).is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the user's own config file, not the checkpoint's
    return module.get_config()


def _import(args):
    from moejax.interop.hf_checkpoint import load_hf  # noqa: PLC0415
    from moejax.interop.weights_dir import WEIGHTS, save_weights  # noqa: PLC0415

    if (Path(args.out) / WEIGHTS).exists():
        raise FileExistsError(f"--out {args.out} already holds weights; choose a new directory")
    from flax import nnx  # noqa: PLC0415

    model, cfg = load_hf(args.hf_dir, base_config=_load_base(args.config))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    save_weights(args.out, cfg, params, rest)
    print(f"imported {args.hf_dir} -> {args.out} ({_summary(cfg)})")


def _export(args):
    from flax import nnx  # noqa: PLC0415

    from moejax.interop.hf_checkpoint import save_hf  # noqa: PLC0415
    from moejax.interop.weights_dir import load_weights, read_config  # noqa: PLC0415
    from moejax.program.state import create_model  # noqa: PLC0415

    cfg = read_config(args.src)
    abstract = nnx.eval_shape(lambda: create_model(cfg, 0))
    graphdef, a_params, a_rest = nnx.split(abstract, nnx.Param, ...)
    params, rest = load_weights(args.src, a_params, a_rest)
    save_hf(nnx.merge(graphdef, params, rest), cfg, args.hf_dir, packed_experts=args.packed_experts,
            dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"exported {args.src} -> {args.hf_dir} ({_summary(cfg)})")


def _check(args):
    from moejax.interop.hf_checkpoint import _detect_packed, check_hf_dir  # noqa: PLC0415
    from moejax.interop.hf_config import hf_format_of  # noqa: PLC0415
    from moejax.model.accounting import param_counts  # noqa: PLC0415

    cfg, files = check_hf_dir(args.hf_dir)
    report = {"format": hf_format_of(cfg), "packed_experts": _detect_packed(files), "tensors": len(files.names()),
              **param_counts(cfg), "model": cfg.model.to_dict(), "moe": cfg.moe.to_dict()}
    print(json.dumps(report, indent=2) if args.json else f"ok: {args.hf_dir} is a complete {_summary(cfg)}")


def _summary(cfg) -> str:
    from moejax.interop.hf_config import hf_format_of  # noqa: PLC0415
    from moejax.model.accounting import param_counts  # noqa: PLC0415

    counts = param_counts(cfg)
    return (f"{hf_format_of(cfg)}, {cfg.model.n_layers} layers, {cfg.moe.n_routed_experts} experts, "
            f"{(counts['total'] + counts['mtp']) / 1e6:.2f}M parameters")


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from moejax.config import ConfigError  # noqa: PLC0415
    from moejax.interop.safetensors_io import CheckpointFormatError  # noqa: PLC0415

    try:
        {"import": _import, "export": _export, "check": _check}[args.command](args)
    except (ConfigError, CheckpointFormatError, FileExistsError, FileNotFoundError, NotADirectoryError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
