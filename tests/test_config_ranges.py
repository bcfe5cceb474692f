"""The range table of the numeric config fields (moejax/config/ranges.py): a value out of range (NaN, infinity,
a negative count, a decay >= 1, ...) is a ConfigError naming the field, the value and the range, raised by
validate before anything compiles; a numeric field the table does not name is still checked for finiteness;
every config the repository ships passes. Nothing here compiles (the exit-2 subprocess row for a NaN learning
rate is in test_bad_input.py)."""

import importlib.util
import math
import re
from pathlib import Path

import pytest

import moejax
from moejax import api
from moejax.config import ConfigError, default_config, validate
from moejax.config.ranges import RANGES, check_ranges, numeric_fields

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.py"
NAN, INF = math.nan, math.inf

# group -> (field, bad value, the range the message states)
BAD = {
    "optimizer": [("optim.lr", NAN, "a finite number >= 0"), ("optim.lr", INF, "a finite number >= 0"),
                  ("optim.lr", -1e-3, "a finite number >= 0"), ("optim.b1", 1.0, "a finite number in [0, 1)"),
                  ("optim.b2", 1.5, "a finite number in [0, 1)"), ("optim.b2", NAN, "a finite number in [0, 1)"),
                  ("optim.eps", 0.0, "a finite number > 0"), ("optim.weight_decay", -0.1, "a finite number >= 0"),
                  ("optim.clip_norm", 0.0, "a finite number > 0"), ("optim.clip_norm", INF, "a finite number > 0")],
    "schedule": [("optim.min_lr_ratio", 1.5, "a finite number in [0, 1]"),
                 ("optim.min_lr_ratio", NAN, "a finite number in [0, 1]"),
                 ("optim.warmup_steps", -1, "an integer >= 0")],
    "router": [("moe.seq_aux_loss_coef", -1e-4, "a finite number >= 0"),
               ("moe.batch_aux_loss_coef", NAN, "a finite number >= 0"),
               ("moe.z_loss_coef", INF, "a finite number >= 0"),
               ("moe.bias_update_rate", -1e-3, "a finite number >= 0"),
               ("moe.routed_scaling", 0.0, "a finite number > 0"), ("moe.n_groups", 0, "an integer >= 1"),
               ("moe.topk_groups", 0, "an integer >= 1")],
    "capacity/window": [("moe.capacity_factor", NAN, "a finite number (<= 0: worst case"),
                        ("moe.capacity_factor", INF, "a finite number (<= 0: worst case"),
                        ("moe.dropless_window", 0.0, "a finite number > 0"),
                        ("moe.dropless_window", -INF, "a finite number > 0"),
                        ("kernels.loss_chunk", 0, "an integer >= 1")],
    "init/model": [("model.init_std", 0.0, "a finite number > 0"), ("model.init_std", NAN, "a finite number > 0"),
                   ("model.norm_eps", 0.0, "a finite number > 0"), ("model.rope_theta", 1.0, "a finite number > 1"),
                   ("model.rope_theta", INF, "a finite number > 1"), ("model.yarn.factor", 0.5, "a finite number >= 1"),
                   ("model.yarn.beta_fast", 0.0, "a finite number > 0"),
                   ("model.yarn.mscale", -1.0, "a finite number >= 0"),
                   ("model.mtp_loss_weight", -0.1, "a finite number >= 0"), ("model.mtp_depth", -1, "an integer >= 0"),
                   ("model.n_kv_heads", -2, "an integer >= 0")],
    "data": [("data.max_bytes", 0, "an integer >= 1"), ("data.eval_every_nth_file", 1, "an integer >= 2"),
             ("data.eval_every_nth_file", 0, "an integer >= 2"),
             ("data.eval_every_nth_doc", 1, "0 (none) or an integer >= 2"),
             ("data.eval_every_nth_doc", -1, "0 (none) or an integer >= 2")],
    "guards": [("guards.max_bad_steps", 0, "an integer >= 1"), ("guards.step_timeout_s", NAN, "a finite number >= 0"),
               ("guards.step_timeout_s", -1.0, "a finite number >= 0")],
    "train": [("train.steps", 0, "an integer >= 1"), ("train.global_batch", -8, "an integer >= 1"),
              ("train.seq_len", 0, "an integer >= 1"), ("train.log_every", 0, "an integer >= 1"),
              ("train.micro_batches", 0, "an integer >= 1"), ("train.eval_every", -1, "an integer >= 0"),
              ("train.eval_batches", -1, "an integer >= 0"), ("train.expert_load_every", -1, "an integer >= 0"),
              ("seed", -1, "an integer >= 0")],
    "checkpoint/profile/hardware/mesh": [
        ("checkpoint.every_minutes", INF, "a finite number >= 0"), ("checkpoint.every_steps", -1, "an integer >= 0"),
        ("checkpoint.keep", 0, "an integer >= 1"), ("checkpoint.keep_every_steps", -1, "an integer >= 0"),
        ("profile.num_steps", 0, "an integer >= 1"), ("hardware.peak_tflops", -1.0, "a finite number >= 0"),
        ("hardware.peak_tflops", NAN, "a finite number >= 0"), ("mesh.domain_size", -1, "an integer >= 0"),
        ("mesh.virtual_stages", 0, "an integer >= 1"), ("mesh.tensor", 0, "positive (or -1")],
}
CASES = [(group, *case) for group, cases in BAD.items() for case in cases]


