"""The one table of fields that may change between runs sharing state (moejax/config/changes.py): every
entry does what it says on resume and on init_from, and everything it does not list is refused."""

import pytest

from moejax.config import default_config
from moejax.config.changes import DATA_ORDER, MAY_CHANGE, Continuation, changed_fields, flatten

RESUME, INIT_FROM = Continuation.RESUME, Continuation.INIT_FROM


def _changed(field: str) -> tuple[dict, dict]:
    """(default config, the same with one leaf under `field` changed), as dicts."""
    saved = default_config().to_dict()
    new = default_config().to_dict()
    leaf = next(f for f in flatten(new) if f == field or f.startswith(field + "."))
    node = new
    *groups, name = leaf.split(".")
    for g in groups:
        node = node[g]
    value = node[name]
    node[name] = (not value) if isinstance(value, bool) else (value + 1 if isinstance(value, (int, float))
                                                               else value + "_other")
    return saved, new


@pytest.mark.parametrize("field", sorted(MAY_CHANGE))
def test_every_entry_allows_exactly_its_continuations(field):
    saved, new = _changed(field)
    allowed, why = MAY_CHANGE[field]
    assert why
    for how in Continuation:
        refused = changed_fields(saved, new, how)
        assert (refused == []) == (how in allowed), (field, how, refused)


def test_what_deepseek_v3_changes_mid_run_resumes():
    # The MTP weight 0.3 -> 0.1, the bias update rate -> 0 at the end, a new learning-rate schedule.
    saved = default_config().to_dict()
    new = default_config()
    new.model.mtp_loss_weight, new.moe.bias_update_rate = 0.1, 0.0
    new.optim.lr, new.optim.min_lr_ratio, new.optim.warmup_steps, new.train.steps = 1e-5, 0.0, 0, 5000
    assert changed_fields(saved, new.to_dict(), RESUME) == []


@pytest.mark.parametrize("field", ["model.d_model", "model.n_layers", "model.attention", "model.vocab_size",
                                   "moe.n_routed_experts", "moe.d_ff_expert", "model.param_dtype"])
def test_state_shapes_are_refused_on_resume(field):
    saved, new = _changed(field)
    assert [f for f, _, _ in changed_fields(saved, new, RESUME)] == [field]


@pytest.mark.parametrize("field", DATA_ORDER)
def test_data_order_is_kept_on_resume_only(field):
    saved, new = _changed(field)
    assert [f for f, _, _ in changed_fields(saved, new, RESUME)] == [field]
    assert changed_fields(saved, new, INIT_FROM) == []


def test_a_field_the_table_does_not_know_is_refused():
    saved, new = default_config().to_dict(), default_config().to_dict()
    new["moe"]["some_new_field"] = saved["moe"]["some_new_field"] = 1
    new["moe"]["some_new_field"] = 2
    assert changed_fields(saved, new, RESUME) == [("moe.some_new_field", 1, 2)]
    assert changed_fields(saved, new, INIT_FROM) == [("moe.some_new_field", 1, 2)]
