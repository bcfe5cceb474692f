"""The next token from a row's logits: greedy, or sampled with temperature, top-k and top-p (nucleus), applied in
that order as transformers' `generate` applies its logits processors."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
    """temperature 0: greedy (argmax; top_k and top_p ignored). top_k 0 and top_p 1.0: off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self, vocab_size: int) -> None:
        """ValueError, one line, for a setting that cannot sample."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), not {self.temperature}")
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, {vocab_size}] (0: off), not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), not {self.top_p}")


def filtered_logits(logits_BxV, s: Sampling):
    """The logits sampling draws from: divided by the temperature, those outside the top k and outside the smallest
    set whose probability reaches top_p set to -inf (the most likely token always stays)."""
    logits_BxV = logits_BxV.astype(jnp.float32) / s.temperature
    if s.top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, s.top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if s.top_p < 1:
        order_BxV = jnp.argsort(-logits_BxV, axis=-1)
        sorted_BxV = jnp.take_along_axis(logits_BxV, order_BxV, axis=-1)
        # Probability mass strictly before each sorted token: a token is kept while that is below top_p.
        before_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1) - jax.nn.softmax(sorted_BxV, axis=-1)
        drop_sorted = before_BxV >= s.top_p
        drop_BxV = jnp.zeros_like(drop_sorted).at[jnp.arange(drop_sorted.shape[0])[:, None], order_BxV].set(drop_sorted)
        logits_BxV = jnp.where(drop_BxV, -jnp.inf, logits_BxV)
    return logits_BxV


def next_token(logits_BxV, s: Sampling, key):
    """[B] int32: argmax for temperature 0, else a draw from the filtered logits."""
    if s.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_BxV, s), axis=-1).astype(jnp.int32)
