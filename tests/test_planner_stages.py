"""The planner's model of pipeline stages (moejax/planner: layout, memory, comm, predict, search): which stage
counts it searches, per-stage memory, the bubble and the compute outside the pipeline (split over the stages, MTP
repeated), the hand-off bytes and which link carries them, and NVIDIA's record layout ranked and explained. From
the config alone; the comparison with a compiled pipelined step is in tests/test_pipeline_step.py
(`make test-pipeline`)."""

import runpy
from pathlib import Path

import pytest

from moejax.model.accounting import mtp_blocks_macs_fraction, pipelined_macs_fraction
from moejax.kernels.resolve import GPU_EXCHANGE_CHUNKS
from moejax.parallel.one_f_one_b_tables import executed_slots
from moejax.parallel.pipeline import schedule_ticks, slot_is_layer
from moejax.parallel.topology import get_topology
from moejax.planner.comm import step_traffic, wire_bytes
from moejax.planner.layout import Layout, layout_config
from moejax.planner.memory import estimate_memory
from moejax.planner.predict import predict, stage_options, stage_terms
from moejax.planner.state_shapes import state_leaves
from tests.test_pipeline_step import pipeline_config

ROOT = Path(__file__).resolve().parents[1]


def staged_config():
    cfg = pipeline_config("capacity", 8)  # a dense layer, 8 MoE layers with shared + routed experts, MTP
    cfg.train.global_batch, cfg.train.seq_len = 32, 16
    return cfg


def test_searched_stage_counts_split_the_moe_layers_and_the_domains():
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_671b.py"))["get_config"]()
    options = stage_options(cfg, 256, 64)  # 4 domains of 64 (NVL72 racks at 256 GPUs)
    # 58 MoE layers: PP2 (whole racks) with VP 1-8, the record's VP8 (16 chunks of 4 slots, 6 identity slots) among
    # them, and VP 29 (one layer per chunk); stage counts that do not split the 4 racks are left out
    assert {(1, 1), (2, 1), (2, 8), (2, 29), (4, 1)} <= set(options)
    assert (3, 1) not in options and all(s * v <= 58 for s, v in options)
    small = staged_config()  # 8 MoE layers on 16 devices in 2 domains of 8: 4 stages are half domains
    assert {(2, 1), (2, 2), (2, 3), (2, 4), (4, 1), (4, 2), (8, 1)} <= set(stage_options(small, 16, 8))
    assert (16, 1) not in stage_options(small, 16, 8) and (4, 3) not in stage_options(small, 16, 8)  # > 8 chunks


def test_a_stage_holds_its_share_of_the_moe_stack_and_all_the_rest():
    cfg = staged_config()
    flat = Layout(1, 1, 2, 1, "full", 1, "capacity")
    for stages, virtual in ((2, 1), (4, 2)):
        piped = Layout(1, 1, 2, 1, "full", 1, "capacity", stages, virtual)
        params = state_leaves(layout_config(cfg, piped))[0]
        assert any(leaf.pipelined for leaf in params) and sum(leaf.pipelined for leaf in params) == sum(
            "moe_layers" in leaf.path for leaf in params)
        whole = state_leaves(cfg)[0]
        moe = sum(leaf.local_bytes(flat.sizes) for leaf in whole if "moe_layers" in leaf.path)
        rest = sum(leaf.local_bytes(flat.sizes) for leaf in whole if "moe_layers" not in leaf.path)
        assert moe > 0 and rest > 0
        mem_1, mem_s = estimate_memory(cfg, flat), estimate_memory(cfg, piped)
        # per device: the stage's 1/S of the MoE stack (its chunks), every other leaf whole
        assert mem_s.params - mem_1.params == pytest.approx(moe / stages - moe, abs=8 * len(params))
        assert mem_s.opt_state < mem_1.opt_state


def test_saved_activations_follow_the_ticks_and_the_logits_the_stages_share_of_the_batch():
    cfg = staged_config()
    micro = cfg.train.global_batch // 2 // 1  # expert 2 splits the batch; mb 1: M = 16
    flat = estimate_memory(cfg, Layout(1, 1, 2, 1, "full", 1, "capacity"))
    for stages, virtual in ((2, 1), (4, 2)):
        piped = estimate_memory(cfg, Layout(1, 1, 2, 1, "full", 1, "capacity", stages, virtual))
        # the loss runs once on the stage's 1/S of the local rows (rows split over `stage` outside the pipeline)
        assert piped.logits == flat.logits * micro // stages
        # M micro-batches in flight: more than one pass of gradient accumulation keeps, less than M of them
        # (the MoE layers are split over the stages)
        assert flat.activations < piped.activations < micro * flat.activations
    more_virtual = estimate_memory(cfg, Layout(1, 1, 2, 1, "full", 1, "capacity", 2, 4))
    fewer = estimate_memory(cfg, Layout(1, 1, 2, 1, "full", 1, "capacity", 2, 1))
    assert more_virtual.activations < fewer.activations  # ticks x chunk: (M V + S - 1) L / (S V) shrinks with V


