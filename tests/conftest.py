"""Tests run on an emulated 8-device CPU mesh; the flag must be set before jax is imported anywhere."""

import os

from cpu_env import xla_flags  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-relative imports)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
# jax's persistent compilation cache for this session only: the CLI tests' training processes (and both workers)
# compile the same small steps again and again. A new empty directory unless one is given, so never shared across
# commits; the process that made it removes it at exit; workers and subprocesses inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moejax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("MOEJAX_GPU_COMPILE") == "1":  # the GPU compiles see the flags a GPU run compiles with
    from moejax.parallel.xla_gpu_flags import add_overlap_flags  # noqa: E402  (jax-free)

    add_overlap_flags()

import jax  # noqa: E402
import pytest  # noqa: E402
from budget import pytest_addoption, pytest_collection_modifyitems, pytest_configure  # noqa: E402,F401  (hooks)

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) >= 8, "conftest must set the emulated device count before jax is imported"
    return devs[:8]
