"""Hugging Face interop: `load_hf(dir)` -> (model, cfg) and `save_hf(model, cfg, dir)` for the deepseek_v3,
mixtral and qwen3_moe safetensors formats. `model(tokens_BxL).logits_BxLxV` runs the forward pass."""

from moejax.interop.hf_checkpoint import load_hf, load_hf_state, save_hf  # noqa: F401
from moejax.interop.hf_config import from_hf_config, hf_format_of, to_hf_config  # noqa: F401
from moejax.interop.safetensors_io import CheckpointFormatError  # noqa: F401