def test_passes_in_flight_bound_the_activations_and_pay_a_bubble_per_pass():
    """mesh.pipeline_in_flight = k: one pass's k micro-batches are in flight (activations and logits as for M = k),
    the gradient accumulates over M / k passes, and each pass pays the bubble (S - 1) / (k V)."""
    cfg = staged_config()  # expert 2, mb 1: M = 16
    gpipe = Layout(1, 1, 2, 1, "dots", 1, "capacity", 2, 1)
    two = Layout(1, 1, 2, 1, "dots", 1, "capacity", 2, 1, in_flight=2)
    assert (two.per_pass(32), two.passes(32), gpipe.passes(32)) == (2, 8, 1)
    all_m, k2 = estimate_memory(cfg, gpipe), estimate_memory(cfg, two)
    cfg2 = staged_config()
    cfg2.train.global_batch = 4  # M = 2 in one pass: what a pass of two in flight holds
    one_pass = estimate_memory(cfg2, Layout(1, 1, 2, 1, "dots", 1, "capacity", 2, 1))
    assert k2.activations == one_pass.activations < all_m.activations
    assert (k2.grad_accumulator, all_m.grad_accumulator) == (k2.grads, 0)
    assert stage_terms(cfg, two, 16)[0] == pytest.approx(1 / 2)
    assert stage_terms(cfg, gpipe, 16)[0] == pytest.approx(1 / 16)
    # the hand-offs move the same bytes in 8 passes of 2 as in one of 16; the ticks are 8 x (2 + 1) instead of 17
    ticks = {t.what: t.count for t in step_traffic(cfg, two)}
    assert ticks["pipeline hand-off"] == 3 * 8 * schedule_ticks(2, 2, 1)


def test_bubble_and_the_compute_every_stage_repeats_or_splits():
    cfg = staged_config()
    assert stage_terms(cfg, Layout(1, 1, 2, 1, "full", 1, "capacity"), 16) == (0.0, 1.0)
    lay = Layout(1, 1, 2, 1, "full", 2, "capacity", 4, 2)  # M = 32 / 2 / 2 = 8
    bubble, factor = stage_terms(cfg, lay, 16)
    assert bubble == pytest.approx(3 / 16)
    p = pipelined_macs_fraction(cfg, 16)
    mtp = mtp_blocks_macs_fraction(cfg, 16)
    # the MoE stack stretched by the bubble, the MTP passes and the rest split over the stages (8 passes, 2 each)
    assert 0 < p < 1 and 0 < mtp < 1 - p
    assert factor == pytest.approx(p * (1 + 3 / 16) + (1 - p))
    # an uneven split computes its identity slots: 8 layers in 2 x 3 chunks of 2 slots is 12 / 8 of the MoE stack
    bubble, factor = stage_terms(cfg, Layout(1, 1, 2, 1, "full", 2, "capacity", 2, 3), 16)
    assert factor == pytest.approx(p * 12 / 8 * (1 + bubble) + (1 - p))
    # ... under 1f1b only where a stage needs its last slot: the slots the schedule executes, a backward slot
    # weighing 2 + 3 (recompute - 1) forward ones
    one = Layout(1, 1, 2, 1, "full", 2, "capacity", 2, 3, schedule="1f1b")
    n_micro = one.per_pass(int(cfg.train.global_batch))
    fwd, bwd = executed_slots(2, n_micro, 3, 2, slot_is_layer(8, 2, 3)[..., -1])
    _, factor_1f1b = stage_terms(cfg, one, 16, 1.3)
    assert factor_1f1b == pytest.approx(p * (fwd + 2.9 * bwd) / (3.9 * n_micro * 8 / 2) + (1 - p))
    assert factor_1f1b < factor
    # 6 micro-batches on 4 stages: 2 rounds of MTP passes, 8 for 6
    lay = Layout(1, 1, 2, 1, "full", 1, "capacity", 4, 1)
    cfg6 = staged_config()
    cfg6.train.global_batch = 12  # expert 2, one row per pass: M = 6
    bubble, factor = stage_terms(cfg6, lay, 16)
    assert lay.n_micro(12) == 6 and factor == pytest.approx(p * (1 + bubble) + mtp * 8 / 6 + (1 - p - mtp))


