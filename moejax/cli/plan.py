"""`moejax-plan --config configs/X.py [--config.a.b=v ...] [--seq_len N] [--json]`

Reports, from the config alone (nothing is allocated, no device is touched): total and activated
parameters of the main model and of its MTP modules, and model FLOPs per token in the Megatron-Core
convention, with and without MTP. Exit 2 on a bad config.
"""

from __future__ import annotations

import json
import sys

from absl import flags
from ml_collections import config_flags

from moejax.cli.config_flag import UsageError, parse_config
from moejax.config.schema import REMAT_POLICIES
from moejax.errors import InputError
from moejax.units import si_prefix

FLAGS = flags.FlagValues()
config_flags.DEFINE_config_file("config", None, "ml_collections config file, e.g. configs/deepseek_v3_671b.py",
                                flag_values=FLAGS, lock_config=True)
flags.DEFINE_integer("seq_len", None, "sequence length for the FLOP count (default: train.seq_len)",
                     flag_values=FLAGS)
flags.DEFINE_bool("json", False, "print one JSON object instead of a table", flag_values=FLAGS)
flags.DEFINE_string("topology", None, "rank layouts on this hardware (moejax/parallel/topology.py): "
                    "gb300-nvl72, gb200-nvl72, hgx-b200, hgx-h200, hgx-h100, cpu", flag_values=FLAGS)
flags.DEFINE_string("gpus", None, "GPU count(s) for --topology, e.g. 256 or 256,512,1024 (scaling efficiency "
                    "is relative to the first)", flag_values=FLAGS)
flags.DEFINE_float("efficiency", 0.5, "fraction of the bf16 dense peak the model's GEMMs reach", flag_values=FLAGS)
flags.DEFINE_integer("domain_size", 0, "GPUs used per NVLink domain (0: whole domains, or the largest multiple of a "
                     "tray that divides the job, e.g. 64 of an NVL72 rack at 256 GPUs)", flag_values=FLAGS)
flags.DEFINE_string("remat", ",".join(REMAT_POLICIES), "remat policies to consider", flag_values=FLAGS)
flags.DEFINE_string("dispatch", None, "dispatch modes to consider (default: the config's)", flag_values=FLAGS)
flags.DEFINE_integer("top", 5, "layouts to show per GPU count", flag_values=FLAGS)
flags.DEFINE_multi_string("layout", [], "a layout to rank among the searched ones and explain, e.g. NVIDIA's "
                          "record: pp=2,vp=8,ep=32,data=4,remat=full,mb=1 (fields: data fsdp context|cp expert|ep "
                          "tensor|tp stage|pp virtual|vp remat mb dispatch; unnamed axes 1)", flag_values=FLAGS)

PROG = "moejax-plan"


def _usage_error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _si(x: float, unit: str) -> str:
    scaled, prefix = si_prefix(x)
    if not prefix:
        return f"{x:.0f} {unit}".rstrip()
    if not unit and prefix == "G":
        prefix = "B"  # 671 B parameters
    return f"{scaled:.2f} {prefix}{unit}".rstrip()


def _table(report: dict) -> str:
    return "\n".join([
        f"parameters (main model)   {_si(report['params_total'], '')} total, {_si(report['params_active'], '')} active per token",
        f"parameters (MTP modules)  {_si(report['params_mtp'], '')} total, {_si(report['params_mtp_active'], '')} active per token",
        f"model FLOPs per token     {_si(report['flops_per_token'], 'FLOP')} at sequence {report['seq_len']}"
        f" ({_si(report['flops_per_token_without_mtp'], 'FLOP')} without MTP)",
        f"convention                {report['convention']}",
    ])


def main(argv=None) -> int:
    argv = list(sys.argv if argv is None else argv)
    try:
        cfg = parse_config(FLAGS, argv, __doc__, "configs/deepseek_v3_671b.py")
    except UsageError as e:
        return _usage_error(str(e))
    if cfg is None:  # --help
        return 0

    from moejax.api import check_model_config
    from moejax.config import ConfigError
    from moejax.model.accounting import accounting_report

    try:
        check_model_config(cfg)
    except ConfigError as e:
        return _usage_error(str(e))
    report = {"model": accounting_report(cfg, FLAGS.seq_len)}
    if FLAGS.topology or FLAGS.gpus:
        try:
            report["plan"] = _layouts(cfg)
        except InputError as e:  # unknown topology, bad --gpus/--remat/--dispatch/--top/... (checked by moejax.plan)
            return _usage_error(str(e))
    if FLAGS.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report["model"]))
        if "plan" in report:
            from moejax.planner.search import format_plan

            print("\n" + format_plan(report["plan"]))
    return 0


def _layouts(cfg) -> dict:
    """--topology/--gpus: the ranked layouts (moejax.plan, which checks every argument; here only the flags' text
    is split into lists)."""
    from moejax import api

    if not (FLAGS.topology and FLAGS.gpus):
        raise InputError("--topology and --gpus go together, e.g. --topology gb300-nvl72 --gpus 256,512,1024")
    try:
        gpus = [int(g) for g in _split(FLAGS.gpus)]
    except ValueError:
        raise InputError(f"--gpus={FLAGS.gpus!r} is not a comma-separated list of GPU counts") from None
    return api.plan(cfg, topology=FLAGS.topology, gpus=gpus, efficiency=FLAGS.efficiency,
                    domain_size=FLAGS.domain_size, remats=_split(FLAGS.remat),
                    dispatches=_split(FLAGS.dispatch) if FLAGS.dispatch else None, top=FLAGS.top,
                    candidates=FLAGS.layout)


def _split(text: str) -> list[str]:
    """A flag's comma-separated list: 'a, b,' -> ['a', 'b']."""
    return [x.strip() for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    sys.exit(main())
