"""The range of every numeric config field: ONE table (field -> rule), checked by `validate` before anything else.

`check_ranges` walks every int/float leaf of a config (bools are not numbers) and applies the table's rule, or,
for a field the table does not name (one added to the schema later), finiteness: no NaN or infinity reaches
the model or the optimizer. The relations between fields (top_k <= n_routed_experts, first_k_dense <= n_layers,
divisibility by the mesh, ...) stay in `validate`. The same rules (and `check_choice`) check the arguments of the
Python API and the CLI (`moejax.api`). Pure: imports nothing of moejax but the schema.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from moejax.config.schema import MESH_AXES, ConfigError


@dataclass(frozen=True)
class Rule:
    """What a value must be: `text` says it ("a finite number > 0"), `allows` tests it."""

    text: str
    allows: Callable[[float], bool]
    integer: bool = False

    def check(self, name: str, value, error: type[Exception] = ConfigError):
        """`value` if it follows the rule, else `error("name=value: must be <text>")`. A bool, a string or None
        is not a number; a float is not an integer."""
        if not (is_number(value) and (isinstance(value, numbers.Integral) or not self.integer) and self.allows(value)):
            raise error(f"{name}={_shown(value)}: must be {self.text}")
        return value


def number(low: float | None = None, high: float | None = None, *, above: bool = False, below: bool = False,
           note: str = "") -> Rule:
    """A finite number in [low, high]; above / below exclude low / high."""
    if low is not None and high is not None:
        where = f" in {'(' if above else '['}{low:g}, {high:g}{')' if below else ']'}"
    elif low is not None:
        where = f" {'>' if above else '>='} {low:g}"
    elif high is not None:
        where = f" {'<' if below else '<='} {high:g}"
    else:
        where = ""

    def allows(v) -> bool:
        return (math.isfinite(v) and (low is None or (v > low if above else v >= low))
                and (high is None or (v < high if below else v <= high)))

    return Rule(f"a finite number{where}{f' ({note})' if note else ''}", allows)


def integer(low: int | None = None, *, note: str = "") -> Rule:
    """An integer >= low."""
    where = f" >= {low}" if low is not None else ""
    return Rule(f"an integer{where}{f' ({note})' if note else ''}", lambda v: low is None or v >= low, integer=True)


FINITE = number()  # a field the table does not name
POSITIVE = number(0, above=True)
NON_NEGATIVE = number(0)
FRACTION = number(0, 1)
BETA = number(0, 1, below=True)  # Adam's moment decays: 1 would never forget, > 1 diverges
COUNT = integer(1)
COUNT_OR_ZERO = integer(0)
# the mesh axes: resolve_mesh_shape fills the -1 axis from the device count
MESH_AXIS = Rule("positive (or -1: whatever the other axes leave)", lambda v: v >= 1 or v == -1, integer=True)

RANGES: dict[str, Rule] = {
    "seed": integer(0),  # numpy's SeedSequence (the data order) refuses negative seeds
    # model shapes
    "model.vocab_size": COUNT,
    "model.d_model": COUNT,
    "model.n_layers": COUNT,
    "model.first_k_dense": integer(0, note="at most model.n_layers"),
    "model.n_heads": COUNT,
    "model.n_kv_heads": integer(0, note="0: model.n_heads"),
    "model.head_dim": COUNT,
    "model.q_lora_rank": integer(0, note="0: full-rank queries"),
    "model.kv_lora_rank": integer(0, note="positive for mla"),
    "model.qk_nope_head_dim": integer(0, note="positive for mla"),
    "model.qk_rope_head_dim": integer(0, note="positive for mla"),
    "model.v_head_dim": integer(0, note="positive for mla"),
    "model.d_ff": COUNT,
    "model.max_seq_len": COUNT,
    "model.mtp_depth": COUNT_OR_ZERO,
    # model numerics
    "model.rope_theta": number(1, above=True, note="theta 1 rotates every pair alike; YaRN divides by log theta"),
    "model.yarn.factor": number(1, note="the context's scale s over the original"),
    "model.yarn.original_max_position": COUNT,
    "model.yarn.beta_fast": POSITIVE,
    "model.yarn.beta_slow": POSITIVE,
    "model.yarn.mscale": number(0, note="0: not given"),
    "model.yarn.mscale_all_dim": number(0, note="0: not given"),
    "model.mtp_loss_weight": NON_NEGATIVE,
    "model.norm_eps": POSITIVE,
    "model.init_std": POSITIVE,
    # experts and routing
    "moe.n_routed_experts": integer(0, note="positive when there are MoE layers"),
    "moe.n_shared_experts": COUNT_OR_ZERO,
    "moe.top_k": COUNT,
    "moe.d_ff_expert": COUNT,
    "moe.n_groups": COUNT,
    "moe.topk_groups": COUNT,
    "moe.routed_scaling": POSITIVE,
    "moe.capacity_factor": number(note="<= 0: worst case, no token is ever dropped"),
    "moe.dropless_window": number(0, above=True, note="rows received per dropless round, x the balanced load"),
    "moe.exchange_chunks": integer(0, note="0: auto"),
    "moe.seq_aux_loss_coef": NON_NEGATIVE,
    "moe.batch_aux_loss_coef": NON_NEGATIVE,
    "moe.z_loss_coef": NON_NEGATIVE,
    "moe.bias_update_rate": number(0, note="0: off"),
    "kernels.loss_chunk": integer(1, note="sequence positions per chunk"),
    **{f"mesh.{axis}": MESH_AXIS for axis in MESH_AXES},
    "mesh.virtual_stages": COUNT,
    "mesh.pipeline_in_flight": integer(0, note="0: all micro-batches in one pass"),
    "mesh.domain_size": integer(0, note="0: from the devices"),
    "train.steps": COUNT,
    "train.global_batch": COUNT,
    "train.micro_batches": COUNT,
    "train.seq_len": COUNT,
    "train.log_every": COUNT,
    "train.eval_every": integer(0, note="0: off"),
    "train.eval_batches": integer(0, note="0: off"),
    "train.expert_load_every": integer(0, note="0: the last step only"),
    # the optimizer (moejax/program/optim.py)
    "optim.lr": number(0, note="the schedule's peak; 0 freezes the weights"),
    "optim.min_lr_ratio": FRACTION,
    "optim.warmup_steps": COUNT_OR_ZERO,
    "optim.b1": BETA,
    "optim.b2": BETA,
    "optim.eps": POSITIVE,
    "optim.weight_decay": NON_NEGATIVE,
    # optax.clip_by_global_norm(0) zeroes every update (NaN for a zero gradient): there is no "off"
    "optim.clip_norm": number(0, above=True, note="the gradient's global-norm limit; no 0 for off"),
    "checkpoint.every_steps": integer(0, note="0: only at the end"),
    "checkpoint.every_minutes": number(0, note="0: off"),
    "checkpoint.keep": COUNT,
    "checkpoint.keep_every_steps": integer(0, note="0: none"),
    "checkpoint.local_every_steps": integer(0, note="0: no local tier"),
    "checkpoint.local_keep": COUNT,
    "data.max_bytes": COUNT,
    # file i is held out when i % n == 0: n = 1 would hold out every file and leave nothing to train on
    "data.eval_every_nth_file": integer(2, note="every nth file is held out"),
    # n = 1 would hold out every document, as for the stdlib's files; 0 holds out none
    "data.eval_every_nth_doc": Rule("0 (none) or an integer >= 2 (every nth document is held out)",
                                    lambda v: v == 0 or v >= 2, integer=True),
    "guards.max_bad_steps": COUNT,
    "guards.step_timeout_s": number(0, note="0: off"),
    "guards.peer_timeout_s": number(0, note="0: off"),
    "profile.start_step": integer(note="< 0: off"),
    "profile.num_steps": COUNT,
    "hardware.peak_tflops": number(0, note="0: look the GPU up, or measure"),
}


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def numeric_fields(cfg, prefix: str = ""):
    """(dotted field, value) of every int/float leaf of a config (a ConfigDict or a nested dict); bools are
    not numbers."""
    for key, value in cfg.items():
        if hasattr(value, "items"):
            yield from numeric_fields(value, f"{prefix}{key}.")
        elif is_number(value):
            yield f"{prefix}{key}", value


def _shown(value) -> str:
    if not is_number(value):
        return repr(value)
    return repr(int(value) if isinstance(value, numbers.Integral) else float(value))


def check_ranges(cfg) -> None:
    """Raises ConfigError `field=value: must be <rule>` for the first numeric field out of its range."""
    for field, value in numeric_fields(cfg):
        RANGES.get(field, FINITE).check(field, value)


def check_choice(name: str, value, choices, error: type[Exception] = ConfigError):
    """`value` if it is one of `choices`, else `error("name='value' is not one of 'a', 'b'")`."""
    choices = tuple(choices)  # a tuple compares, so an unhashable value is refused, not a TypeError
    if value not in choices:
        raise error(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")
    return value
