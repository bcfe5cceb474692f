"""The tile-loop grouped GEMM (CPU dropless default) equals each row through its own expert (a per-row dense
reference): forward and every gradient, whatever the rows' order, with tiles past the load never run and rows
in no tile left at zero."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import grouped_gemm

ROWS, TILE, N_TILES, D, F, E = 40, 8, 8, 16, 24, 3


def tiles_for(expert_R):
    """(src_S, tile_expert_N, n_used): each expert's rows (in row order) padded to whole tiles, experts in order;
    padding slots hold ROWS. expert_R == E: a row in no tile. The tiles past the load hold real rows with the
    wrong expert: were they run, those rows' outputs would change."""
    src, tile_expert = [], []
    for e in range(E):
        rows = list(np.flatnonzero(expert_R == e))
        rows += [ROWS] * (-len(rows) % TILE)
        src += rows
        tile_expert += [e] * (len(rows) // TILE)
    n_used = len(tile_expert)
    src += [r % ROWS for r in range(N_TILES * TILE - len(src))]
    tile_expert += [(int(expert_R[0]) + 1) % E] * (N_TILES - n_used)
    return jnp.asarray(src, jnp.int32), jnp.asarray(tile_expert, jnp.int32), jnp.int32(n_used)


def reference(x_RxD, expert_R, w_gate, w_up, w_down):
    e = jnp.minimum(expert_R, E - 1)
    h = jax.nn.silu(jnp.einsum("rd,rdf->rf", x_RxD, w_gate[e])) * jnp.einsum("rd,rdf->rf", x_RxD, w_up[e])
    return jnp.where((expert_R < E)[:, None], jnp.einsum("rf,rfd->rd", h, w_down[e]), 0)


@pytest.mark.parametrize("load", ["every row", "some rows in no tile", "no row"])
def test_tile_loop_equals_each_row_through_its_expert(load):
    rng = np.random.default_rng(len(load))
    expert_R = {"every row": rng.integers(0, E, ROWS), "some rows in no tile": rng.integers(0, E + 1, ROWS),
                "no row": np.full(ROWS, E)}[load]
    src_S, tile_expert_N, n_used = tiles_for(expert_R)
    assert int(n_used) < N_TILES, "some tiles must lie past the load"
    k = jax.random.split(jax.random.key(len(load)), 5)
    x_RxD, cot_RxD = jax.random.normal(k[0], (ROWS, D)), jax.random.normal(k[1], (ROWS, D))
    weights = tuple(0.3 * jax.random.normal(kk, s) for kk, s in zip(k[2:], ((E, D, F), (E, D, F), (E, F, D))))

    def looped(x, *w):
        return grouped_gemm.looped_expert_ffn(x, src_S, tile_expert_N, n_used, *w)

    y = jax.jit(looped)(x_RxD, *weights)
    np.testing.assert_allclose(y, reference(x_RxD, jnp.asarray(expert_R), *weights), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(y)[expert_R == E]), "rows in no tile come out zero"
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(looped(*a) * cot_RxD), argnums=(0, 1, 2, 3)))(x_RxD, *weights)
    ref_grads = jax.grad(lambda x, *w: jnp.sum(reference(x, jnp.asarray(expert_R), *w) * cot_RxD),
                         argnums=(0, 1, 2, 3))(x_RxD, *weights)
    for g, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(13, 0, 19), (0, 0, 0), (40, 0, 0), (1, 30, 2)],
                         ids=["ragged", "no-rows", "one-group-all-rows", "many-chunks"])
def test_tiled_weight_grad_equals_each_groups_x_transpose_dy(sizes):
    """The Blackwell weight gradient of the tokamax path (tiled GEMMs in chunks of E tiles, only the chunks holding
    rows run): each group's x^T dy over its own rows, rows past the groups ignored. Tiles of 4 rows: 'many-chunks'
    needs 9 tiles (3 chunks of 3), 'one-group-all-rows' 10 tiles of one group spread over 4 chunks."""
    kx, kd = jax.random.split(jax.random.key(sum(sizes)))
    x_RxD, dy_RxF = jax.random.normal(kx, (ROWS, D)), jax.random.normal(kd, (ROWS, F))
    sizes_E = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda *a: grouped_gemm.tiled_weight_grad(*a, tile=4))(x_RxD, dy_RxF, sizes_E)
    bounds = np.cumsum((0,) + sizes)
    want = np.stack([np.asarray(x_RxD)[a:b].T @ np.asarray(dy_RxF)[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
