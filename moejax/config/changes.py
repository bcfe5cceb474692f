"""Which config fields may differ between two runs that share state: ONE table for both ways a run continues
another.

- RESUME: a run continues WORKDIR's checkpoint (same state shapes, same data order).
- INIT_FROM: a new run starts from a weights directory (`checkpoint.init_from`): the weights must compute
  the same function, the optimizer and data start afresh.

Every field of the groups in CHECKED_GROUPS must be equal unless MAY_CHANGE lists it for that continuation;
a resume also keeps DATA_ORDER, the fields that decide which rows each step reads. Fields outside these
(train.*, optim.*, checkpoint.*, ...) may always change: schedules may be re-annealed, steps extended. A field added to `model` or `moe` is therefore
refused until this table says otherwise: the safe default.
"""

from __future__ import annotations

import enum


class Continuation(enum.Enum):
    RESUME = "resume"
    INIT_FROM = "init_from"


_BOTH = frozenset(Continuation)
_RESUME = frozenset({Continuation.RESUME})
_INIT_FROM = frozenset({Continuation.INIT_FROM})

CHECKED_GROUPS = ("model", "moe")

# field -> (the continuations on which it may change, why that is safe)
MAY_CHANGE: dict[str, tuple[frozenset[Continuation], str]] = {
    "model.dtype": (_BOTH, "compute dtype; parameters stay in param_dtype"),
    "model.remat": (_BOTH, "what the backward pass recomputes, not what is computed"),
    "model.grad_reduce_dtype": (_BOTH, "precision of the gradient reductions, not of the weights"),
    "model.fp8": (_BOTH, "precision of the GEMMs' inputs; weights and optimizer state stay f32, same shapes"),
    "model.param_dtype": (_INIT_FROM, "imported weights are cast; a resumed state keeps its saved dtype"),
    "model.init_std": (_INIT_FROM, "initialisation only; imported weights replace it"),
    "model.max_seq_len": (_INIT_FROM, "an upper bound checked against train.seq_len; no weight depends on it"),
    # DeepSeek-V3 lowers the MTP loss weight from 0.3 to 0.1 late in pre-training, within one run.
    "model.mtp_loss_weight": (_BOTH, "a loss weight, not a weight of the model"),
    # Context extension (DeepSeek-V3 section 4.3) continues pre-trained weights with YaRN at a longer sequence:
    # the same weights, positions rescaled; a new run (init_from), since the sequence length changes the data.
    "model.rope_scaling": (_INIT_FROM, "context extension: YaRN on pre-trained weights"),
    "model.yarn": (_INIT_FROM, "context extension: the YaRN parameters (every model.yarn.* field)"),
    # Routing: changes what a set of weights computes, so imported weights must be routed as they were
    # trained; a resume has so far allowed these (the saved state keeps its shapes).
    "moe.top_k": (_RESUME, "state shapes unchanged"),
    "moe.score_func": (_RESUME, "state shapes unchanged"),
    "moe.n_groups": (_RESUME, "state shapes unchanged"),
    "moe.topk_groups": (_RESUME, "state shapes unchanged"),
    "moe.routed_scaling": (_RESUME, "state shapes unchanged"),
    "moe.norm_topk_prob": (_RESUME, "state shapes unchanged"),
    # How tokens reach the experts and how balance is encouraged: the same weights, the same function
    # (capacity drops aside, which the user chooses).
    "moe.dispatch": (_BOTH, "dispatch algorithm"),
    "moe.drop_policy": (_BOTH, "which tokens capacity dispatch drops"),
    "moe.capacity_factor": (_BOTH, "capacity dispatch buffer size"),
    "moe.dropless_window": (_BOTH, "dropless receive window size"),
    "moe.exchange_chunks": (_BOTH, "how the expert exchange is split; the same rows meet the same experts"),
    "moe.seq_aux_loss_coef": (_BOTH, "a loss coefficient"),
    "moe.batch_aux_loss_coef": (_BOTH, "a loss coefficient"),
    "moe.z_loss_coef": (_BOTH, "a loss coefficient"),
    # DeepSeek-V3 sets the bias update rate to 0 for the last 500B tokens, within one run.
    "moe.bias_update_rate": (_BOTH, "the aux-loss-free bias's update rate, not the bias"),
}

# Checked on RESUME only: fields outside the checked groups that decide the saved state's structure.
STATE_STRUCTURE = ("optim.master_weights",)  # the optimizer state holds the f32 masters or not

# Checked on RESUME only: the rows each step reads.
DATA_ORDER = ("seed", "train.global_batch", "train.seq_len", "data.corpus", "data.max_bytes",
              "data.eval_every_nth_file", "data.eval_every_nth_doc")


def flatten(config: dict, prefix: str = "") -> dict:
    """{'group.field': value} of a nested config dict."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def may_change(field: str, how: Continuation) -> bool:
    if field in DATA_ORDER or field in STATE_STRUCTURE:
        return how is not Continuation.RESUME
    if field.split(".")[0] not in CHECKED_GROUPS:
        return True
    # An entry names a field or a group of fields ("model.yarn" covers model.yarn.factor, ...).
    names = field.split(".")
    for i in range(len(names), 1, -1):
        if ".".join(names[:i]) in MAY_CHANGE:
            return how in MAY_CHANGE[".".join(names[:i])][0]
    return False


def changed_fields(saved: dict, new: dict, how: Continuation) -> list[tuple[str, object, object]]:
    """(field, saved value, new value) for each field that differs and may not change on `how`; fields missing
    from either side (configs of older versions) are not compared."""
    saved_flat, new_flat = flatten(saved), flatten(new)
    return [(f, saved_flat[f], v) for f, v in new_flat.items()
            if f in saved_flat and saved_flat[f] != v and not may_change(f, how)]
