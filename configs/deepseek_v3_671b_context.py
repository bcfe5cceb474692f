"""DeepSeek-V3 671B context extension (technical report, section 4.3), continuing pre-training
(configs/deepseek_v3_671b.py) with YaRN in two stages of 1000 steps each:

    stage 32k:  4K -> 32K,  sequence 32768,  global batch 1920
    stage 128k: 32K -> 128K, sequence 131072, global batch 480

both at the learning rate pre-training ended with (7.3e-6, constant), YaRN scale s = 40, alpha = 1 (beta_slow),
beta = 32 (beta_fast), attention scaling sqrt(t) = 0.1 ln s + 1 (mscale = mscale_all_dim = 1), original
context 4096 (the values of the released config.json). The MTP weight (0.1) and the bias update rate (0)
are where pre-training left them. Each stage starts from the previous one's weights with a fresh optimizer:

    moejax-train --config configs/deepseek_v3_671b_context.py:32k --workdir CTX32 \\
        --config.checkpoint.init_from=PRETRAIN/checkpoints/STEP
    moejax-train --config configs/deepseek_v3_671b_context.py:128k --workdir CTX128 \\
        --config.checkpoint.init_from=CTX32/checkpoints/1000

A 128K sequence does not fit one GPU's activations, and 480 sequences do not spread over hundreds of GPUs' batch
axes: split each sequence over GPUs with context parallelism (`mesh.context`, docs/parallelism.md). Ask the planner
for the layout at your GPU count and pass it as overrides, e.g. for 256 GB300s (its prediction, 2026-12-06):

    moejax-plan --config configs/deepseek_v3_671b_context.py:128k --topology gb300-nvl72 --gpus 256
    ... --config.mesh.context=2 --config.mesh.tensor=4 --config.mesh.expert=1 --config.model.remat=attention \\
        --config.train.micro_batches=15   # fsdp 32 (the rest): 15 sequences per device, one per pass

`checkpoint.init_from` takes a training checkpoint (WORKDIR/checkpoints/STEP) or a weights directory; the
model fields must match pre-training's except the ones context extension changes (rope_scaling, yarn.*,
max_seq_len: moejax/config/changes.py). Left unset, the run refuses to start.
"""

import importlib.util
from pathlib import Path

STAGES = {"32k": (32768, 1920), "128k": (131072, 480)}


def _pretraining():
    spec = importlib.util.spec_from_file_location("deepseek_v3_671b", Path(__file__).with_name("deepseek_v3_671b.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config(stage: str = "32k"):
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {', '.join(STAGES)} (--config FILE:32k or FILE:128k)")
    c = _pretraining()
    m = c.model
    m.rope_scaling = "yarn"
    m.yarn.factor = 40.0
    m.yarn.original_max_position = 4096
    m.yarn.beta_fast = 32.0
    m.yarn.beta_slow = 1.0
    m.yarn.mscale = 1.0
    m.yarn.mscale_all_dim = 1.0
    m.max_seq_len = 163840
    m.mtp_loss_weight = 0.1
    c.moe.bias_update_rate = 0.0
    c.train.seq_len, c.train.global_batch = STAGES[stage]
    c.train.steps = 1000
    c.optim.lr, c.optim.min_lr_ratio, c.optim.warmup_steps = 7.3e-6, 1.0, 0
    c.checkpoint.init_from = "SET-ME: --config.checkpoint.init_from=PRETRAINED_WORKDIR/checkpoints/STEP"
    return c
