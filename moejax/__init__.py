"""moejax: a JAX/XLA pretraining stack for Mixture-of-Experts language models (DeepSeek-V3 first).

The Python API for launch scripts (moejax/api.py): `load_config`, `check_config`, `train`, `dry_run`,
`plan`, `evaluate`, `generate`, and the errors they raise. Importing moejax does not start jax's backends.
"""

from moejax.api import check_config, dry_run, evaluate, generate, load_config, plan, train
from moejax.config import ConfigError
from moejax.errors import InputError


def __getattr__(name):
    # Errors defined in heavier modules, imported when first asked for.
    if name in ("LostPeer", "NonFiniteLoss", "Stopped"):
        from moejax.training import loop

        return getattr(loop, name)
    if name == "DistributedError":
        from moejax.training.distributed import DistributedError

        return DistributedError
    raise AttributeError(f"module 'moejax' has no attribute {name!r}")


__all__ = ["ConfigError", "DistributedError", "InputError", "LostPeer", "NonFiniteLoss", "Stopped", "check_config", "dry_run",
           "evaluate", "generate", "load_config", "plan", "train"]
