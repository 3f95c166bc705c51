"""Pictures of calibration: the layer-similarity heatmap and the importance curve, with the anchors marked."""

from __future__ import annotations

from pathlib import Path

from ..plots import pyplot


def similarity_heatmap(stats, anchors, path: Path) -> Path:
    plt = pyplot()
    s = stats.layer_similarity().numpy()
    L = s.shape[0]
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    masked = s.copy()
    for a in range(L):
        for b in range(a):
            masked[a, b] = float("nan")
    im = ax.imshow(masked, vmin=max(0.0, float(s[s > 0].min())), vmax=1.0, cmap="viridis", origin="upper")
    ax.set_xlabel("reuse layer b")
    ax.set_ylabel("anchor layer a")
    ax.set_title(f"sim(a, b): mean over KV heads of the best anchor head\n({stats.windows} windows of "
                 f"{stats.seq_len} tokens, k={stats.k}); red: chosen anchors")
    for a in anchors:
        ax.axhline(a, color="red", lw=0.6, alpha=0.7)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def importance_curve(stats, anchors, path: Path) -> Path:
    plt = pyplot()
    imp = stats.importance.numpy()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(range(len(imp)), imp, marker="o", ms=3)
    for a in anchors:
        ax.axvline(a, color="red", lw=0.6, alpha=0.7)
    ax.set_xlabel("layer")
    ax.set_ylabel("1 - cos(x, x + attn)")
    ax.set_title("layer importance (red: chosen anchors)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
