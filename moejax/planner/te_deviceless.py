"""What NVIDIA Transformer Engine needs to be traced for a compile-only GPU (`--dry_run_target` with
`kernels.expert_gemm=te`) in a process with no GPU: used by the dry run only, never by training.

Two things TE takes from the machine rather than from jax's target device:
1. Importing `transformer_engine.jax` loads libraries linked against the CUDA driver (`libcuda.so.1`: TE's NCCL EP
   library, cuDNN's runtime-compiled engines). On a machine without a driver a stand-in is loaded first: a small
   library whose entry points answer CUDA_ERROR_NO_DEVICE (nothing is ever launched: the dry run compiles). It is
   built once from the C source below with the system C compiler into the user's cache directory. Where a real
   driver loads (a GPU host), it is used and no stand-in is built.
2. While tracing, TE asks the physical GPU for its compute capability (`transformer_engine_jax.
   get_device_compute_capability`) and picks its kernels by it (MXFP8 quantize V2 on sm_100+, the Hopper FP8
   transposes, workspace sizes). `for_target` answers with the compile target's instead, for as long as the
   compile runs, and drops TE's cached answers on the way in and out so the next target is asked anew.

Both are deliberate stand-ins for a GPU that is not there: a compile is evidence of the program (its custom calls,
operand types, buffers), not of a kernel running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

from moejax.config.schema import ConfigError

# Every driver entry point TE's and cuDNN's libraries import (nm -D --undefined-only, TE 2.20.2, cuDNN 9), and
# the ones the CUDA runtime looks up first; each answers CUDA_ERROR_NO_DEVICE (100).
STUB_ENTRY_POINTS = (
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetAttribute", "cuCtxGetCurrent",
    "cuCtxGetDevice", "cuGetProcAddress", "cuGetProcAddress_v2", "cuFuncSetAttribute", "cuLaunchKernel",
    "cuLaunchKernelEx", "cuModuleGetFunction", "cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleUnload",
    "cuTensorMapEncodeIm2col", "cuTensorMapEncodeTiled",
)
CUDA_ERROR_NO_DEVICE = 100
STUB_VERSION = 2  # bump when the source changes: the cached library is rebuilt


def stub_source() -> str:
    lines = ["/* moejax: a stand-in CUDA driver for compiles without a GPU (moejax/planner/te_deviceless.py). */",
             "static const char *no_device = \"CUDA_ERROR_NO_DEVICE (moejax's stand-in driver: no GPU here)\";",
             "int cuGetErrorString(int e, const char **s) { (void)e; if (s) *s = no_device; return 0; }",
             "int cuGetErrorName(int e, const char **s) { (void)e; if (s) *s = \"CUDA_ERROR_NO_DEVICE\"; return 0; }"]
    lines += [f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}" for name in STUB_ENTRY_POINTS]
    return "\n".join(lines) + "\n"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moejax" / f"cuda-driver-stub-v{STUB_VERSION}"


def stub_driver_path() -> Path:
    """The stand-in libcuda.so.1, built with the C compiler on first use (ConfigError naming what is missing)."""
    lib = _cache_dir() / "libcuda.so.1"
    if lib.exists():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ConfigError("kernels.expert_gemm='te' in a compile without a GPU needs a stand-in CUDA driver, built "
                          "with a C compiler, and none was found (install gcc or set CC)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.parent / "stub.c"
    src.write_text(stub_source())
    tmp = lib.parent / f"libcuda.so.1.{os.getpid()}"
    # the soname makes the libraries linked against libcuda.so.1 bind to it once it is loaded by path
    build = [cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)]
    done = subprocess.run(build, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"building the stand-in CUDA driver with {cc} failed: {last}")
    os.replace(tmp, lib)  # atomic: a concurrent dry run sees the whole library or none
    return lib


def _nvidia_lib_dirs() -> list[Path]:
    """The lib folders of the CUDA wheels (nvidia-*-cu12/13) next to this interpreter's packages."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return sorted(d for root in roots for d in root.glob("*/lib") if d.is_dir())


def _load_driver() -> str:
    """'driver' when the machine's libcuda.so.1 loads, else 'stand-in' (loaded globally, so TE's libraries bind to
    it when they load)."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return "driver"
    except OSError:
        ctypes.CDLL(str(stub_driver_path()), mode=ctypes.RTLD_GLOBAL)
        return "stand-in"


_PREPARED: str | None = None


def prepare_import() -> str:
    """Makes `import transformer_engine.jax` work in this process; returns which driver it binds to. TE's library
    loader reads CUDA_HOME and the CUDA wheels' libraries (cuDNN, cuBLAS, curand, NCCL) are loaded by path, since
    LD_LIBRARY_PATH set now would not reach the dynamic loader."""
    global _PREPARED
    if _PREPARED:
        return _PREPARED
    dirs = _nvidia_lib_dirs()
    if dirs:
        os.environ.setdefault("CUDA_HOME", str(dirs[0].parent.parent))
    driver = _load_driver()
    # In passes until none loads: a library loads once the ones it needs are loaded (found by soname); what never
    # loads needs something outside these wheels (a tool's plugin) and TE does not use it.
    pending = [lib for d in dirs for lib in sorted(d.glob("lib*.so*"))]
    while pending:
        failed = []
        for lib in pending:
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(lib)
        if len(failed) == len(pending):
            break
        pending = failed
    _PREPARED = driver
    return driver


def _te_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name.startswith("transformer_engine") or name == "transformer_engine_jax")]


def _drop_cached_answers():
    """TE caches what it derived from the compute capability (functools caches on module functions)."""
    for module in _te_modules():
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", "").startswith(
                    "transformer_engine"):
                value.cache_clear()


@contextlib.contextmanager
def for_target(compute_capability: tuple[int, int]):
    """While tracing inside: TE's compute-capability query answers the target's (e.g. (10, 3) -> 103)."""
    prepare_import()
    import transformer_engine.jax  # noqa: F401  (loads transformer_engine_jax and the modules that read it)
    import transformer_engine_jax

    answer = compute_capability[0] * 10 + compute_capability[1]
    original = transformer_engine_jax.get_device_compute_capability
    patched = lambda gpu_id=0: answer  # noqa: E731
    bound = [(m, name) for m in _te_modules() for name, v in vars(m).items() if v is original]
    for m, name in bound:
        setattr(m, name, patched)
    _drop_cached_answers()
    try:
        yield
    finally:
        for m, name in bound:
            setattr(m, name, original)
        _drop_cached_answers()
