"""Which decoder layers have a dense FFN and which an MoE: the first `model.first_k_dense` layers (DeepSeek), plus
the later layers `model.interleaved_dense_layers` lists, among the MoE layers (Qwen3-MoE's `mlp_only_layers` /
`decoder_sparse_step`). Every config consumer that counts or orders dense and MoE layers reads this one plan.

The model keeps ALL dense layers in one stack and all MoE layers in another, each in layer order, and runs the
layers in their true order as contiguous runs of one stack (`LayerPlan.runs`); the MoE statistics and router-bias
rows are one per MoE layer, in layer order. jax-free, like the rest of moejax.config.
"""

from __future__ import annotations

from typing import NamedTuple

from moejax.config.schema import ConfigError

FIELD = "model.interleaved_dense_layers"


class LayerPlan(NamedTuple):
    is_moe: tuple[bool, ...]  # per decoder layer, in order

    @property
    def n_dense(self) -> int:
        return self.is_moe.count(False)

    @property
    def n_moe(self) -> int:
        return self.is_moe.count(True)

    @property
    def dense_first(self) -> bool:
        """Every dense layer comes before the first MoE layer (what pipeline stages need)."""
        return all(not moe for moe in self.is_moe[: self.n_dense])

    def stack_index(self, layer: int) -> tuple[bool, int]:
        """(is MoE, index of the layer in its stack: the dense or the MoE stack, each in layer order)."""
        moe = self.is_moe[layer]
        return moe, self.is_moe[:layer].count(moe)

    @property
    def runs(self) -> tuple[tuple[bool, int, int], ...]:
        """The layers as maximal runs of one kind, in order: (is MoE, first index in its stack, layer count)."""
        out: list[list] = []
        for i, moe in enumerate(self.is_moe):
            if out and out[-1][0] == moe:
                out[-1][2] += 1
            else:
                out.append([moe, self.stack_index(i)[1], 1])
        return tuple(tuple(r) for r in out)


def interleaved_dense(m) -> tuple[int, ...]:
    """model.interleaved_dense_layers as indices: ascending, distinct, in [first_k_dense, n_layers)."""
    text = str(m.get("interleaved_dense_layers", "") or "")
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{FIELD}={text!r} is not a comma-separated list of layer indices") from None
    first, n = int(m.first_k_dense), int(m.n_layers)
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"{FIELD}={text!r}: list the layer indices in ascending order, each once")
    if ids and not first <= ids[0] <= ids[-1] < n:
        raise ConfigError(f"{FIELD}={text!r}: indices must lie in [model.first_k_dense={first}, model.n_layers={n}) "
                          "(the first model.first_k_dense layers are dense already)")
    return ids


def layer_plan(m) -> LayerPlan:
    """The plan of cfg.model `m` (raises ConfigError on a malformed interleaved_dense_layers)."""
    dense = set(range(int(m.first_k_dense))) | set(interleaved_dense(m))
    return LayerPlan(tuple(i not in dense for i in range(int(m.n_layers))))


def dense_layer_fields(is_moe) -> tuple[int, str]:
    """(model.first_k_dense, model.interleaved_dense_layers) of a per-layer plan: the leading dense layers
    counted, the later ones listed."""
    first_k = next((i for i, moe in enumerate(is_moe) if moe), len(is_moe))
    return first_k, ",".join(str(i) for i, moe in enumerate(is_moe) if not moe and i >= first_k)


def check_pipeline_layers(m, stages: int):
    """Pipeline stages (mesh.stage > 1) run only the MoE layers, the dense ones before them: refuse dense layers
    after a MoE layer."""
    if stages > 1 and not layer_plan(m).dense_first:
        raise ConfigError(
            f"mesh.stage={stages}: {FIELD}={m.get('interleaved_dense_layers', '')!r} puts dense layers between or "
            "after the MoE layers, but pipeline stages run the MoE layers only, with every dense layer before them; "
            "use mesh.stage=1 for this model")


def pipeline_in_flight(cfg) -> int:
    """Micro-batches one pipeline pass carries: mesh.pipeline_in_flight, or all train.micro_batches when 0."""
    k = int(cfg.mesh.get("pipeline_in_flight", 0))
    return k if k > 0 else int(cfg.train.micro_batches)


def accumulation_passes(cfg) -> int:
    """Forward/backward passes the train step accumulates the gradient over: train.micro_batches without pipeline
    stages; with them, train.micro_batches / pipeline_in_flight (each pass runs that many micro-batches through the
    stages; by default all in one pass)."""
    if int(cfg.mesh.get("stage", 1)) <= 1:
        return int(cfg.train.micro_batches)
    return max(1, int(cfg.train.micro_batches) // pipeline_in_flight(cfg))
