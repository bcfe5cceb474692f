"""The planner's model of context parallelism (mesh.context, parallel/context.py; planner/context.py): the residuals
of a context-split block, the memory, collective and compute terms against hand computation at context 2 and 4, the
search over context sizes and its NVLink-domain rule, `cp=` in --layout, context 1 unchanged, and DeepSeek-V3
671B's 128K context-extension stage fitting 256 GB300s. From the config alone (abstract traces, nothing compiled)."""

import collections
import math
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from moejax.config import MESH_AXES
from moejax.model.layer_stack import _remat
from moejax.model.transformer import Block
from moejax.parallel.context import ContextQueries
from moejax.parallel.topology import get_topology
from moejax.planner.activations import activation_terms, trace_config
from moejax.planner.comm import link_split, step_traffic, wire_bytes
from moejax.planner.context import (CONTEXT_MIN_LOCAL_POSITIONS, CONTEXT_MIN_SEQ_LEN, attention_layers,
                                    gathered_values_per_token, saved_kv_values_per_token)
from moejax.planner.layout import Layout, in_domain_factors
from moejax.planner.memory import estimate_memory
from moejax.planner.predict import enumerate_layouts, predict
from moejax.planner.search import parse_layout

ROOT = Path(__file__).resolve().parents[1]
BF16 = 2


def small_mla(seq=256):
    """DeepSeek-V3-shaped, bf16: MLA with kv_lora 32, rope 16, nope 32, v 32 and 4 heads; 4 layers (1 dense) + 1 MTP."""
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_small.py"))["get_config"]()
    cfg.model.dtype = "bfloat16"
    cfg.model.max_seq_len = max(seq, int(cfg.model.max_seq_len))
    cfg.train.global_batch, cfg.train.seq_len = 16, seq
    return cfg


def small_gqa():
    cfg = small_mla()
    m = cfg.model
    m.attention, m.n_heads, m.n_kv_heads, m.head_dim = "gqa", 4, 2, 16
    return cfg


def _block_residuals(cfg, remat: str, context: int, mb: int, seq: int, platform="gpu") -> collections.Counter:
    """(global shape, dtype) of a dense block's residuals, traced with its sequence split over `context` on an
    abstract mesh (the model's context path: gathered latent, queries over key ranges); int index arrays left out."""
    c = trace_config(cfg, remat=remat, platform=platform)
    c.model.param_dtype = c.model.dtype
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Block(c, moe=False, rngs=nnx.Rngs(0))), nnx.Param, ...)
    body = _remat(lambda block, x, positions, documents: block(x, positions, documents), remat)

    def run(params, rest, x, positions):
        documents = ContextQueries(positions, positions) if context > 1 else positions
        return body(nnx.merge(graphdef, params, rest), x, positions, documents)[0]

    sizes = {a: (context if a == "context" else 1) for a in MESH_AXES}
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    x = jax.ShapeDtypeStruct((mb, seq, int(c.model.d_model)), jnp.bfloat16)
    positions = jax.ShapeDtypeStruct((mb, seq), jnp.int32)
    weights = {(tuple(p.shape), jnp.dtype(p.dtype)) for p in jax.tree.leaves(params)}
    from jax._src.ad_checkpoint import saved_residuals

    with jax.sharding.use_abstract_mesh(mesh):
        return collections.Counter(
            (tuple(a.shape), a.dtype.name) for a, source in saved_residuals(run, params, rest, x, positions)
            if "from the argument" not in source and a.dtype != jnp.int32
            and (tuple(a.shape), jnp.dtype(a.dtype)) not in weights)


