"""A candidate layout: mesh axis sizes, remat policy, micro-batch and dispatch mode; and where its axes sit
relative to the NVLink domains (the same placement rule as parallel/device_grid.py).

Context parallelism (`context` > 1, parallel/context.py) splits each sequence's positions, not the batch's rows:
`micro_batch` stays in sequences per device, of which a device holds seq_len / context positions each."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moejax.config import MESH_AXES
from moejax.config.layers import layer_plan


@dataclass(frozen=True)
class Layout:
    data: int
    fsdp: int
    expert: int
    tensor: int
    remat: str  # none | dots | full
    micro_batch: int  # sequences per device per forward/backward pass
    dispatch: str  # capacity | allgather | dropless
    stage: int = 1  # pipeline stages (mesh.stage): the MoE layers split over them
    virtual: int = 1  # virtual stages per stage (mesh.virtual_stages)
    in_flight: int = 0  # micro-batches per pipeline pass (mesh.pipeline_in_flight; 0: all of them)
    context: int = 1  # devices each sequence's positions are split over (mesh.context); not a batch axis
    schedule: str = "circular"  # pipeline schedule (mesh.pipeline_schedule): circular | 1f1b

    @property
    def one_f_one_b(self) -> bool:
        return self.stage > 1 and self.schedule == "1f1b"

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def batch_shards(self) -> int:
        """Devices the batch's rows are split over inside one stage (every stage sees the whole batch; `context`
        splits each row's positions instead)."""
        return self.data * self.fsdp * self.expert

    def n_micro(self, global_batch: int) -> int:
        """Forward/backward passes per step: micro-batches of gradient accumulation, or of the pipeline."""
        return max(1, global_batch // self.batch_shards // self.micro_batch)

    def per_pass(self, global_batch: int) -> int:
        """Micro-batches one pass carries: with pipeline stages, mesh.pipeline_in_flight (0: all); else 1."""
        if self.stage <= 1:
            return 1
        return self.in_flight or self.n_micro(global_batch)

    def scheduled_micro(self, global_batch: int) -> int:
        """Micro-batches the pipeline schedule runs per pass: 1F1B pads a pass to a multiple of the stages (groups
        of S; the padding's loss weight is zero), the circular schedule runs them as they are."""
        per_pass = self.per_pass(global_batch)
        return -(-per_pass // self.stage) * self.stage if self.one_f_one_b else per_pass

    def passes(self, global_batch: int) -> int:
        """Forward/backward passes per step (the gradient accumulates over them)."""
        return self.n_micro(global_batch) // self.per_pass(global_batch)

    def local_positions(self, seq_len: int) -> int:
        """Positions of each sequence one device holds: seq_len / context."""
        return seq_len // self.context

    def name(self) -> str:
        axes = " x ".join(f"{a}{s}" for a, s in self.sizes.items() if s > 1) or "1 device"
        if self.virtual > 1:
            axes += f" (vp{self.virtual})"
        if self.in_flight:
            axes += f" ({self.in_flight} in flight)"
        if self.one_f_one_b:
            axes += " (1f1b)"
        return f"{axes} | remat {self.remat} | mb {self.micro_batch} | {self.dispatch}"

    def to_dict(self) -> dict:
        return asdict(self)


def config_layout(cfg, sizes: dict[str, int]) -> Layout:
    """The layout a config runs at on a mesh of these axis sizes (validate's): one accumulation pass's rows per
    device as its micro-batch."""
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    return Layout(**sizes, remat=cfg.model.remat, dispatch=cfg.moe.dispatch, virtual=int(cfg.mesh.virtual_stages),
                  in_flight=int(cfg.mesh.get("pipeline_in_flight", 0)),
                  schedule=str(cfg.mesh.get("pipeline_schedule", "circular")),
                  micro_batch=cfg.train.global_batch // (batch_shards * int(cfg.train.micro_batches)))


def in_domain_factors(sizes: dict[str, int], domain_size: int) -> dict[str, int]:
    """How many of each axis's positions lie inside one NVLink domain: stages take whole domains (or, with more
    stages than domains, an equal piece of each); inside a stage's piece context, expert and tensor entirely, then
    fsdp, then data fill what is left (device_grid.hybrid_device_grid's rule)."""
    sizes = {"stage": 1, "context": 1, **sizes}
    if domain_size <= 0:
        return dict(sizes)
    n = math.prod(sizes.values())
    domains = max(1, n // domain_size)
    stage_in = sizes["stage"] // domains if sizes["stage"] > domains else 1
    piece = domain_size // stage_in
    inner = inner_group(sizes)
    slots = max(1, piece // inner) if piece % inner == 0 else 1
    fsdp_in = math.gcd(sizes["fsdp"], slots)
    data_in = math.gcd(sizes["data"], slots // fsdp_in)
    return {"stage": stage_in, "data": data_in, "fsdp": fsdp_in, "context": sizes["context"],
            "expert": sizes["expert"], "tensor": sizes["tensor"]}


def inner_group(sizes: dict[str, int]) -> int:
    """Devices of the group laid out inside one NVLink domain: context x expert x tensor (their collectives run
    every layer; device_grid._stage_grid's `inner`)."""
    return sizes.get("context", 1) * sizes["expert"] * sizes["tensor"]


def layout_config(cfg, layout: Layout):
    """The config with the layout's pipeline stages (the MoE stack's parameters are shaped and split by them); the
    config itself when they already agree."""
    stages, virtual = int(cfg.mesh.get("stage", 1)), int(cfg.mesh.get("virtual_stages", 1))
    # A candidate whose chunks do not split the MoE layers (e.g. a published layout with another layer split): the
    # stage's parameters are the same bytes stored [L, ...] as [V, L / V, ...], so its shapes are taken from V = 1.
    n_pipelined = layer_plan(cfg.model).n_moe
    want = (layout.stage, layout.virtual if n_pipelined % (layout.stage * layout.virtual) == 0 else 1)
    if (stages, virtual) == want:
        return cfg
    c = cfg.copy_and_resolve_references()
    with c.unlocked():
        c.mesh.stage, c.mesh.virtual_stages = want
    return c


def loss_chunks(cfg, positions: int) -> int:
    """Chunks the loss's backward scans over a device's `positions` (kernels.loss auto resolves to the chunked loss
    on every platform, kernels/resolve.py); 1 for the dense loss."""
    if cfg.kernels.get("loss", "auto") not in ("auto", "chunked"):
        return 1
    return -(-positions // min(int(cfg.kernels.get("loss_chunk", positions)), positions))
