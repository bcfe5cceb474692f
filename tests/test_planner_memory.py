"""The planner's memory terms that the saved residuals alone miss (planner/activations.py), on abstract
shapes (nothing compiled or allocated): the loss over the vocabulary, the [B, H, L, L] scores of the XLA
reference attention, and MoE dispatch buffers sized for the layout's expert parallelism.
tests/test_plan_vs_xla.py checks the totals against XLA's compiled memory."""

import math
import runpy
from pathlib import Path

import numpy as np

from moejax.config import default_config
from moejax.parallel.dispatch import capacity_per_expert
from moejax.parallel.dropless import window_rows, worst_case_rows
from moejax.planner import activations
from moejax.planner.activations import activation_terms, trace_config
from moejax.planner.layout import Layout
from moejax.planner.memory import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
F32 = 4


def small(dispatch="capacity", seq=128):
    c = default_config()
    m, e = c.model, c.moe
    m.d_model, m.n_layers, m.first_k_dense, m.n_heads, m.head_dim, m.d_ff = 64, 3, 1, 4, 16, 128
    e.n_routed_experts, e.top_k, e.d_ff_expert, e.capacity_factor, e.dispatch = 16, 4, 32, 1.25, dispatch
    c.train.global_batch, c.train.seq_len = 16, seq
    return c


def _block_residuals(cfg, micro_batch, ep, remat="none", platform="gpu"):
    """(global shape, itemsize) of one MoE block's residuals, as the planner traces them."""
    c = trace_config(cfg, remat=remat, platform=platform)
    return activations._block(c.to_json_best_effort(sort_keys=True), True, micro_batch, int(c.train.seq_len), ep,
                              remat)


def _block_shapes(cfg, micro_batch, ep, remat="none", platform="gpu"):
    return [s for s, _ in _block_residuals(cfg, micro_batch, ep, remat, platform)]