@pytest.mark.parametrize("remat", ["none", "dots", "attention", "full"])
def test_a_context_split_block_keeps_the_unsplit_blocks_residuals_and_the_kv_side_the_planner_charges(remat):
    """Traced with its sequence split over context 2, a block keeps the residuals (global shapes) of the unsplit
    block: the K/V side is computed from the gathered latent, so each device holds it for the whole sequence, the
    rest for its own positions. The K/V-side residuals planner/context.py charges per position are among them."""
    cfg, mb, seq, context = small_mla(), 2, 64, 2
    split, whole = _block_residuals(cfg, remat, context, mb, seq), _block_residuals(cfg, remat, 1, mb, seq)
    # The K/V side is built inside attention's shard_map from the gathered latent: its residuals come out stacked over
    # the context devices, [C mb, L, ...] (one whole-sequence copy per device: what the planner charges per device).
    per_device = collections.Counter()
    for (shape, dtype), n in split.items():
        stacked = len(shape) > 2 and shape[0] == context * mb and shape[1] == seq
        per_device[((mb, *shape[1:]) if stacked else shape, dtype)] += n
    assert per_device == whole
    # none: the gathered latent (the expansion's input), k (32 no-RoPE + 16 RoPE values per head), v; dots: the
    # expansion's outputs k_nope and v; the other policies keep none of them
    kv = {"none": [((mb, seq, 32), 1), ((mb, seq, 4, 48), 1), ((mb, seq, 4, 32), 1)],
          "dots": [((mb, seq, 4, 32), 2)]}.get(remat, [])
    for shape, n in kv:
        assert whole[(shape, "bfloat16")] >= n, (shape, whole)
    assert saved_kv_values_per_token(cfg.model, 1, remat) == sum(n * math.prod(s[2:]) for s, n in kv)


