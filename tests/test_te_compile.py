"""NVIDIA Transformer Engine's grouped GEMM (kernels.expert_gemm=te) in the real training step compiled for GPUs
without one (deviceless XLA:GPU; TE traced through planner/te_deviceless.py), asserting on the compiled program:
every routed-expert GEMM (forward, dgrad, wgrad) is a TE grouped-GEMM custom call with FP8 operands, and none is
left to XLA.

Needs TE (`make install-te`: .venv-te, jax's CUDA 13 plugin); `make test-te` runs this file and sets
MOEJAX_TE_COMPILE=1, which turns a missing TE into a failure; elsewhere the file skips. Not in CI (docs/testing.md:
building TE's JAX extension alone takes about 5 minutes of the CI machine's budget). Each compile is a session
fixture read by one class, in its own process (one GPU generation per process, as tests/test_gpu_compile.py).
"""
from __future__ import annotations

import os

import pytest
from gpu_extra import require_gpu_extra

require_gpu_extra()
from moejax.kernels.resolve import te_available  # noqa: E402

if not te_available():
    if os.environ.get("MOEJAX_TE_COMPILE") == "1":
        raise RuntimeError("MOEJAX_TE_COMPILE=1 but Transformer Engine's JAX extension is missing: make install-te")
    pytest.skip("NVIDIA Transformer Engine is not installed (make install-te)", allow_module_level=True)

from tests.test_gpu_compile import _gb300_dry_run_in_own_process  # noqa: E402

pytestmark = pytest.mark.slow
D_FF_EXPERT = 256  # TE's MXFP8 grouped GEMM: expert dims in multiples of 128 (DeepSeek-V3-small's d_model is 128)
E4M3_MXFP8 = "f8e4m3fn x f8e4m3fn (scales f8e8m0fnu x f8e8m0fnu)"


def _expert_dots(report, d_model=128):
    """Dots XLA compiled that multiply routed-expert rows or weights: an operand with the windows' row counts (the
    rows TE's GEMMs ran on) or the local experts' [E_local, D, F] weights (or the tiled einsum's per-tile copies)."""
    windows = {int(g.split("[")[1].split(",")[0]) for g in report["te_out_shapes"] if g.count(",") == 1}
    expert_dots = []
    for lhs, rhs in report["dots"]:
        for operand in (lhs, rhs):
            dims = tuple(int(d) for d in operand.split("[")[1].rstrip("]").split(",") if d)
            expert_weights = len(dims) == 3 and dims[0] > 1 and sorted(dims[1:]) == sorted((d_model, D_FF_EXPERT))
            if windows & set(dims) or expert_weights:  # (the shared expert's FP8 GEMM is [1, D, F]: one group)
                expert_dots.append((lhs, rhs))
    return expert_dots


@pytest.fixture(scope="session")
def gb300_te_mxfp8(tmp_path_factory):
    """DeepSeek-V3-small, dropless, MXFP8, data 2 x expert 4 on 8 GB300s, routed experts through TE."""
    return _gb300_dry_run_in_own_process(tmp_path_factory.mktemp("gb300_te"), **{
        "model.fp8": "mxfp8", "kernels.expert_gemm": "te", "moe.d_ff_expert": D_FF_EXPERT, "moe.exchange_chunks": 1})


class TestGB300TeMXFP8:
    """Reads the `gb300_te_mxfp8` compile."""

    def test_every_routed_expert_gemm_is_a_te_grouped_gemm_in_e4m3(self, gb300_te_mxfp8):
        r = gb300_te_mxfp8
        assert r["kernels"]["expert_gemm"] == "te" and "gemms=fp8 mxfp8" in r["kernels_line"]
        gemms = r["xla"]["te_grouped_gemms"]
        assert {g["kind"] for g in gemms} == {"forward", "dgrad", "wgrad"}
        assert {g["operands"] for g in gemms} == {E4M3_MXFP8}, gemms
        # 3 MoE layers and the MTP block's MoE (gate, up, down each), in the window and in the overflow rounds
        assert sum(g["count"] for g in gemms if g["kind"] == "wgrad") >= 6
        assert not _expert_dots(r), _expert_dots(r)[:5]

    def test_te_runs_its_v2_path_without_host_sync_and_the_planner_counts_its_workspace(self, gb300_te_mxfp8):
        r = gb300_te_mxfp8
        lowered = r["xla"]["lowered_custom_calls"]
        assert "te_grouped_quantize_v2_ffi" in lowered  # MXFP8 quantisation of the groups, sm_100+
        assert all(types.startswith("bf16") for types in lowered["te_grouped_quantize_v2_ffi"])
        # make install-te's CUDA 13 build: every grouped GEMM is V2 (group sizes read on the device; V1 copies them
        # to the host and waits, every call) and asks for one stream's workspace, which the planner counts
        assert "te_grouped_gemm_ffi" not in lowered and "te_grouped_gemm_v2_ffi" in lowered
        assert all(g["v2"] for g in r["xla"]["te_grouped_gemms"])
        workspace = {g["workspace_bytes"] for g in r["xla"]["te_grouped_gemms"]}
        assert workspace == {r["plan"]["memory"]["kernel_workspace"]}


@pytest.fixture(scope="session")
def h200_te_tensorwise(tmp_path_factory):
    """The same step on 8 H200s with TE's per-tensor current scaling (model.fp8=tensorwise, Hopper's recipe)."""
    return _gb300_dry_run_in_own_process(tmp_path_factory.mktemp("h200_te"), target="h200", **{
        "model.fp8": "tensorwise", "kernels.expert_gemm": "te", "moe.d_ff_expert": D_FF_EXPERT,
        "moe.exchange_chunks": 1})


class TestH200TeTensorwise:
    """Reads the `h200_te_tensorwise` compile."""

    def test_hopper_runs_te_current_scaling_e4m3_forward_e5m2_gradients(self, h200_te_tensorwise):
        r = h200_te_tensorwise
        by_kind = {}
        for g in r["xla"]["te_grouped_gemms"]:
            by_kind.setdefault(g["kind"], set()).add(g["operands"].split(" (")[0])
        assert by_kind["forward"] == {"f8e4m3fn x f8e4m3fn"}, by_kind
        # the gradient (e5m2) meets e4m3 in both backward GEMMs (TE's hybrid format; cuBLAS has no e5m2 x e5m2)
        assert by_kind["dgrad"] | by_kind["wgrad"] <= {"f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2"}, by_kind
        assert not _expert_dots(r), _expert_dots(r)[:5]