@pytest.mark.parametrize("stages,domain,nic_share", [(2, 8, 1.0), (4, 8, 0.5), (4, 16, 0.0)])
def test_hand_off_bytes_and_their_link(stages, domain, nic_share):
    cfg = staged_config()
    lay = Layout(2, 1, 16 // (2 * stages), 1, "full", 1, "capacity", stages, 1)
    assert lay.n_devices == 16
    hand, outputs = [t for t in step_traffic(cfg, lay) if t.kind == "collective-permute"]
    assert hand.axes == outputs.axes == ("stage",)
    n_micro = lay.n_micro(cfg.train.global_batch)
    assert hand.bytes == 1 * 16 * cfg.model.d_model * 4  # one micro-batch's [mb, seq, d_model] f32 per device
    # as XLA compiles the schedule: 1 forward + 2 backward permutes per tick; once per step the last stage's M
    # outputs to every stage (a permute and an all-reduce) and their cotangents back (a permute), and stage 0's
    # input cotangents summed over the stages (an all-reduce)
    assert hand.count == 3 * schedule_ticks(stages, n_micro, 1)
    assert (outputs.bytes, outputs.count) == (hand.bytes * n_micro, 2)
    reads = [t for t in step_traffic(cfg, lay) if t.axes == ("stage",) and t.kind == "all-reduce"]
    assert len(reads) == 1 and (reads[0].bytes, reads[0].count) == (hand.bytes * n_micro, 2)
    # the rows gathered over `stage` into the pipeline, and the cotangents of the hidden state and the MTP
    # module's hidden state in the backward (XLA gathers those in two steps beyond two stages: 1.5 x)
    gathers = [t for t in step_traffic(cfg, lay) if t.axes == ("stage",) and t.kind == "all-gather"]
    rows = hand.bytes * n_micro
    assert [t.bytes for t in gathers] == [rows, rows * (3 if stages > 2 else 2) // 2]
    assert [t.count for t in gathers] == [1, 1 + cfg.model.mtp_depth]
    # the gradients of the leaves outside the stages are summed over `stage` too
    head = [t for t in step_traffic(cfg, lay) if t.what == "grad sum ['head_DxV']"]
    assert len(head) == 1 and "stage" in head[0].axes
    w = wire_bytes(hand, lay.sizes, domain)
    assert w["nic"] == pytest.approx(nic_share * hand.total) and w["nvlink"] + w["nic"] == pytest.approx(hand.total)


def test_pipeline_trades_bubble_for_the_fsdp_gathers_it_saves():
    """DeepSeek-V3 671B on 256 GB300s: PP2 splits the per-device state, so a layout fits without fsdp over both
    racks' halves; the bubble shows in the step time, on the MoE layers' share of the compute (the rest, MTP
    included, is split over the stages)."""
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_671b.py"))["get_config"]()
    topo = get_topology("gb300-nvl72")
    flat = predict(cfg, topo, Layout(4, 1, 64, 1, "full", 1, "capacity"), efficiency=0.5, domain_size=64)
    piped = predict(cfg, topo, Layout(2, 1, 64, 1, "full", 1, "capacity", 2, 1), efficiency=0.5, domain_size=64)
    assert piped.memory.params < 0.6 * flat.memory.params
    assert piped.bubble == pytest.approx(1 / 32)  # M = 4096 / 128 = 32 micro-batches of one sequence
    assert piped.wire_bytes["nic"] > 0 and 1 + 0.8 * piped.bubble < piped.stage_compute < 1 + piped.bubble


def test_exchange_slices_hide_the_expert_exchange_under_the_expert_gemms():
    from moejax.planner.predict import exposed_exchange_s

    # One slice: only the shared experts cover it; C slices: 1/C waits on the shared experts, the rest on the
    # routed GEMMs, whatever they cannot cover shows.
    assert exposed_exchange_s(4.0, 10.0, 1.0, 1) == pytest.approx(3.0)
    assert exposed_exchange_s(4.0, 10.0, 1.0, 2) == pytest.approx(1.0)
    assert exposed_exchange_s(4.0, 10.0, 1.0, 4) == pytest.approx(0.0)
    assert exposed_exchange_s(40.0, 10.0, 1.0, 4) == pytest.approx(9.0 + 20.0)  # link-bound: the excess shows
    # The record's model and machine: the chunked default hides most of the exchange, and the step says so (a layout
    # whose temporaries fit XLA's scheduler budget: past it nothing overlaps, test_1f1b_overlap_counts_only_...).
    cfg = runpy.run_path(str(ROOT / "configs" / "deepseek_v3_671b.py"))["get_config"]()
    topo, layout = get_topology("gb300-nvl72"), Layout(1, 8, 32, 1, "full", 4, "dropless")
    by_chunks = {}
    for chunks in (1, 2, 4):
        cfg.moe.exchange_chunks = chunks
        by_chunks[chunks] = predict(cfg, topo, layout, efficiency=0.5, domain_size=64)
    one, two, four = by_chunks[1], by_chunks[2], by_chunks[4]
    assert one.exchange_s == two.exchange_s > 1.0  # the same bytes
    assert one.exposed_exchange_s > 2 * two.exposed_exchange_s > 0 and four.exposed_exchange_s < two.exposed_exchange_s
    assert one.step_s - two.step_s == pytest.approx(one.exposed_exchange_s - two.exposed_exchange_s)
    cfg.moe.exchange_chunks = 0  # auto: what a GPU run resolves at expert 32
    assert predict(cfg, topo, layout, efficiency=0.5, domain_size=64).exchange_chunks == GPU_EXCHANGE_CHUNKS


def test_1f1b_activations_do_not_grow_with_the_micro_batches():
    """The planner's 1F1B stage memory: the chunk residuals of V S + 2 S - 2 forwards whatever M (the circular
    schedule's grow with M); the layout's name and --layout say the schedule."""
    from moejax.planner.memory import estimate_memory
    from moejax.planner.search import parse_layout
    from tests.test_plan_vs_xla import medium_config

    cfg = medium_config(1, 1, 2, 1)
    # No dense layer: the parts before the stages run on the whole pass under both schedules (they grow with M)
    cfg.model.n_layers, cfg.model.first_k_dense = 8, 0
    acts = {}
    for sched in ("circular", "1f1b"):
        for batch in (32, 128):  # M = 8 and 32 micro-batches of one sequence per device
            with cfg.unlocked():
                cfg.train.global_batch = batch
            layout = parse_layout(f"pp=2,vp=2,ep=2,remat=none,mb=1,schedule={sched}")
            acts[sched, batch] = estimate_memory(cfg, layout).activations
    assert acts["circular", 128] > 3 * acts["circular", 32]
    assert acts["1f1b", 128] < 1.5 * acts["1f1b", 32]
    assert acts["1f1b", 128] < acts["circular", 128] / 2
    assert "(1f1b)" in parse_layout("pp=2,schedule=1f1b").name()


def test_1f1b_overlap_counts_only_within_xlas_scheduler_budget():
    """XLA:GPU overlaps communication only where its scheduler has the memory for it ((allocator - state) x 95%;
    past it, the 256-GB300 compiles of the record's layout put compute under 4% of the exchange bytes, within it
    under 68-100%). Within it, 1F1B's forward block in flight holds its transient beside the backward's and the
    exchange is mostly hidden; past it neither, and every collective is exposed. XLA:CPU overlaps nothing."""
    from moejax.planner.memory import within_scheduler_budget
    from moejax.planner.search import parse_layout

    cfg = staged_config()
    layout = parse_layout("pp=2,vp=2,ep=2,remat=full,mb=1,dispatch=dropless,sched=1f1b")
    gpu, cpu = estimate_memory(cfg, layout), estimate_memory(cfg, layout, platform="cpu")
    assert gpu.overlap_live == gpu.layer_transient > 0 and cpu.overlap_live == 0
    roomy, overlapped = within_scheduler_budget(gpu, gpu.state + gpu.temporaries * 100 // 95 + 100)
    assert overlapped and roomy == gpu
    tight, overlapped = within_scheduler_budget(gpu, gpu.state + gpu.temporaries * 100 // 95 - 100)
    assert not overlapped and tight.overlap_live == 0 and tight.total == gpu.total - gpu.overlap_live
    topo = get_topology("gb300-nvl72")
    hidden = predict(cfg, topo, layout, efficiency=0.5, domain_size=4)
    exposed = predict(cfg, topo, layout, efficiency=0.5, domain_size=4, mem_fraction=gpu.state / topo.hbm_bytes / 2)
    assert hidden.memory == gpu and exposed.memory == tight
    # past the budget the exchange runs synchronously, and so do the hand-offs (in the critical path)
    assert exposed.exposed_exchange_s == exposed.exchange_s and hidden.exposed_comm_s < exposed.exposed_comm_s
    assert exposed.step_s > hidden.step_s