@pytest.mark.parametrize("group,field,value,allowed", CASES,
                         ids=[f"{g}:{f}={v}" for g, f, v, _ in CASES])
def test_a_value_out_of_range_is_one_line_naming_field_value_and_range(group, field, value, allowed):
    cfg = moejax.load_config(TINY, {field: value})  # as --config.FIELD=VALUE sets it (typed)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 8)
    shown = repr(float(value)) if isinstance(value, float) else str(value)
    assert re.match(rf"{re.escape(field)}={re.escape(shown)}: must be {re.escape(allowed)}", str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_the_table_names_only_fields_of_the_schema_and_the_defaults_pass():
    fields = dict(numeric_fields(default_config()))
    assert set(RANGES) <= set(fields), set(RANGES) - set(fields)
    for field, value in fields.items():  # every default follows its own rule
        assert RANGES[field].allows(value) if field in RANGES else math.isfinite(value), field
    assert "model.qk_norm" not in fields and "data.verify_checksums" not in fields  # bools are not numbers
    check_ranges(default_config())


def test_a_numeric_field_the_table_does_not_know_is_checked_for_finiteness():
    cfg = default_config()
    cfg.moe.some_new_coef = 0.5
    cfg.model.some_new_flag = True
    check_ranges(cfg)
    cfg.moe.some_new_coef = math.inf
    with pytest.raises(ConfigError, match=r"^moe\.some_new_coef=inf: must be a finite number$"):
        validate(cfg, 8)


def test_the_local_tier_needs_a_directory_and_an_interval_together():
    cfg = default_config()
    cfg.checkpoint.local_every_steps = 5
    with pytest.raises(ConfigError, match=r"^checkpoint\.local_dir and checkpoint\.local_every_steps go together"):
        validate(cfg, 8)
    cfg.checkpoint.local_every_steps, cfg.checkpoint.local_dir = 0, "/local"
    with pytest.raises(ConfigError, match=r"local_dir='/local', local_every_steps=0\)$"):
        validate(cfg, 8)
    cfg.checkpoint.local_every_steps = 5
    validate(cfg, 8)


def _shipped_configs():
    """Every config file of configs/ and benchmarks/configs/, with each variant its get_config takes (STAGES,
    VARIANTS)."""
    for path in sorted((ROOT / "configs").glob("*.py")) + sorted((ROOT / "benchmarks" / "configs").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"shipped_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield str(path.relative_to(ROOT))
        variants = (*getattr(module, "STAGES", ()), *getattr(module, "VARIANTS", ()))
        yield from (f"{path.relative_to(ROOT)}:{variant}" for variant in variants)


@pytest.mark.parametrize("name", list(_shipped_configs()))
def test_every_shipped_config_passes(name):
    cfg = moejax.load_config(ROOT / name)
    api.check_model_config(cfg)  # as moejax-plan checks it
    validate(cfg, api.mesh_device_count(cfg.mesh))  # as moejax-train --dry_run does
