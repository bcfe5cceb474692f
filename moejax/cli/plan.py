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
flags.DEFINE_float("mem_fraction", None, "share of each GPU's memory the run gives XLA's allocator "
                   "(XLA_PYTHON_CLIENT_MEM_FRACTION; default: what moejax's launch scripts set, 0.95): the base of "
                   "XLA:GPU's scheduler budget, which decides whether 1f1b's overlap is scheduled", flag_values=FLAGS)
flags.DEFINE_integer("domain_size", 0, "GPUs used per NVLink domain (0: whole domains, or the largest multiple of a "
                     "tray that divides the job, e.g. 64 of an NVL72 rack at 256 GPUs)", flag_values=FLAGS)
flags.DEFINE_string("remat", ",".join(REMAT_POLICIES), "remat policies to consider", flag_values=FLAGS)
flags.DEFINE_string("dispatch", None, "dispatch modes to consider (default: the config's)", flag_values=FLAGS)
flags.DEFINE_integer("top", 5, "layouts to show per GPU count", flag_values=FLAGS)
flags.DEFINE_multi_string("layout", [], "a layout to rank among the searched ones and explain, e.g. NVIDIA's "
                          "record: pp=2,vp=8,ep=32,data=4,remat=full,mb=1 (fields: data fsdp context|cp expert|ep "
                          "tensor|tp stage|pp virtual|vp remat mb dispatch; unnamed axes 1)", flag_values=FLAGS)

flags.DEFINE_bool("checkpoint", False, "with --topology/--gpus: the checkpoint's size and save times at the best "
                  "layout and each --layout (moejax/planner/checkpoint_io.py)", flag_values=FLAGS)
flags.DEFINE_string("checkpoint_assume", "", "--checkpoint's assumptions, overridden, e.g. persistent_gbps=200,"
                    "node_persistent_gbps=50,local_write_gbps=20,peer_link_gbps=400,gpus_per_process=1,"
                    "replica_parallel=0 (defaults: one process per node of the topology, the bandwidths in "
                    "checkpoint_io.py)", flag_values=FLAGS)

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
    try:  # before the search, which takes minutes at 671B
        assume = _checkpoint_assumptions(FLAGS.checkpoint_assume) if FLAGS.checkpoint else None
    except InputError as e:
        return _usage_error(str(e))
    if FLAGS.topology or FLAGS.gpus:
        try:
            report["plan"] = _layouts(cfg)
        except InputError as e:  # unknown topology, bad --gpus/--remat/--dispatch/--top/... (checked by moejax.plan)
            return _usage_error(str(e))
    if FLAGS.checkpoint:
        try:
            report["checkpoint"] = _checkpoint_costs(cfg, report["plan"], assume)
        except InputError as e:
            return _usage_error(str(e))
    if FLAGS.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report["model"]))
        if "plan" in report:
            from moejax.planner.search import format_plan

            print("\n" + format_plan(report["plan"]))
        if "checkpoint" in report:
            print("\n" + _checkpoint_table(report["checkpoint"]))
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
                    candidates=FLAGS.layout, mem_fraction=FLAGS.mem_fraction)


def _checkpoint_costs(cfg, plan: dict, assume: dict) -> list[dict]:
    """--checkpoint: checkpoint_cost of each GPU count's best layout and its --layout candidates, on the topology's
    nodes (a GB tray of 4 GPUs, an HGX node of 8) and NVLink domains as the plan used them."""
    from moejax.parallel.topology import get_topology
    from moejax.planner.checkpoint_io import checkpoint_cost
    from moejax.planner.layout import Layout

    node = get_topology(plan["topology"]).devices_per_process
    rows = []
    for run in plan["runs"]:
        chosen = [("best", run["best"][0])] if run["best"] else []
        for name, p in chosen + [("candidate", c) for c in run["candidates"]]:
            options = {"gpus_per_node": node or run["gpus"], "domain_size": run["domain_size"], **assume}
            try:
                cost = checkpoint_cost(cfg, Layout(**p["layout"]), **options)
            except ValueError as e:  # a node or process size that does not divide the job
                raise InputError(f"--checkpoint_assume: {e}") from None
            rows.append({"gpus": run["gpus"], "which": name, "layout": p["name"], **cost.to_dict()})
    return rows


def _checkpoint_assumptions(text: str) -> dict:
    """'persistent_gbps=200,gpus_per_process=1' -> keyword arguments of checkpoint_cost."""
    if not (FLAGS.topology and FLAGS.gpus):
        raise InputError("--checkpoint needs --topology and --gpus (the layouts whose checkpoint it sizes)")
    kinds = {"persistent_gbps": float, "node_persistent_gbps": float, "local_write_gbps": float,
             "peer_link_gbps": float, "gpus_per_node": int, "gpus_per_process": int, "replica_parallel": int}
    out = {}
    for part in _split(text):
        key, _, value = part.partition("=")
        if key not in kinds:
            raise InputError(f"--checkpoint_assume: {key!r} is not one of {', '.join(kinds)}")
        try:
            out[key] = kinds[key](value)
        except ValueError:
            raise InputError(f"--checkpoint_assume: {key} must be a number, not {value!r}") from None
        if out[key] < 0 or (out[key] == 0 and key not in ("gpus_per_process", "replica_parallel")):
            raise InputError(f"--checkpoint_assume: {key} must be positive, not {value!r}")
    if "replica_parallel" in out:
        out["replica_parallel"] = bool(out["replica_parallel"])
    return out


def _checkpoint_table(rows: list[dict]) -> str:
    gb = 1e9
    a = rows[0]["assumptions"] if rows else {}
    width = max((len(r["layout"]) for r in rows), default=6)
    lines = ["checkpoint (planner prediction; array bytes, zstd not counted): nodes of "
             f"{a.get('gpus_per_node')} GPUs, processes of {a.get('gpus_per_process')}; persistent file system "
             f"{a.get('persistent_gbps'):g} GB/s in all, {a.get('node_persistent_gbps'):g} GB/s per node, orbax "
             f"replica-parallel {'on' if a.get('replica_parallel') else 'off'}; local disk "
             f"{a.get('local_write_gbps'):g} GB/s, peer link {a.get('peer_link_gbps'):g} GB/s per node",
             f"  {'GPUs':>4s} {'':9s} {'layout':{width}s} {'total TB':>8s} {'persist. GB/node':>16s} {'save s':>7s} "
             f"{'local GB/node':>13s} {'peer s':>7s} {'local s':>7s}"]
    for r in rows:
        lines.append(f"  {r['gpus']:4d} {r['which']:9s} {r['layout']:{width}s} {r['total_bytes'] / 1e12:8.2f} "
                     f"{r['persistent_node_bytes'] / gb:16.1f} {r['persistent_save_s']:7.1f} "
                     f"{r['local_disk_bytes'] / gb:13.1f} {r['peer_send_s']:7.2f} {r['local_write_s']:7.1f}")
    lines.append("  persist. GB/node: the most one node writes to the shared directory; save s: the slower of the "
                 "file system and that node's link")
    lines.append("  local GB/node: the node's own shards and one peer node's copy (the local tier); peer s: sending "
                 "its own to the peer; local s: writing both to the local disk")
    return "\n".join(lines)


def _split(text: str) -> list[str]:
    """A flag's comma-separated list: 'a, b,' -> ['a', 'b']."""
    return [x.strip() for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    sys.exit(main())