def test_logits_and_log_softmax_of_every_head():
    """Dense loss kernel: [micro_batch, seq, vocab] f32 logits and log-softmax per head (main + MTP), one head's
    f32 cotangent and its logits' gradient; the log-softmax is not counted twice (it is a saved residual too).
    Chunked (the default): one chunk's f32 logits and bf16 gradient (XLA:CPU also keeps the f32 softmax and
    gradient), and no [B, L, V] residual."""
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_small.py"))["get_config"]()
    cfg.model.vocab_size, cfg.model.dtype = 1024, "bfloat16"
    mb, seq = 2, int(cfg.train.seq_len)
    heads = 1 + cfg.model.mtp_depth
    cfg.kernels.loss_chunk = 32
    for tensor in (1, 2):
        a = activation_terms(cfg, mb, seq, "full", tensor=tensor)
        assert a.logits == mb * 32 * (1024 // tensor) * (F32 + 2)  # GPU: f32 logits, bf16 gradient
        cpu = activation_terms(cfg, mb, seq, "full", tensor=tensor, platform="cpu")
        assert cpu.logits == mb * 32 * (1024 // tensor) * (F32 + 2 + F32 + F32)  # + the f32 softmax and gradient
    c = trace_config(cfg, remat="full")
    saved = activations._saved(c.to_json_best_effort(sort_keys=True), mb, seq, 1)
    assert not [s for s, size in saved if s and s[-1] == 1024], saved
    cfg.kernels.loss = "dense"
    for tensor in (1, 2):
        a = activation_terms(cfg, mb, seq, "full", tensor=tensor)
        assert a.logits == mb * seq * (1024 // tensor) * (heads * (F32 + F32) + F32 + 2)
    c = trace_config(cfg, remat="full")
    saved = activations._saved(c.to_json_best_effort(sort_keys=True), mb, seq, 1)
    assert not [s for s, size in saved if s and s[-1] == 1024 and size == F32], saved
    # In the estimate the loss and the layers' backward (their gradients, one block live) are different phases: the
    # larger one counts.
    mem = estimate_memory(cfg, Layout(2, 1, 4, 1, "full", mb, cfg.moe.dispatch))
    assert mem.backward == mem.activations + max(mem.logits, mem.grads + mem.layer_live + mem.layer_transient)
    assert mem.total == mem.params + mem.opt_state + max(mem.backward, mem.optimizer)


def test_attention_scores_of_the_reference_attention_are_a_block_transient():
    """jax.nn.dot_product_attention's XLA implementation (the CPU kernel) holds [B, H, L, L] f32 scores: none
    saved under full remat, rematerialised in the block's backward, quadratic in the sequence. A fused GPU kernel
    (traced with a flash kernel's residuals) keeps no [L, L] buffer: its block transient is linear in L."""
    mb, heads = 2, 4
    scores = [(s, size) for s, size in _block_residuals(small(seq=256), mb, 1, platform="cpu") if s[-2:] == (256, 256)]
    assert scores and all(math.prod(s) == mb * heads * 256 * 256 for s, _ in scores), scores
    assert sum(size == F32 for _, size in scores) >= 2, scores  # f32 scores and probabilities (and the mask)
    t = {seq: activation_terms(small(seq=seq), mb, seq, "full", platform="cpu").layer for seq in (128, 256)}
    # Everything else in the block is linear in the sequence: the difference is the [L, L] part.
    quadratic = sum(size for _, size in scores) * mb * heads * (256**2 - 2 * 128**2)
    assert abs((t[256] - 2 * t[128]) / quadratic - 1) < 0.05, (t, quadratic)
    # Split over tensor with the heads.
    assert activation_terms(small(seq=256), mb, 256, "full", tensor=2, platform="cpu").layer < t[256]
    assert not [s for s, _ in _block_residuals(small(seq=256), mb, 1, platform="gpu") if s[-2:] == (256, 256)]
    gpu = {seq: activation_terms(small(seq=seq), mb, seq, "full", platform="gpu").layer for seq in (128, 256)}
    assert abs(gpu[256] / (2 * gpu[128]) - 1) < 1e-3, gpu  # linear, up to O(experts) statistics


def test_dropless_receive_buffers_are_sized_by_the_window_not_the_worst_case():
    """A dropless device receives rows in rounds of a window (moe.dropless_window x T*K), so its buffers are the
    window's, not the worst case ep x T x min(K, E_local): the trace runs the MoE on an abstract mesh of the
    layout's expert axis, and the transient barely grows with ep (it grew ~4x with worst-case buffers)."""
    mb, seq, k, n_exp = 2, 128, 4, 16
    tokens = mb * seq
    cfg = small("dropless")
    window = float(cfg.moe.dropless_window)
    for ep in (1, 4):
        rows = window_rows(tokens, k, ep, n_exp // ep, window)
        # Received rows [R, D] per device; shard_map's residuals are stacked over the ep devices of the mesh.
        shapes = _block_shapes(cfg, mb, ep)
        assert (ep * rows, 64) in shapes, (ep, rows)
        if ep > 1:
            assert (ep * worst_case_rows(tokens, k, ep, n_exp // ep), 64) not in shapes
    assert window_rows(tokens, k, 4, 4, window) == int(np.ceil(window * tokens * k))
    t1 = activation_terms(cfg, mb, seq, "full", expert=1).layer
    t4 = activation_terms(cfg, mb, seq, "full", expert=4).layer
    assert t4 / t1 < 1.5, (t1, t4)
    # Capacity dispatch receives E_local x ep x C = E x C rows at any ep: the per-device size barely moves.
    cap = small("capacity")
    c1, c4 = (activation_terms(cap, mb, seq, "full", expert=ep).layer for ep in (1, 4))
    assert abs(c4 / c1 - 1) < 0.25, (c1, c4)
    assert (n_exp * capacity_per_expert(tokens, k, n_exp, 1.25), 64) in [
        (int(np.prod(s[:-1])) // 4, s[-1]) for s in _block_shapes(cap, mb, 4) if s]
    # The memory estimate follows the layout's expert axis and dispatch mode.
    lay = dict(data=1, fsdp=1, tensor=1, remat="full", micro_batch=mb)
    assert (estimate_memory(cap, Layout(expert=4, dispatch="dropless", **lay)).layer_transient
            - estimate_memory(cap, Layout(expert=1, dispatch="dropless", **lay)).layer_transient) == t4 - t1


def test_saved_residuals_at_expert_parallelism_from_the_blocks():
    """The planner traces the whole model once per micro-batch and policy and adds what expert parallelism
    changes inside each MoE block; under remat that equals tracing the whole model on the ep mesh."""
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_small.py"))["get_config"]()
    for dispatch in ("capacity", "dropless"):
        for remat in ("dots", "full"):
            c = trace_config(cfg, remat=remat, dispatch=dispatch)
            weights = {leaf.shape: leaf for leaf in activations.state_leaves(c)[0]}
            direct = activations._bytes(activations._saved(c.to_json_best_effort(sort_keys=True), 2, 128, 4),
                                        int(c.model.d_model), 4, 1, weights)
            fast = activation_terms(cfg, 2, 128, remat, expert=4, dispatch=dispatch).saved
            assert abs(fast / direct - 1) < 1e-3, (dispatch, remat, direct, fast)