@pytest.mark.parametrize("context", [2, 4])
@pytest.mark.parametrize("remat", ["none", "dots", "attention", "full"])
def test_activation_terms_at_context_c_by_hand(context, remat):
    """Traced at the L / C positions a device holds, plus per attention layer (4 decoder layers + 1 MTP) the other
    shards' positions of the saved K/V side, and for the layer being differentiated the rematerialised rest of it at
    those positions and the whole sequence's K/V gradients."""
    cfg, mb, seq = small_mla(), 2, 256
    for tensor, expert in ((1, 1), (2, 2)):
        heads = 4 // tensor
        local = activation_terms(cfg, mb, seq // context, remat, tensor=tensor, expert=expert)
        cp = activation_terms(cfg, mb, seq, remat, tensor=tensor, expert=expert, context=context)
        others = mb * (seq - seq // context)
        kept = {"none": 32 + heads * (32 + 16 + 32), "dots": heads * (32 + 32)}.get(remat, 0)
        assert cp.saved == local.saved + attention_layers(cfg.model) * others * kept * BF16
        assert cp.moe_layer == local.moe_layer + others * kept * BF16
        assert (cp.layer, cp.logits) == (local.layer, local.logits)
        rematerialised = 32 + heads * (32 + 16 + 32) - kept
        gradients = heads * (32 + 16 + 32) + 32 + 16  # dk, dv and the gathered latent + RoPE key's gradient
        assert cp.context_kv == (others * rematerialised + mb * seq * gradients) * BF16
    # no context split: nothing added
    assert activation_terms(cfg, mb, seq, remat, context=1).context_kv == 0


def test_gqa_gathers_and_keeps_its_kv_heads():
    cfg, mb, seq, c = small_gqa(), 2, 256, 2
    assert gathered_values_per_token(cfg.model, 1) == 2 * 2 * 16  # K and V, 2 heads of 16
    assert gathered_values_per_token(cfg.model, 2) == 2 * 1 * 16  # the kv heads split over tensor
    others = mb * (seq - seq // c)
    for remat, kept in (("none", 64), ("dots", 0), ("full", 0)):
        local = activation_terms(cfg, mb, seq // c, remat)
        cp = activation_terms(cfg, mb, seq, remat, context=c)
        assert cp.saved - local.saved == attention_layers(cfg.model) * others * kept * BF16
        assert cp.context_kv == (others * (64 - kept) + mb * seq * 64) * BF16


def test_reference_attention_scores_each_local_query_against_the_whole_sequence():
    """XLA's attention (CPU) holds [B, H, L / C, L] scores: C x the [L / C, L / C] of a trace at L / C."""
    cfg, mb, seq, c = small_mla(seq=512), 2, 512, 2  # L / C is not d_model (128): no [.., L, D] look-alike
    local = activation_terms(cfg, mb, seq // c, "full", platform="cpu")
    cp = activation_terms(cfg, mb, seq, "full", platform="cpu", context=c)
    block = _block_residuals(cfg, "none", 1, mb, seq // c, platform="cpu")
    scores = sum(n * math.prod(s) * jnp.dtype(t).itemsize for (s, t), n in block.items()
                 if s[-2:] == (seq // c, seq // c))
    assert scores > 0 and cp.layer - local.layer == (c - 1) * scores


def test_memory_estimate_follows_the_layout_context():
    cfg = small_mla()
    flat = Layout(1, 2, 2, 1, "full", 2, "dropless")
    split = Layout(1, 2, 2, 1, "full", 2, "dropless", context=2)
    m1, m2 = estimate_memory(cfg, flat), estimate_memory(cfg, split)
    # parameters and optimizer state are replicated over context: the same per device
    assert (m2.params, m2.opt_state, m2.grads) == (m1.params, m1.opt_state, m1.grads)
    assert m2.activations < m1.activations and m2.context_kv > 0 == m1.context_kv
    assert m2.backward == m2.grad_accumulator + m2.activations + max(
        m2.logits, m2.grads + m2.layer_live + m2.layer_transient + m2.context_kv)


@pytest.mark.parametrize("context", [2, 4])
def test_context_collectives_by_hand(context):
    """Per attention layer and micro-batch: the whole sequence's latent + RoPE key (48 values a position, bf16)
    all-gathered over context (forward, and again under remat full) and reduce-scattered (backward); every token
    count is the device's L / C positions; gradients are summed over context too; all inside one domain."""
    cfg, seq = small_mla(), 256
    split = Layout(1, 2, 2, 1, "full", 2, "dropless", context=context)
    flat = Layout(1, 2, 2, 1, "full", 2, "dropless")
    n_micro = split.n_micro(16)  # 16 sequences over fsdp 2 x expert 2, 2 per micro-batch: 2
    traffic = step_traffic(cfg, split)
    gathers = [t for t in traffic if t.what.startswith("context gather")]
    assert [(t.kind, t.bytes, t.count) for t in gathers] == [
        ("all-gather", 2 * seq * 48 * BF16, 2 * 5 * n_micro), ("reduce-scatter", 2 * seq * 48 * BF16, 5 * n_micro)]
    none = [t for t in step_traffic(cfg, Layout(1, 2, 2, 1, "none", 2, "dropless", context=context))
            if t.what.startswith("context gather")]
    assert [t.count for t in none] == [5 * n_micro, 5 * n_micro]  # remat none keeps the gathered latent
    by_what = {t.what: t for t in step_traffic(cfg, flat)}
    exchange = [t for t in traffic if t.kind == "all-to-all"]
    assert exchange[0].bytes * context == by_what[exchange[0].what].bytes  # the device's L / C positions' rows
    # every gradient sum over the batch axes runs over context too; the routed experts' (data 1 here) over it alone
    sums = {t.what: t for t in traffic if t.what.startswith("grad sum [")}
    flat_sums = {t.what: t for t in step_traffic(cfg, flat) if t.what.startswith("grad sum [")}
    assert flat_sums and set(flat_sums) < set(sums)
    for what, t in flat_sums.items():
        assert (sums[what].axes, sums[what].bytes, sums[what].count) == (t.axes + ("context",), t.bytes, t.count)
    assert all(sums[w].axes == ("context",) and w.endswith(("_ExDxF']", "_ExFxD']")) for w in set(sums) - set(flat_sums))
    # context x expert inside a domain of 4 x context: the gathers never leave it
    domain = 2 * context
    assert in_domain_factors(split.sizes, domain)["context"] == context
    for t in gathers:
        assert link_split(t, split.sizes, domain) == (context, 1)
        w = wire_bytes(t, split.sizes, domain)
        assert w["nic"] == 0 and w["nvlink"] == pytest.approx(t.total * (context - 1) / context)


def test_prediction_exposes_the_gathers_and_adds_the_expansion():
    cfg, topo = small_mla(), get_topology("gb300-nvl72")
    lay = Layout(1, 2, 2, 1, "full", 2, "dropless", context=2)
    p = predict(cfg, topo, lay, efficiency=0.5, domain_size=8)
    gathers = sum(wire_bytes(t, lay.sizes, 8)["nvlink"] for t in step_traffic(cfg, lay)
                  if t.what.startswith("context gather"))
    assert p.context_gather_s == pytest.approx(gathers / topo.nvlink_bw) and p.exposed_comm_s >= p.context_gather_s
    # k_nope and v of 4 heads from the 32-wide latent for the other shard's 128 positions; fwd + 2 bwd GEMMs + the
    # recompute (remat full), 5 attention layers x 2 micro-batches of 2 sequences
    flops = 2 * 32 * 4 * (32 + 32) * 4 * 128 * 5 * 2 * 2
    assert p.context_overhead_s == pytest.approx(flops / (0.5 * topo.peak_bf16))
    dots = predict(cfg, topo, Layout(1, 2, 2, 1, "dots", 2, "dropless", context=2), efficiency=0.5, domain_size=8)
    assert dots.context_overhead_s == pytest.approx(p.context_overhead_s * 3 / 4)  # dots keeps the expansion


# Predictions of the planner before it knew about context parallelism (commit 560dac6), for layouts without it.
BEFORE = [
    (Layout(2, 1, 4, 1, "full", 2, "dropless"),
     {"params": 5629312, "opt_state": 5628804, "grads": 4387264, "grad_accumulator": 0, "activations": 2384412,
      "layer_transient": 11925990, "logits": 1081344, "layer_live": 2214656, "total": 32170438},
     {"nvlink": 22598976.0, "nic": 6580896.0}, 8.935174486225962e-05),
    (Layout(1, 2, 2, 2, "dots", 1, "capacity"),
     {"params": 2424192, "opt_state": 4847364, "grads": 2423680, "grad_accumulator": 2423680,
      "activations": 4258342, "layer_transient": 3270931, "logits": 270336, "layer_live": 1968896, "total": 21617085},
     {"nvlink": 90959360.0, "nic": 27076352.0}, 0.00037153915432345483),
    (Layout(1, 1, 4, 1, "none", 1, "capacity", 2, 1),
     {"params": 4521856, "opt_state": 9042948, "grads": 4521472, "grad_accumulator": 0, "activations": 79271284,
      "layer_transient": 0, "logits": 1081344, "layer_live": 2214656, "total": 99572216},
     {"nvlink": 34619136.0, "nic": 5229760.0}, 9.444415551828635e-05),
]


@pytest.mark.parametrize("case", range(len(BEFORE)))
def test_context_1_predictions_are_unchanged(case):
    """Every closed-form term, the wire bytes and the step time equal the planner's before context parallelism. The
    activation terms are traced (the residuals and one remat'd block's buffers as the installed jax traces them: the
    first layout's block transient was 11,925,990 bytes on jax 0.10.2, 12,974,566 on 0.12.0.1, 12,995,558 on 0.12.1;
    the third layout's saved activations 79,271,284 on 0.12.0.1, 79,231,348 on 0.12.1), so they must equal that trace
    at the layout's micro-batch with no context (the saved residuals where no pipeline stages rearrange them), stay
    near the values of before (not a pinned byte count of one release), and the total moves with them."""
    layout, memory, wire, step_s = BEFORE[case]
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_small.py"))["get_config"]()
    cfg.train.global_batch, cfg.train.seq_len = 16, 256
    p = predict(cfg, get_topology("gb300-nvl72"), layout, efficiency=0.5, domain_size=4)
    got = p.memory.to_dict()
    act = activation_terms(cfg, layout.micro_batch, 256, layout.remat, tensor=layout.tensor, expert=layout.expert,
                           dispatch=layout.dispatch)
    assert got["layer_transient"] == act.layer
    if layout.stage == 1:
        assert got["activations"] == act.saved
    for term, spread in (("layer_transient", 0.15), ("activations", 0.01)):  # the releases' spread above
        if memory[term]:
            assert abs(got[term] / memory[term] - 1) < spread, (term, got[term], memory[term])
    moved = sum(got[term] - memory[term] for term in ("layer_transient", "activations"))
    memory = {**memory, "layer_transient": got["layer_transient"], "activations": got["activations"],
              "total": memory["total"] + moved}
    assert {k: got[k] for k in memory} == memory and got["context_kv"] == 0
    assert p.wire_bytes == wire and p.step_s == pytest.approx(step_s, rel=1e-9)


def test_search_tries_context_sizes_inside_the_domain():
    cfg = small_mla(seq=CONTEXT_MIN_SEQ_LEN * 2)
    cfg.train.global_batch = 64
    layouts = enumerate_layouts(cfg, 32, 8, remats=("full",), stages=((1, 1),))
    contexts = {lay.context for lay in layouts}
    # powers of two down to CONTEXT_MIN_LOCAL_POSITIONS positions per device
    assert contexts == {c for c in (1, 2, 4) if cfg.train.seq_len // c >= CONTEXT_MIN_LOCAL_POSITIONS}
    for lay in layouts:
        assert 8 % (lay.context * lay.expert * lay.tensor) == 0  # context x expert x tensor inside a domain of 8
        assert lay.context == 1 or lay.micro_batch == 1
    assert Layout(1, 4, 2, 1, "full", 1, "dropless", context=4) in layouts
    assert any(lay.context == 2 and lay.expert * lay.tensor == 4 for lay in layouts)
    assert not any(lay.context == 4 and lay.expert * lay.tensor == 4 for lay in layouts)  # 16 devices > 8
    # short sequences: no context split, unless the batch's rows run out
    short = small_mla(seq=4096)
    short.train.global_batch = 64
    assert {lay.context for lay in enumerate_layouts(short, 32, 8, remats=("full",), stages=((1, 1),))} == {1}
    short.train.global_batch = 4  # 4 sequences on 32 devices: context splits them
    few = enumerate_layouts(short, 32, 8, remats=("full",), stages=((1, 1),))
    assert few and all(lay.data * lay.fsdp * lay.expert <= 4 for lay in few)
    assert {lay.context for lay in few} >= {2, 4, 8}


def test_parse_layout_reads_cp_and_context():
    lay = parse_layout("fsdp=32,cp=2,tp=4,remat=attention,dispatch=dropless")
    assert (lay.fsdp, lay.context, lay.tensor, lay.n_devices) == (32, 2, 4, 256)
    assert parse_layout("context=4,ep=8") == Layout(1, 1, 8, 1, "full", 1, "capacity", context=4)
    assert "context2" in lay.name()


def test_deepseek_v3_671b_128k_fits_256_gb300_with_context_parallelism():
    """The context-extension stage at 131072 positions, global batch 480, on 256 GB300s (4 racks' 64 GPUs): the
    layout the plan picks (benchmarks/RESULTS.md, "Context parallelism: the planner") fits the allocator's share of
    HBM and beats the fastest one without context parallelism, whose tensor all-reduces of 131072-position rows are
    exposed."""
    from moejax.parallel.xla_gpu_flags import LAUNCH_MEM_FRACTION

    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_671b_context.py"))["get_config"]("128k")
    topo = get_topology("gb300-nvl72")
    chosen = parse_layout("fsdp=32,cp=2,tp=4,remat=full,mb=1,dispatch=dropless")
    assert chosen in enumerate_layouts(cfg, 256, 64, remats=("full",), stages=((1, 1),),
                                       hbm_bytes=topo.hbm_bytes)
    p = predict(cfg, topo, chosen, efficiency=0.5, domain_size=64)
    assert p.fits and p.memory.total <= topo.hbm_bytes * LAUNCH_MEM_FRACTION
    assert p.memory.context_kv > 0 and p.context_gather_s > 0 and p.wire_bytes["nic"] > 0
    without = predict(cfg, topo, parse_layout("fsdp=32,tp=8,remat=full,mb=1,dispatch=dropless"), efficiency=0.5,
                      domain_size=64)
    assert without.fits and p.step_s < 0.8 * without.step_s
