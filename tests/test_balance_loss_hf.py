"""The batch-wise balance loss is transformers' `load_balancing_loss_func` (Mixtral, Qwen3-MoE) on the same
router logits, so `moe.batch_aux_loss_coef` is their `router_aux_loss_coef` unconverted.

The router logits of every MoE layer are recomputed here, independently of the training forward pass, by
running the stacked blocks one at a time and applying each layer's router weights to its normed input; the
model's own outputs are checked against that re-run, so the logits given to transformers are the ones moejax
routed with. moejax in f32; the logits go to torch as float64 and as float32 (transformers' function keeps
its sums in float32 either way).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_lb  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_lb  # noqa: E402

import moejax  # noqa: E402
from moejax.config import validate  # noqa: E402
from moejax.model.loss import batch_balance_loss, lm_loss  # noqa: E402
from moejax.model.router import Router  # noqa: E402
from moejax.parallel.mesh import batch_sharding, make_mesh  # noqa: E402
from moejax.program.state import create_model, state_shardings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ = 8, 16
TIGHT = 1e-5


def tiny(name, **overrides):
    """A configs/ CPU model, never dropping (transformers' blocks are dropless), no remat, and a router init
    wide enough that no top-k choice is a near-tie between f32 and float64."""
    base = {"moe.capacity_factor": 0.0, "model.remat": "none", "model.init_std": 0.2,
            "train.global_batch": BATCH, "train.seq_len": SEQ}
    return moejax.load_config(ROOT / "configs" / f"{name}.py", {**base, **overrides})


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, 259, size=(BATCH, SEQ + 1), dtype=np.int32)


def router_logits_by_layer(model, tokens_BxL):
    """[n_moe, B*L, E] router logits, from the stacked MoE blocks run one layer at a time (no scan), and the
    LM logits of that re-run."""
    batch, seq = tokens_BxL.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    x = model.embed(tokens_BxL, model.dtype)
    assert model.dense_layers is None
    graphdef, stacked = nnx.split(model.moe_layers)
    logits = []
    for i in range(model.n_moe):
        block = nnx.merge(graphdef, jax.tree.map(lambda v: v[i], stacked))
        h = x + block.attn(block.attn_norm(x), positions, None)
        u = block.ffn_norm(h)
        w = block.ffn.router.w_DxE[...]
        logits.append(jnp.einsum("bld,de->ble", u.astype(jnp.float32), w.astype(jnp.float32)).reshape(batch * seq, -1))
        x, _ = block(x, positions, None)
    return jnp.stack(logits), model.logits(model.final_norm(x))


def hf_loss(logits_RxTxE, n_experts, top_k, fn=mixtral_lb, dtype=torch.float64):
    layers = tuple(torch.tensor(np.asarray(l), dtype=dtype) for l in logits_RxTxE)
    return float(fn(layers, n_experts, top_k))


def old_definition(logits_RxTxE, top_k):
    """The previous moejax batch_aux: per layer sum_e (E * load_e / (K*T)) * mean prob_e, summed over layers."""
    probs = jax.nn.softmax(logits_RxTxE, axis=-1)
    n_experts = probs.shape[-1]
    chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(probs, top_k)[1], n_experts), axis=-2)
    f = jnp.mean(chosen, axis=1) * n_experts / top_k
    return float(jnp.sum(jnp.sum(f * jnp.mean(probs, axis=1), axis=-1)))


def moejax_forward(cfg, toks, seed=3):
    model = create_model(cfg, seed)
    total, parts = nnx.jit(lambda m, t: lm_loss(m, t))(model, jnp.asarray(toks))
    return model, total, parts


@pytest.mark.parametrize("name,fn", [("tiny_mixtral", mixtral_lb), ("tiny_qwen3_moe", qwen3_lb)],
                         ids=["mixtral", "qwen3_moe"])
def test_batch_aux_loss_equals_transformers_load_balancing_loss(name, fn):
    cfg = tiny(name, **{"mesh.data": 1, "mesh.expert": 1})
    e = cfg.moe
    assert e.score_func == "softmax" and e.bias_update_rate == 0.0 and e.seq_aux_loss_coef == 0.0
    toks = tokens(1)
    model, total, parts = moejax_forward(cfg, toks)
    logits_RxTxE, lm_logits = router_logits_by_layer(model, jnp.asarray(toks[:, :-1]))
    # The re-run is the training forward pass: same LM logits, same routing, same probabilities.
    out = model(jnp.asarray(toks[:, :-1]))
    np.testing.assert_allclose(lm_logits, out.logits_BxLxV, rtol=1e-4, atol=1e-4)  # f32, 4 layers, scan vs loop
    probs = jax.nn.softmax(logits_RxTxE, axis=-1)
    chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(probs, e.top_k)[1], e.n_routed_experts), axis=-2)
    np.testing.assert_array_equal(parts.stats.tokens_per_expert_E, jnp.sum(chosen, axis=1))
    np.testing.assert_allclose(parts.stats.router_prob_E, jnp.mean(probs, axis=1), rtol=1e-5, atol=1e-7)

    expected = hf_loss(logits_RxTxE, e.n_routed_experts, e.top_k, fn)
    got = float(jnp.mean(parts.stats.batch_aux_loss))  # what train_step logs as batch_aux_loss
    np.testing.assert_allclose(got, expected, rtol=TIGHT)
    # The torch f32 path of transformers gives the same number.
    np.testing.assert_allclose(got, hf_loss(logits_RxTxE, e.n_routed_experts, e.top_k, fn, torch.float32), rtol=TIGHT)
    # The weighted term is router_aux_loss_coef * that loss, and it is all of aux (seq and z coefficients are 0).
    np.testing.assert_allclose(float(parts.aux), e.batch_aux_loss_coef * expected, rtol=TIGHT)
    np.testing.assert_allclose(float(jnp.sum(parts.stats.aux_loss)), float(parts.aux), rtol=TIGHT)
    np.testing.assert_allclose(float(total), float(parts.ce) + float(parts.aux), rtol=TIGHT)
    print(f"{name}: moejax {got:.8f}  transformers {expected:.8f}  rel diff {abs(got - expected) / expected:.2e}")


def test_old_per_layer_sum_over_top_k_is_not_the_published_loss():
    """6 layers, top-2: the old definition (per-layer value / top_k, summed over layers) is ~n_layers/top_k = 3x
    transformers' loss, which this implementation matches."""
    cfg = tiny("tiny_mixtral", **{"mesh.data": 1, "mesh.expert": 1, "model.n_layers": 6})
    assert cfg.moe.top_k == 2
    toks = tokens(2)
    model, _, parts = moejax_forward(cfg, toks)
    logits_RxTxE, _ = router_logits_by_layer(model, jnp.asarray(toks[:, :-1]))
    expected = hf_loss(logits_RxTxE, cfg.moe.n_routed_experts, cfg.moe.top_k)
    got = float(jnp.mean(parts.stats.batch_aux_loss))
    np.testing.assert_allclose(got, expected, rtol=TIGHT)
    old = old_definition(logits_RxTxE, cfg.moe.top_k)
    assert 2.5 < old / expected < 3.5, (old, expected)
    print(f"6 layers, top-2: moejax {got:.8f}  transformers {expected:.8f}  old definition {old:.8f} "
          f"({old / expected:.2f}x)")
    # Nor is it the sum of the per-layer transformers losses (~6x).
    per_layer = [hf_loss(logits_RxTxE[i : i + 1], cfg.moe.n_routed_experts, cfg.moe.top_k) for i in range(6)]
    assert abs(sum(per_layer) / expected - 6) < 0.5
    np.testing.assert_allclose(parts.stats.batch_aux_loss.shape, (6,))


def test_gradient_matches_transformers_autograd():
    """Router weight gradients of the model-wide loss: moejax's per-layer stats vs torch autograd through
    transformers' function, three routers on fixed inputs (so only the loss's own path is differentiated)."""
    cfg = tiny("tiny_mixtral").moe
    n_layers, d_model = 3, 16
    split = [nnx.split(Router(d_model, cfg, rngs=nnx.Rngs(i), std=0.5)) for i in range(n_layers)]
    graphdef, states = split[0][0], [state for _, state in split]
    xs = jax.random.normal(jax.random.key(0), (n_layers, 4, 8, d_model))

    def loss(states):
        loads, probs = [], []
        for i, state in enumerate(states):
            routing = nnx.merge(graphdef, state)(xs[i])
            chosen = jnp.sum(jax.nn.one_hot(routing.expert_idx_BxLxK, cfg.n_routed_experts), axis=-2)
            loads.append(jnp.mean(chosen, axis=(0, 1)))
            probs.append(routing.prob_E)
        return jnp.mean(batch_balance_loss(jnp.stack(loads), jnp.stack(probs)))

    value, grads = jax.value_and_grad(loss)(states)
    ws = np.stack([np.asarray(state["w_DxE"][...]) for state in states])
    grad = np.stack([np.asarray(g["w_DxE"][...]) for g in grads])
    w_t = torch.tensor(np.asarray(ws), dtype=torch.float64, requires_grad=True)
    x_t = torch.tensor(np.asarray(xs), dtype=torch.float64)
    ref = mixtral_lb(tuple((x_t[i] @ w_t[i]).reshape(-1, cfg.n_routed_experts) for i in range(n_layers)),
                     cfg.n_routed_experts, cfg.top_k)
    ref.backward()
    np.testing.assert_allclose(float(value), ref.item(), rtol=TIGHT)
    np.testing.assert_allclose(grad, w_t.grad.numpy(), rtol=1e-4, atol=1e-7)


def sharded_loss(cfg, devices, toks):
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    graphdef, params, model_state = nnx.split(create_model(cfg, 3), nnx.Param, ...)
    params = jax.device_put(params, state_shardings(params, mesh))
    model_state = jax.device_put(model_state, state_shardings(model_state, mesh))

    def f(params, model_state, toks):
        def balance(p, s):  # model_state too: nnx wants every variable of a module at one trace level
            total, parts = lm_loss(nnx.merge(graphdef, p, s), toks)
            return parts.aux, (total, parts)

        # Gradients of the balance term alone, so the cross-entropy's do not swamp them.
        grad_fn = jax.value_and_grad(balance, argnums=(0, 1), has_aux=True)
        (aux, (total, parts)), (grads, _) = grad_fn(params, model_state)
        return total, aux, jnp.mean(parts.stats.batch_aux_loss), grads

    with jax.set_mesh(mesh):
        out = jax.jit(f)(params, model_state, jax.device_put(jnp.asarray(toks), batch_sharding(mesh)))
    total, aux, batch_aux, grads = jax.device_get(out)
    return total, aux, batch_aux, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_sharded_batch_aux_equals_single_device_and_transformers(devices, dispatch):
    toks = tokens(3)
    over = {"moe.dispatch": dispatch, "model.n_layers": 3}
    single = sharded_loss(tiny("tiny_mixtral", **over, **{"mesh.data": 1, "mesh.expert": 1}), devices[:1], toks)
    multi = sharded_loss(tiny("tiny_mixtral", **over, **{"mesh.data": 2, "mesh.expert": 4}), devices, toks)
    for name, a, b in zip(("total", "aux", "batch_aux"), multi[:3], single[:3]):
        np.testing.assert_allclose(a, b, rtol=TIGHT, err_msg=name)
    router_grad = lambda g: g["moe_layers"]["ffn"]["router"]["w_DxE"]  # noqa: E731
    scale = np.abs(router_grad(single[3])).max()
    np.testing.assert_allclose(router_grad(multi[3]), router_grad(single[3]), rtol=1e-4, atol=1e-5 * scale)
    assert np.abs(router_grad(single[3])).max() > 0

    cfg = tiny("tiny_mixtral", **over, **{"mesh.data": 1, "mesh.expert": 1})
    model = create_model(cfg, 3)
    logits_RxTxE, _ = router_logits_by_layer(model, jnp.asarray(toks[:, :-1]))
    np.testing.assert_allclose(multi[2], hf_loss(logits_RxTxE, cfg.moe.n_routed_experts, cfg.moe.top_k), rtol=TIGHT)
