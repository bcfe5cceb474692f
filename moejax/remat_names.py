"""Names of the activations a selective remat policy keeps (model.remat, docs/memory.md).

Tagged with `jax.ad_checkpoint.checkpoint_name` where they are computed (attention, the expert dispatch, the
grouped GEMMs); model/layer_stack.py's policies save them by name. A leaf module: the kernels, the dispatch and
the model all tag, and none of them may import the others' layer.
"""

ATTENTION_OUT = "attention_out"  # core attention's output [B, L, H, V]: the causal L^2 work (not the projections)
EXPERT_EXCHANGE = "expert_exchange"  # rows an expert all-to-all delivered (to the experts, and back): communication
EXPERT_GEMM = "expert_gemm"  # the routed experts' GEMM outputs (gate, up, down): most of an MoE layer's FLOPs
