"""The tile-loop grouped GEMM (CPU dropless default) equals the static block-diagonal tiles it skips work of:
forward and every gradient, tiles past the load left out (zero output, no gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import grouped_gemm

N_TILES, TILE, D, F, E = 6, 8, 16, 24, 3


def operands(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    x_SxD = jax.random.normal(k[0], (N_TILES * TILE, D))
    weights = tuple(0.3 * jax.random.normal(kk, shape)
                    for kk, shape in zip(k[1:4], ((E, D, F), (E, D, F), (E, F, D))))
    cot_SxD = jax.random.normal(k[4], x_SxD.shape)
    return x_SxD, weights, cot_SxD


@pytest.mark.parametrize("n_used", [6, 4, 0])
def test_tile_loop_equals_static_tiles_and_skips_the_tiles_past_the_load(n_used):
    x_SxD, weights, cot_SxD = operands(n_used)
    tile_expert_N = jnp.array([0, 0, 2, 1, 1, 1], jnp.int32)  # tiles sorted by expert, expert groups of any size
    used_S = (jnp.arange(N_TILES * TILE) < n_used * TILE)[:, None]

    def looped(x, *w):
        return jnp.sum(grouped_gemm.looped_expert_ffn(x, tile_expert_N, jnp.int32(n_used), *w) * cot_SxD)

    def static(x, *w):  # the reference: every tile through its expert, the unused ones' rows zeroed first
        y = grouped_gemm.tiled_expert_ffn(jnp.where(used_S, x, 0).reshape(N_TILES, TILE, D), tile_expert_N, *w)
        return jnp.sum(y.reshape(-1, D) * cot_SxD)

    y = jax.jit(lambda x, *w: grouped_gemm.looped_expert_ffn(x, tile_expert_N, jnp.int32(n_used), *w))(x_SxD, *weights)
    assert not np.any(np.asarray(y)[n_used * TILE:]), "tiles past the load must come out zero"
    value, grads = jax.jit(jax.value_and_grad(looped, argnums=(0, 1, 2, 3)))(x_SxD, *weights)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(static, argnums=(0, 1, 2, 3)))(x_SxD, *weights)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    for g, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(grads[0])[n_used * TILE:]), "no gradient for rows of tiles past the load"

