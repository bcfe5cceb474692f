"""The loss per token and perplexity of a loaded model on token data, per source and overall, computed by the
training loop's own held-out evaluation: the same data pipeline (packed windows, each process reading its rows of
every batch), the same compiled eval step (program/step.py: every MoE layer dropless, exact) on the same mesh.

How batches combine. The eval step returns a batch's mean cross-entropy over its predicted tokens (targets inside
the row and the same document; packing leaves batches with unequal counts), so a source's `loss` weights each
batch by its predicted tokens: sum(mean_b x tokens_b) / sum(tokens_b), the mean over every predicted token. The
overall loss is the same over all sources' batches (sources weighted by their tokens, not by data.corpus weights).
The training loop's Evaluator averages its batch means unweighted; that number is reported as `batch_mean_loss`
per source and, for the model's own data (`corpora=None`, eval split), as `training_eval_loss`: what
metrics.jsonl logs as eval_loss at the checkpoint's step (the loop's mixed held-out batches; with one source,
that source's batches).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import validate
from moejax.data.pipeline import eval_batches
from moejax.data.shards import DataError
from moejax.data.sources import check_data_config, open_sources
from moejax.errors import InputError
from moejax.inference.load import LoadedModel
from moejax.model.loss import target_mask
from moejax.parallel.mesh import batch_sharding
from moejax.program.state import TrainState
from moejax.program.step import jit_eval_step

SPLITS = ("eval", "train")


def evaluate_model(loaded: LoadedModel, corpora: list[str] | None = None, *, split: str = "eval",
                   seq_len: int | None = None, global_batch: int | None = None,
                   max_batches: int | None = None) -> dict:
    """Loss per token and perplexity of `loaded` on `corpora` (token directories written by `moejax-data
    tokenize`, or "stdlib"), each evaluated on its own; None: the data the model's config trained on
    (data.corpus). split: "eval" (default) reads each source's held-out split, as the training loop's eval does;
    "train" its train split, in order (not shuffled). seq_len, global_batch (rows per batch, all processes
    together) and max_batches (per source; 0: every batch of the split) default to the config's train.seq_len,
    train.global_batch and train.eval_batches: the training loop's held-out evaluation.

    Returns {"model", "step", "split", "seq_len", "global_batch", "max_batches", "mesh", "seconds",
    "sources": [{"source", "tokens", "batches", "loss", "perplexity", "batch_mean_loss"}, ...],
    "overall": {"tokens", "batches", "loss", "perplexity"}} and, for corpora=None on the eval split,
    "training_eval_loss" (see the module's docstring for how batches are combined); "seconds" is the evaluation's
    wall time, compiles included. Raises InputError for a
    batch shape the mesh does not fit, data that cannot be read or does not fit the model's vocabulary, and a
    source with no full batch in the split."""
    cfg = loaded.cfg
    if split not in SPLITS:
        raise InputError(f"split={split!r}: one of {', '.join(SPLITS)}")
    seq_len = int(seq_len or cfg.train.seq_len)
    global_batch = int(global_batch or cfg.train.global_batch)
    max_batches = int(cfg.train.eval_batches if max_batches is None else max_batches)
    if max_batches < 0:
        raise InputError(f"max_batches={max_batches}: 0 (every batch) or more")
    _check_batch_shape(cfg, loaded.mesh, seq_len, global_batch)
    sources = _open(cfg, corpora)
    if split == "train":
        sources = [dataclasses.replace(s, eval=s.train) for s in sources]

    start = time.perf_counter()
    run = _BatchRunner(loaded)
    read = dict(seq_len=seq_len, global_batch=global_batch, n_batches=max_batches or sys.maxsize,
                vocab_size=int(cfg.model.vocab_size), process_index=jax.process_index(),
                process_count=jax.process_count())
    per_source, all_losses, all_tokens = [], [], []
    for source in sources:
        batches = eval_batches([source], **read)
        if not batches:
            raise DataError(f"data source {source.name} has no full batch in its {split} split ({global_batch} rows "
                            f"of {seq_len + 1} tokens)" + ("; try split 'train'" if split == "eval" else ""))
        losses, tokens = run(batches)
        per_source.append({"source": source.name, **_summary(losses, tokens),
                           "batch_mean_loss": _mean_of_batch_means(losses)})
        all_losses += losses
        all_tokens += tokens
    result = {"model": loaded.source, "step": loaded.step, "split": split, "seq_len": seq_len,
              "global_batch": global_batch, "max_batches": max_batches, "mesh": dict(loaded.mesh.shape),
              "sources": per_source, "overall": _summary(all_losses, all_tokens)}
    if corpora is None and split == "eval":
        # The loop evaluates the sources mixed by their weights; one source's batches are the mix itself.
        mixed = per_source[0]["batch_mean_loss"] if len(sources) == 1 else _mean_of_batch_means(
            run(eval_batches(sources, **read))[0])
        result["training_eval_loss"] = mixed
    result["seconds"] = time.perf_counter() - start
    return result


def _check_batch_shape(cfg, mesh, seq_len: int, global_batch: int):
    """The checks a training run of this batch shape makes on this mesh (batch over the batch axes, sequence
    within model.max_seq_len and over mesh.context); ConfigError names the field."""
    shaped = cfg.copy_and_resolve_references()
    with shaped.unlocked():
        shaped.train.seq_len, shaped.train.global_batch = seq_len, global_batch
    validate(shaped, mesh.devices.size)


def _data_configs(cfg, corpora: list[str] | None) -> list:
    """One data config per source to evaluate on its own (None: the config's data.corpus, opened as training does)."""
    if corpora is None:
        return [cfg.data]
    if not corpora:
        raise DataError("no data given: name token directories (moejax-data tokenize writes them) or 'stdlib'")
    configs = []
    for corpus in corpora:
        data_cfg = cfg.data.copy_and_resolve_references()
        with data_cfg.unlocked():
            data_cfg.corpus = str(corpus)
        configs.append(data_cfg)
    return configs


def check_corpora(cfg, corpora: list[str] | None):
    """The cheap checks of the data (paths and indexes exist, data/sources.py's check_data_config), for before a
    model is restored; evaluate_model opens every file and checks the ids against the vocabulary."""
    for data_cfg in _data_configs(cfg, corpora):
        check_data_config(data_cfg, vocab_size=int(cfg.model.vocab_size))


def _open(cfg, corpora: list[str] | None) -> list:
    """The opened sources (data/sources.py; every file checked, the ids against the model's vocabulary)."""
    return [s for data_cfg in _data_configs(cfg, corpora)
            for s in open_sources(data_cfg, vocab_size=int(cfg.model.vocab_size))]


def _summary(losses: list[float], tokens: list[int]) -> dict:
    total = int(sum(tokens))
    loss = sum(float(l) * n for l, n in zip(losses, tokens)) / max(total, 1)  # float64: no rounding of the sums
    return {"tokens": total, "batches": len(losses), "loss": loss, "perplexity": _perplexity(loss)}


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def _mean_of_batch_means(losses: list[np.float32]) -> float:
    """The training loop's held-out number (training/evaluator.py): the unweighted mean of the batches' means,
    in the same float32 arithmetic."""
    return float(np.mean(losses))


class _BatchRunner:
    """Batches -> (each batch's mean cross-entropy, each batch's predicted-token count), on the loaded mesh."""

    def __init__(self, loaded: LoadedModel):
        mesh = loaded.mesh
        graphdef, params, model_state = nnx.split(loaded.model, nnx.Param, ...)
        replicated = NamedSharding(mesh, P())
        # The eval step takes a TrainState; inference holds no optimizer state.
        self.state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params,
                                model_state=model_state, opt_state=())
        shardings = jax.tree.map(lambda a: a.sharding, self.state)
        self.mesh, self.sharding = mesh, batch_sharding(mesh)
        self.eval_fn = jit_eval_step(graphdef, mesh, shardings)
        self.count_fn = jax.jit(lambda segments: jnp.sum(target_mask(segments, 0)), out_shardings=replicated)

    def __call__(self, batches: list[dict]) -> tuple[list, list[int]]:
        losses, counts = [], []
        with jax.set_mesh(self.mesh):
            for batch in batches:
                on_mesh = {k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in batch.items()}
                losses.append(self.eval_fn(self.state, on_mesh))
                counts.append(self.count_fn(on_mesh["segment_ids"]))
        return list(jax.device_get(losses)), [int(n) for n in jax.device_get(counts)]
