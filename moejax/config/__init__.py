"""The config: schema and defaults (`schema`), pure validation (`validate`), and the one table of fields that
may change between runs that share state (`changes`). The bottom layer: it imports nothing else of moejax
but `moejax.errors`."""

from moejax.config.schema import (ATTENTION_KERNELS, ATTENTION_KINDS, DISPATCH_MODES, DROP_POLICIES, DTYPES,
                                  EXPERT_GEMM_KERNELS, LOSS_KERNELS, MESH_AXES, REMAT_POLICIES, ROPE_SCALINGS,
                                  SCORE_FUNCS, ConfigError, cpu_run, default_config)
from moejax.config.validate import resolve_mesh_shape, validate

__all__ = ["ATTENTION_KERNELS", "ATTENTION_KINDS", "DISPATCH_MODES", "DROP_POLICIES", "DTYPES",
           "EXPERT_GEMM_KERNELS", "LOSS_KERNELS", "MESH_AXES", "REMAT_POLICIES", "ROPE_SCALINGS", "SCORE_FUNCS",
           "ConfigError", "cpu_run", "default_config", "resolve_mesh_shape", "validate"]
