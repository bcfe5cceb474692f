"""The `gpu` extra (jax's CUDA plugin, tokamax) for the test modules that need it: they skip without it, except
where MOEJAX_GPU_COMPILE=1 (`make test-gpu`) asks for them, and a missing extra fails."""

import importlib.util
import os

import pytest


def require_gpu_extra() -> None:
    """Call at module level: skips the calling module without the extra, or raises when it was asked for."""
    have = importlib.util.find_spec("tokamax") is not None and importlib.util.find_spec("jax_plugins") is not None
    if have:
        return
    if os.environ.get("MOEJAX_GPU_COMPILE") == "1":
        raise RuntimeError("MOEJAX_GPU_COMPILE=1 but the gpu extra is missing: pip install -e '.[gpu,test]'")
    pytest.skip("the gpu extra (jax CUDA plugin, tokamax) is not installed", allow_module_level=True)


def tokamax_or_skip():
    """tokamax for a test outside the GPU-compile files (its XLA kernels run on CPU): skips without it, except where
    MOEJAX_GPU_COMPILE=1 (`make test-gpu`, which runs these tests) asks for it."""
    require_gpu_extra()
    import tokamax

    return tokamax
