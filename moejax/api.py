"""The Python API for launch scripts: what the command-line tools do, as functions, errors as exceptions.

    import moejax
    cfg = moejax.load_config("configs/tiny.py", {"train.steps": 50, "optim.lr": 1e-3})
    last = moejax.train(cfg, "runs/lr1e-3")          # the last logged metrics record
    report = moejax.dry_run(cfg)                     # compile for an emulated mesh, XLA vs the planner
    ranked = moejax.plan(cfg, topology="gb300-nvl72", gpus=[256, 1024])   # or gpus=256

The same checks run as in `moejax-train`, in the same order, before anything compiles or is written.
Errors: `moejax.InputError` (a bad config, data, checkpoint or weights directory; the CLI's exit 2, with
nothing in WORKDIR overwritten), `moejax.NonFiniteLoss` (exit 3), `moejax.Stopped` (a stop signal after a
checkpoint was saved; exit 128 + signal), `moejax.DistributedError` (could not join the job; exit 4).

This module composes the layers below it and is imported only by the entry points (`moejax/__init__.py`,
`moejax/cli/`). Heavy modules are imported inside the functions, so `import moejax` stays light and the
emulated device count can still be set before jax starts its backends.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_collections

from moejax.config import MESH_AXES, REMAT_POLICIES, ConfigError, validate
from moejax.config.fields import set_field
from moejax.config.ranges import check_choice, check_ranges, integer, number
from moejax.errors import InputError
from moejax.kernels.resolve import apply_kernels, devices_compute_capability, devices_platform
from moejax.parallel.cpu_devices import has_device_count_flag as _has_device_count_flag
from moejax.parallel.cpu_devices import mesh_device_count
from moejax.parallel.cpu_devices import request_cpu_devices as _request_cpu_devices
from moejax.parallel.xla_gpu_flags import add_overlap_flags
from moejax.parallel.xla_gpu_flags import describe as describe_xla_flags


# ---------------------------------------------------------------------------------------------- configs


def load_config(path, overrides: Mapping[str, object] | None = None) -> ml_collections.ConfigDict:
    """The config a file's `get_config()` returns, with `overrides` ({"train.steps": 50, ...}) applied and the
    config locked, as `--config FILE --config.train.steps=50` gives. An unknown field, a value of the wrong
    type or a file that cannot be loaded raises ConfigError."""
    path, argument = Path(path), None
    if not path.is_file() and ":" in path.name:  # FILE:ARG passes ARG to get_config, as --config FILE:ARG does
        name, argument = path.name.split(":", 1)
        path = path.with_name(name)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"moejax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        cfg = module.get_config() if argument is None else module.get_config(argument)
    except Exception as e:  # noqa: BLE001 - a user's file may raise anything; the message says which
        raise ConfigError(f"cannot load config {path}: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() must return an ml_collections.ConfigDict")
    cfg.lock()
    for key, value in (overrides or {}).items():
        set_field(cfg, key, value)
    return cfg


def check_config(cfg, n_devices: int) -> dict[str, int]:
    """Every check a run makes before anything compiles; returns the resolved mesh shape. The config's own
    (moejax.config.validate), then the facts that live elsewhere: the topology name (parallel), wandb installed
    when the run logs to W&B (training), the data (data), the weights directory to start from (interop)."""
    from moejax.data.sources import check_data_config
    from moejax.interop.weights_dir import check_weights_dir
    from moejax.parallel.topology import check_topology_name
    from moejax.training.wandb_logger import check_wandb_installed

    sizes = validate(cfg, n_devices)
    check_topology_name(cfg.mesh.topology)
    check_wandb_installed(cfg.observability.wandb)
    check_data_config(cfg.data, vocab_size=cfg.model.vocab_size)
    if cfg.checkpoint.init_from:
        check_weights_dir(cfg.checkpoint.init_from)
    return sizes


def check_model_config(cfg) -> None:
    """validate() where no device count is known (moejax-plan, moejax.plan): the -1 mesh axis counts as 1, so the
    model and run fields are checked, not whether the mesh fits some device count."""
    validate(cfg, math.prod(max(1, int(cfg.mesh[a])) for a in MESH_AXES))


# --------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class PreparedRun:
    """A run that passed every check: the job is joined, WORKDIR exists, nothing is compiled yet."""

    cfg: ml_collections.ConfigDict
    workdir: Path
    mesh_sizes: dict[str, int]
    sources: list
    emulated_cpu_devices: int  # > 0: no accelerator was found and this many CPU devices emulate the mesh
    kernels: str  # the kernels `auto` resolved to, as printed: "kernels on gpu: attention=tokamax_mosaic (auto), ..."
    xla_flags: str = ""  # on GPUs: the XLA:GPU overlap flags in effect, as printed (parallel/xla_gpu_flags.py)


def prepare_training(cfg, workdir, *, coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, init_timeout: int = 300) -> PreparedRun:
    """Joins the job (multi-process: arguments, JAX_* variables, SLURM or Open MPI), checks the config, the
    processes' agreement, the data and WORKDIR's checkpoints, then creates WORKDIR. Raises InputError
    before anything is written, DistributedError when the job cannot be joined."""
    check_ranges(cfg)  # needs no device: a NaN or out-of-range number is refused before jax starts or the job joins
    import jax
    from jax._src import xla_bridge  # backends_are_initialized: no public equivalent

    from moejax.data.sources import open_sources
    from moejax.training import distributed
    from moejax.training.resume_point import check_resumable, set_aside_passed_over

    # A laptop just works: when jax has not started and no device count is set, ask for the config's mesh in
    # CPU devices. The flag only shapes the CPU backend, so on a GPU or TPU machine it changes nothing.
    emulated = 0
    if not xla_bridge.backends_are_initialized() and not _has_device_count_flag():
        emulated = mesh_device_count(cfg.mesh)
        _request_cpu_devices(emulated)
    overlap_flags = add_overlap_flags() if not xla_bridge.backends_are_initialized() else None
    distributed.initialize(coordinator, num_processes, process_id, init_timeout)
    if jax.devices()[0].platform != "cpu":
        emulated = 0
    try:
        mesh_sizes = check_config(cfg, jax.device_count())
    except ConfigError as e:
        if jax.device_count() == 1 and jax.devices()[0].platform == "cpu":
            raise ConfigError(f"{e} (one CPU device: set XLA_FLAGS=--xla_force_host_platform_device_count=8 to "
                              "emulate a mesh)") from None
        raise
    # The mesh is built from all of jax.devices(): their platform picks the kernels, written into cfg so that
    # config.json (and every process's agreement check below) names what runs.
    kernels = apply_kernels(cfg, devices_platform(jax.devices()), devices_compute_capability(jax.devices()))
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise InputError(f"--workdir {workdir} exists and is not a directory")
    config_json = cfg.to_json_best_effort(sort_keys=True)
    distributed.check_processes_agree(config_json, init_timeout)
    sources = open_sources(cfg.data, vocab_size=cfg.model.vocab_size)
    resume = check_resumable(workdir, config_json, cfg.checkpoint.on_bad_checkpoint)
    if jax.process_count() > 1:
        # Every process has inspected WORKDIR/checkpoints before any creates it: otherwise a late process finds
        # the directory process 0 just made and enters orbax's barriers of a read-only manager while process 0
        # waits in the create barrier (a mismatched-barrier crash seen under load).
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("moejax: workdir inspected")
    if jax.process_index() == 0:
        for line in set_aside_passed_over(workdir, resume):  # damaged newer checkpoints moved out of orbax's way
            print(f"warning: {line}", file=sys.stderr, flush=True)
        workdir.mkdir(parents=True, exist_ok=True)  # config.json is written once the checkpoint restored
    if resume is not None and resume.passed_over and jax.process_count() > 1:
        multihost_utils.sync_global_devices("moejax: damaged checkpoints set aside")  # before any opens its manager
    on_gpu = devices_platform(jax.devices()) == "gpu"
    return PreparedRun(cfg, workdir, mesh_sizes, sources, emulated, kernels,
                       describe_xla_flags(overlap_flags) if on_gpu and overlap_flags else "")


def run_training(run: PreparedRun) -> dict:
    """Trains (or resumes) a prepared run; returns the last logged metrics record (read back from
    WORKDIR/metrics.jsonl when the run was already complete and this call trained no step)."""
    import json

    from moejax.training.loop import train as train_loop

    last = train_loop(run.cfg, run.workdir, run.mesh_sizes, run.sources)
    metrics = run.workdir / "metrics.jsonl"
    if not last and metrics.exists():
        lines = metrics.read_text().splitlines()
        last = json.loads(lines[-1]) if lines else {}
    return last


def train(cfg, workdir, **join) -> dict:
    """`moejax-train --config ... --workdir WORKDIR` as a function: prepare_training (keyword arguments:
    coordinator, num_processes, process_id, init_timeout), then run_training. Returns the last logged
    metrics record (step, loss, lr, grad_norm, step_time_s, tokens_per_s, tflops_per_device, mfu, ...)."""
    return run_training(prepare_training(cfg, workdir, **join))


# ---------------------------------------------------------------------------------------------- planning


# The checks of dry_run()'s and plan()'s arguments; moejax-train and moejax-plan parse their flags' text and pass
# them here.
_COUNT = integer(1)
_EFFICIENCY = number(0, 1, above=True, note="the fraction of the bf16 dense peak the GEMMs reach")
_DOMAIN_SIZE = integer(0, note="0: whole domains")
_MEM_FRACTION = number(0, 1, above=True, note="XLA_PYTHON_CLIENT_MEM_FRACTION: the allocator's share of a GPU's memory")


def emulate_cpu_devices(n_devices: int) -> None:
    """Makes this process see n_devices CPU devices if jax has not started its backends yet; otherwise
    checks that it already sees at least that many (the count cannot change once jax started)."""
    import jax
    from jax._src import xla_bridge  # backends_are_initialized: no public equivalent

    if not xla_bridge.backends_are_initialized():
        _request_cpu_devices(n_devices)
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
    if jax.device_count() < n_devices:
        raise InputError(f"the dry run needs {n_devices} devices but this process already started jax with "
                         f"{jax.device_count()}; call moejax.dry_run before anything else uses jax")


def dry_run(cfg, n_devices: int | None = None, target: str | None = None, mem_fraction: float | None = None) -> dict:
    """Compiles the real training step for an emulated mesh of n_devices CPU devices (default:
    mesh_device_count of the config) with abstract state, and returns XLA's per-device memory, FLOPs and collectives next to the
    planner's prediction (what `moejax-train --dry_run` prints and writes to dry_run.json). mem_fraction (with a
    GPU target): compile with the scheduler budget of a GPU run at XLA_PYTHON_CLIENT_MEM_FRACTION=mem_fraction and
    say whether the program fits that allocator."""
    if mem_fraction is not None:
        if not target:
            raise InputError(f"mem_fraction={mem_fraction!r} needs a GPU target (an XLA:CPU compile has no scheduler "
                             "budget)")
        mem_fraction = float(_MEM_FRACTION.check("mem_fraction", mem_fraction, InputError))
    n = _COUNT.check("n_devices", n_devices, InputError) if n_devices else mesh_device_count(cfg.mesh)
    validate(cfg, n)  # before the device count is fixed for this process
    if target:  # a GPU compile without a GPU: XLA:GPU through jax's CUDA plugin, compile-only devices
        from moejax.planner.gpu_targets import check_gpu_compile_installed, get_target, prepare_process_for_gpu_compile

        gpu = get_target(target)
        check_gpu_compile_installed(gpu)
        gpu.topology_string(n)  # device count vs hosts and NVLink domains, before jax starts
        prepare_process_for_gpu_compile()
        overlap_flags = add_overlap_flags()  # what a GPU run of this config compiles with
    else:
        emulate_cpu_devices(n)
    from moejax.planner.dry_run import dry_run as compile_and_compare

    report = compile_and_compare(cfg, n, target, mem_fraction=mem_fraction)
    if target:
        report["xla_gpu_flags"] = overlap_flags
    return report


def _one_or_more(name: str, value, *, may_be_empty: bool = False) -> list[tuple[str, object]]:
    """(label, item) of an argument given as one value or a list/tuple of them: gpus=256 -> [("gpus", 256)],
    gpus=[256, 512] -> [("gpus[0]", 256), ("gpus[1]", 512)]. A string is one value, not a list of characters."""
    if not isinstance(value, (list, tuple, range)):
        return [(name, value)]
    if not value and not may_be_empty:
        raise InputError(f"{name}={value!r}: give one value or a non-empty list of them")
    return [(f"{name}[{i}]", v) for i, v in enumerate(value)]


def plan(cfg, *, topology: str, gpus: int | Sequence[int], efficiency: float = 0.5, domain_size: int = 0,
         remats: str | Sequence[str] = REMAT_POLICIES, dispatches: str | Sequence[str] | None = None, top: int = 5,
         candidates: str | Sequence[str] = (), mem_fraction: float | None = None) -> dict:
    """`moejax-plan --topology T --gpus N,...`: the layouts that fit at each GPU count, ranked by predicted
    step time, with the scaling between counts and the assumptions made. Nothing is compiled. mem_fraction: the
    share of each GPU's memory the run gives XLA's allocator (XLA_PYTHON_CLIENT_MEM_FRACTION; None: what moejax's
    launch scripts set), the base of XLA:GPU's scheduler budget. gpus, remats,
    dispatches (None: the config's) and candidates (layouts to rank and explain, e.g. "pp=2,vp=8,ep=32,data=4")
    take one value or a list/tuple of them. Every argument is checked here (moejax-plan only parses its flags'
    text) and the config as moejax-plan checks it; the first bad one raises InputError, in one line."""
    from moejax.config import DISPATCH_MODES
    from moejax.parallel.topology import TOPOLOGIES, TopologyError, get_topology
    from moejax.planner.search import parse_layout, plan as search

    if not isinstance(topology, str):
        raise TopologyError(f"topology={topology!r} is not a topology name; known: {', '.join(TOPOLOGIES)}")
    topo = get_topology(topology)
    gpus = [int(_COUNT.check(label, g, InputError)) for label, g in _one_or_more("gpus", gpus)]
    efficiency = float(_EFFICIENCY.check("efficiency", efficiency, InputError))
    domain_size = int(_DOMAIN_SIZE.check("domain_size", domain_size, InputError))
    remats = tuple(check_choice(label, r, REMAT_POLICIES, InputError) for label, r in _one_or_more("remats", remats))
    if dispatches is not None:
        dispatches = tuple(check_choice(label, d, DISPATCH_MODES, InputError)
                           for label, d in _one_or_more("dispatches", dispatches))
    top = int(_COUNT.check("top", top, InputError))
    from moejax.parallel.xla_gpu_flags import LAUNCH_MEM_FRACTION

    mem_fraction = LAUNCH_MEM_FRACTION if mem_fraction is None else float(
        _MEM_FRACTION.check("mem_fraction", mem_fraction, InputError))
    layouts = []
    for label, text in _one_or_more("candidates", candidates, may_be_empty=True):
        if not isinstance(text, str):
            raise InputError(f"{label}={text!r} is not a layout like 'pp=2,vp=8,ep=32,data=4,remat=full,mb=1'")
        layouts.append(parse_layout(text))
        if layouts[-1].n_devices not in gpus:
            raise InputError(f"layout {text!r} uses {layouts[-1].n_devices} GPUs, a count not in gpus={gpus}")
    check_model_config(cfg)
    return search(cfg, topo, gpus, efficiency=efficiency, domain_size=domain_size, remats=remats,
                  dispatches=dispatches, top=top, candidates=tuple(layouts), mem_fraction=mem_fraction)


# --------------------------------------------------------------------------------------------- inference


def load_for_inference(path, overrides: Mapping[str, object] | None = None, **join):
    """moejax.inference.load.load_for_inference: the saved model at `path` on its config's mesh, emulated in CPU
    devices without an accelerator, in a joined job (keyword arguments coordinator, num_processes, process_id,
    init_timeout)."""
    from moejax.inference.load import load_for_inference as load

    return load(path, overrides, **join)


def evaluate(path, data: str | Sequence[str] | None = None, *, split: str = "eval", seq_len: int | None = None,
             global_batch: int | None = None, max_batches: int | None = None,
             overrides: Mapping[str, object] | None = None, **join) -> dict:
    """`moejax-eval PATH --data DIR ...` as a function: the loss per token and perplexity of the saved model at
    `path` on token directories (`data`; None: the data its config trained on), per source and overall
    (moejax.inference.evaluate.evaluate_model says how batches combine). split "eval" (the held-out split, as the
    training loop evaluates) or "train"; seq_len, global_batch and max_batches (per source; 0: all) default to the
    config's train.seq_len, train.global_batch and train.eval_batches. Keyword arguments coordinator, num_processes,
    process_id, init_timeout join a multi-process job (load_for_inference). On a run's WORKDIR with no other
    argument, `training_eval_loss` is the loop's eval_loss at the checkpoint's step."""
    from moejax.inference.evaluate import check_corpora, evaluate_model
    from moejax.inference.saved_model import find_saved_model, inference_config

    corpora = [str(data)] if isinstance(data, (str, Path)) else None if data is None else [str(d) for d in data]
    saved = find_saved_model(path)
    check_corpora(inference_config(saved, overrides), corpora)  # a data path's typo found before anything restores
    loaded = load_for_inference(saved, overrides, **join)
    return evaluate_model(loaded, corpora, split=split, seq_len=seq_len, global_batch=global_batch,
                          max_batches=max_batches)


def generate(path, prompts: Sequence[str | Sequence[int]] = (), *, corpus_prompts: int = 0, tokenizer: str | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids: Sequence[int] = (), seed: int = 0, overrides: Mapping[str, object] | None = None,
             **join) -> dict:
    """`moejax-generate PATH --prompt TEXT ...` as a function: new text for each prompt (text, or a list of token
    ids) from the saved model at `path`, all prompts in one batch, with a KV cache on the model's mesh
    (moejax.inference.generate). corpus_prompts=N adds the start of the first N held-out documents of its training
    data. Greedy for temperature 0, else sampled (top_k 0 and top_p 1: off), reproducibly from `seed`. A row ends at
    the tokenizer's end token or a `stop_ids` token (included in "tokens", left out of "completion"), after
    max_new_tokens, or at the model's positions. Returns {"model", "mesh", "prompts", "new_tokens",
    "prefill_tokens_per_s", "decode_tokens_per_s", "samples": [{"prompt", "completion", "tokens", "finish"}]}.
    Raises InputError (a path that names no model, a tokenizer that does not match it, no or an empty prompt, one
    longer than the model's positions), DistributedError."""
    from moejax.inference.generate import generate_ids
    from moejax.inference.prompts import corpus_prompts as held_out_prompts
    from moejax.inference.prompts import tokenizer_for
    from moejax.inference.sampling import Sampling
    from moejax.inference.saved_model import find_saved_model, inference_config

    saved = find_saved_model(path)
    cfg = inference_config(saved, overrides)
    tok = tokenizer_for(cfg, saved.directory if saved.kind == "hf" else None, tokenizer)  # before anything restores
    ids = [tok.encode_prompt(p).tolist() if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    if corpus_prompts:
        ids += held_out_prompts(cfg, int(corpus_prompts))
    if not ids:
        raise InputError("no prompt: give one (--prompt, --prompt_file) or take some from the data (--corpus_prompts)")
    loaded = load_for_inference(saved, overrides, **join)
    stops = [tok.eos_id, *(int(t) for t in stop_ids)]
    gen = generate_ids(loaded.model, ids, max_new_tokens=int(max_new_tokens),
                       sampling=Sampling(float(temperature), int(top_k), float(top_p)), stop_ids=stops, seed=int(seed),
                       mesh=loaded.mesh, max_positions=int(loaded.cfg.model.max_seq_len))
    samples = [{"prompt": tok.decode(p), "completion": tok.decode([t for t in new if t not in stops]), "tokens": new,
                "finish": finish} for p, new, finish in zip(ids, gen.tokens, gen.finish)]
    return {"model": loaded.source, "mesh": dict(loaded.mesh.shape), "prompts": len(ids),
            "new_tokens": gen.new_tokens, "prefill_tokens_per_s": gen.prompt_tokens / max(gen.prefill_s, 1e-9),
            "decode_tokens_per_s": gen.new_tokens / max(gen.decode_s, 1e-9), "samples": samples}
