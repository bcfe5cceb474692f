"""Batched generation with a KV cache: prompts of different lengths in one batch, greedy or sampled, stop tokens,
a cap on new tokens, on one device or on the mesh the model's parameters are sharded on (the MoE layers through the
training dispatch: expert-parallel decode).

Two compiled programs per shape: the prefill (every prompt at once, right-padded to the longest, from an empty
cache; each row's first new token drawn from its last prompt position) and the decode loop (a `lax.while_loop` of
one-token steps that ends when every row has stopped or the cap is reached: no host round trip per token). Rows
are padded to a multiple of the mesh's batch shards and cache lengths rounded up to a multiple of 64, so that
similar requests share compiles.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.errors import InputError
from moejax.inference.sampling import Sampling, next_token
from moejax.parallel.mesh import batch_sharding, row_shards

_LENGTH_QUANTUM = 64  # cache lengths are rounded up to this: requests of similar length reuse one compile


class GenerateError(InputError, ValueError):
    """A request generation cannot serve (empty prompt, too long for the model's positions, bad sampling)."""


class Generation(NamedTuple):
    tokens: list[list[int]]  # per prompt: the new tokens, the stop token included where one ended the row
    finish: list[str]  # per prompt: "stop" (a stop token), "length" (max_new_tokens or the model's positions)
    prompt_tokens: int
    new_tokens: int
    prefill_s: float  # wall time of the prefill (compiled before timing)
    decode_s: float  # wall time of the decode loop


def check_mesh(mesh) -> None:
    """Generation runs on meshes without pipeline stages or a context split (load_model builds such a mesh)."""
    if mesh is None:
        return
    for axis in ("stage", "context"):
        if mesh.shape.get(axis, 1) > 1:
            raise GenerateError(f"generation needs mesh.{axis}=1 (this mesh has {axis}={mesh.shape[axis]}); override "
                                f"it (--config.mesh.{axis}=1) and give its devices to data or expert")


def _prefill(state, tokens_BxP, lengths_B, key, *, graphdef, cache_len: int, sampling: Sampling):
    """(first new token [B], the cache with every prompt written)."""
    model = nnx.merge(graphdef, state)
    rows, width = tokens_BxP.shape
    positions_BxP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    logits_BxPxV, cache = model.decode(tokens_BxP, positions_BxP, model.empty_cache(rows, cache_len))
    last_BxV = logits_BxPxV[jnp.arange(rows), lengths_B - 1]
    return next_token(last_BxV, sampling, jax.random.fold_in(key, 0)), cache


def _decode_loop(state, first_B, cache, lengths_B, key, *, graphdef, n_new: int, sampling: Sampling,
                 stop_ids: tuple[int, ...]):
    """([B, n_new] new tokens, [B] how many each row emitted, [B] whether a stop token ended it)."""
    rows = first_B.shape[0]
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def running(carry):
        i, _, _, _, _, done_B, _ = carry
        return (i < n_new) & ~jnp.all(done_B)

    def step(carry):
        i, token_B, cache, out_BxN, count_B, done_B, state = carry
        out_BxN = out_BxN.at[:, i].set(jnp.where(done_B, 0, token_B))
        count_B = count_B + (~done_B).astype(jnp.int32)
        done_B = done_B | jnp.isin(token_B, stops)
        # The token just emitted goes in at its position (prompt length + i); its logits give the next one. The last
        # iteration's step is not needed, but stays inside the cache (positions < prompt + n_new).
        # The parameters ride in the carry: nnx refuses to scan a module whose values belong to an outer trace.
        model = nnx.merge(graphdef, state)
        logits_Bx1xV, cache = model.decode(token_B[:, None], (lengths_B + i)[:, None], cache)
        token_B = next_token(logits_Bx1xV[:, 0], sampling, jax.random.fold_in(key, i + 1))
        return i + 1, token_B, cache, out_BxN, count_B, done_B, state

    init = (jnp.int32(0), first_B, cache, jnp.zeros((rows, n_new), jnp.int32), jnp.zeros(rows, jnp.int32),
            jnp.zeros(rows, bool), state)
    _, _, _, out_BxN, count_B, done_B, _ = jax.lax.while_loop(running, step, init)
    return out_BxN, count_B, done_B


@functools.lru_cache(maxsize=32)
def _compiled(graphdef, fn, **static):
    return jax.jit(functools.partial(fn, graphdef=graphdef, **static))


def generate_ids(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_ids: Sequence[int] = (), seed: int = 0, mesh=None, max_positions: int | None = None,
                 pad_id: int = 0) -> Generation:
    """New tokens for each prompt (lists of ids, any lengths >= 1). `model`: a moejax Transformer, its parameters
    on `mesh`'s devices (or one device with mesh None); `max_positions`: the model's positions (model.max_seq_len),
    which prompt + new tokens never pass (a row that reaches it ends with finish "length")."""
    if not prompts:
        raise GenerateError("no prompts")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise GenerateError(f"prompt {lengths.index(0)} is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
    longest = max(lengths)
    if max_positions is not None:
        if longest >= max_positions:
            raise GenerateError(f"prompt {lengths.index(longest)} has {longest} tokens: the model has {max_positions} "
                                f"positions (model.max_seq_len), so a prompt may have at most {max_positions - 1}")
        max_new_tokens = min(max_new_tokens, max_positions - longest)
    vocab = model.head_DxV.shape[-1]
    try:
        sampling.check(vocab)
    except ValueError as e:
        raise GenerateError(str(e)) from None
    bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab]
    if bad:
        raise GenerateError(f"token id {bad[0]} is outside the model's vocabulary of {vocab}")
    check_mesh(mesh)

    rows = len(prompts)
    shards = 1 if mesh is None else row_shards(mesh)
    padded_rows = -(-rows // shards) * shards
    cache_len = -(-(longest + max_new_tokens) // _LENGTH_QUANTUM) * _LENGTH_QUANTUM
    if max_positions is not None:
        cache_len = min(cache_len, max_positions)
    width = min(-(-longest // _LENGTH_QUANTUM) * _LENGTH_QUANTUM, cache_len)  # prefill width, also rounded
    tokens_BxP = np.full((padded_rows, width), pad_id, np.int32)
    lengths_B = np.ones(padded_rows, np.int32)  # padding rows: one pad token, their output dropped
    for r, p in enumerate(prompts):
        tokens_BxP[r, : len(p)] = p
        lengths_B[r] = len(p)

    graphdef, state = nnx.split(model)
    prefill = _compiled(graphdef, _prefill, cache_len=cache_len, sampling=sampling)
    decode = _compiled(graphdef, _decode_loop, n_new=max_new_tokens, sampling=sampling,
                       stop_ids=tuple(int(t) for t in stop_ids))
    key = jax.random.key(seed)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        if mesh is not None:
            tokens_BxP = jax.device_put(tokens_BxP, batch_sharding(mesh))
            lengths_B = jax.device_put(lengths_B, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        prefill_c = prefill.lower(state, tokens_BxP, lengths_B, key).compile()
        start = time.perf_counter()
        first_B, cache = jax.block_until_ready(prefill_c(state, tokens_BxP, lengths_B, key))
        prefill_s = time.perf_counter() - start
        decode_c = decode.lower(state, first_B, cache, lengths_B, key).compile()
        start = time.perf_counter()
        out_BxN, count_B, done_B = jax.device_get(decode_c(state, first_B, cache, lengths_B, key))
        decode_s = time.perf_counter() - start

    tokens = [out_BxN[r, : count_B[r]].tolist() for r in range(rows)]
    finish = ["stop" if done_B[r] else "length" for r in range(rows)]
    return Generation(tokens, finish, sum(lengths), sum(len(t) for t in tokens), prefill_s, decode_s)
