"""One step's expert load as an image: the tokens-per-expert matrix (MoE layers x experts) over each layer's mean,
as a heatmap with a colour bar. What W&B shows for the `tokens_per_expert` records (TensorBoard gets histograms):
a collapsing router is a bright column, a balanced one an even field around 1."""

from __future__ import annotations

import numpy as np


def expert_load_image(tokens_per_expert, step: int) -> np.ndarray:
    """[height, width, 3] uint8 RGB of the heatmap of `tokens_per_expert` ([layers][experts] token counts)."""
    # The object-oriented API without pyplot: no global figure state or GUI backend, safe beside other plotting.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    load_LxE = np.asarray(tokens_per_expert, dtype=np.float64)
    relative = load_LxE / np.maximum(load_LxE.mean(axis=-1, keepdims=True), 1e-9)
    n_layers, n_experts = relative.shape
    # A cell per (layer, expert) while they fit; DeepSeek-V3's 58 x 256 is squeezed into a 12 x 8-inch image.
    size = (min(12.0, 2.0 + 0.25 * n_experts), min(8.0, 1.2 + 0.3 * n_layers))
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # The same scale as moejax-report's heatmap: 0 to at least 2x the mean, so a balanced layer looks the same
    # at every step and an overloaded expert stands out.
    im = ax.imshow(relative, aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=max(2.0, float(relative.max())),
                   interpolation="nearest")
    ax.set(title=f"expert load, step {step}", xlabel="expert", ylabel="MoE layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # experts and layers are whole numbers
    ax.set_yticks(range(0, n_layers, -(-n_layers // 10)))  # at most 10 labels; also one layer alone
    fig.colorbar(im, ax=ax, label="tokens / mean")
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
