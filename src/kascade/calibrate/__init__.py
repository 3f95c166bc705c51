"""Calibration: measure cross-layer similarity on development text, choose anchors and head map.

    stats = collect_stats(model, windows)            # streaming, one dense forward per window
    plan = plan_from_stats(model, stats, num_anchors=6)
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..integration.hf import attach, attention_modules
from ..plan import KascadePlan, ModelFingerprint
from .dp import choose_anchors
from .stats import CalibrationStats, StatsRecorder

DEFAULT_K = 64  # the authors' selection runs use k = 64


def min_window_tokens(k: int, tile: int) -> int:
    """Shortest window with at least one tile that has ``k`` earlier keys."""
    return math.ceil(k / tile) * tile + 1


def _decoder_layer_of(model, attn_module):
    for m in model.modules():
        if any(c is attn_module for c in m.children()):
            return m
    raise ValueError("could not find the decoder layer holding an attention module")


@torch.no_grad()
def collect_stats(model, windows: list[torch.Tensor], *, k: int = DEFAULT_K, tile: int = 32,
                  progress: bool = True) -> CalibrationStats:
    """Run ``model`` densely on each window (1-D token tensors) and return the streamed statistics."""
    if not windows:
        raise ValueError("no calibration windows given")
    need = min_window_tokens(k, tile)
    for i, w in enumerate(windows):
        if w.dim() != 1:
            raise ValueError(f"window {i} must be a 1-D tensor of token ids, got shape {tuple(w.shape)}")
        if len(w) < need:
            raise ValueError(f"calibration text {i} has {len(w)} tokens; at least {need} are needed "
                             f"(one tile of {tile} after k={k} earlier keys)")
    fp = ModelFingerprint.from_model(model)
    rec = StatsRecorder(fp.num_layers, fp.num_kv_heads, k, tile)
    mods = attention_modules(model)
    hooks = []
    try:
        for layer, m in enumerate(mods):
            hooks.append(_decoder_layer_of(model, m).register_forward_pre_hook(rec.layer_input_hook(layer),
                                                                               with_kwargs=True))
            hooks.append(m.register_forward_hook(rec.attn_output_hook(layer)))
        dev = next(model.parameters()).device
        with attach(model, rec):
            for w in tqdm(windows, desc="calibration windows", unit="window", disable=not progress):
                model(w[None].to(dev), use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return rec.result(seq_len=max(len(w) for w in windows))


def layer_weights(stats: CalibrationStats) -> torch.Tensor:
    """``w[a, b] = imp(b) * sim(a, b)``: the DP's per-layer reward for letting anchor ``a`` serve layer ``b``."""
    return stats.layer_similarity() * stats.importance[None, :]


def plan_from_stats(model_or_fp, stats: CalibrationStats, num_anchors: int, *, ratio: float = 0.10,
                    k_min: int = 128, tile: int = 32, rolling: bool = True, head_map: bool = True,
                    source: str = "") -> KascadePlan:
    """The DP's anchor set for ``num_anchors`` and the argmax head map (identity if ``head_map=False``)."""
    fp = model_or_fp if isinstance(model_or_fp, ModelFingerprint) else ModelFingerprint.from_model(model_or_fp)
    if stats.similarity.shape[0] != fp.num_layers or stats.similarity.shape[-1] != fp.num_kv_heads:
        raise ValueError("calibration statistics do not match the model's layer or KV-head count")
    if not 1 <= num_anchors <= fp.num_layers:
        raise ValueError(f"--anchors must be in 1..{fp.num_layers} (the model's layer count), got {num_anchors}")
    anchors, value = choose_anchors(layer_weights(stats), num_anchors)
    plan_anchor = [max(a for a in anchors if a <= b) for b in range(fp.num_layers)]
    ident = tuple(range(fp.num_kv_heads))
    hm = tuple(stats.head_map(plan_anchor[b], b) if head_map else ident for b in range(fp.num_layers))
    src = source or (f"calibrated: DP over {stats.windows} windows of {stats.seq_len} tokens, k={stats.k}, "
                     f"objective {value:.4f}{'' if head_map else ', identity head map'}")
    return KascadePlan(fp, anchors, hm, ratio=ratio, k_min=k_min, tile=tile, rolling=rolling, calibrated=True,
                       source=src)


def objective_table(stats: CalibrationStats, max_anchors: int) -> list[dict]:
    """DP objective (absolute and as a fraction of ``sum imp``, i.e. of an all-anchor model) for A = 1..max."""
    w = layer_weights(stats)
    total = float(stats.importance.sum())
    rows = []
    for A in range(1, max_anchors + 1):
        anchors, value = choose_anchors(w, A)
        rows.append(dict(anchors=A, layers=list(anchors), objective=value, fraction=value / total if total else 0.0))
    return rows
