"""Calibration statistics, streamed layer by layer during dense forward passes.

For each development window the model runs densely; in each layer ``b`` the recorder forms the pooled
probabilities ``P[b, h, t, :]`` tile by tile (the same pooling the anchors use, from
:func:`kascade.ops.reference.iter_pooled_prefill`), keeps only their top-k index sets ``I[b, h, t]``
(``[layers, H, tiles, k]``, small) and turns them into the similarity of every earlier layer ``a``:

    sim_t(a, ha; b, hb) = (sum_{i in I[a, ha, t]} P[b, hb, t, i] + own_b) / (sum_{i in I[b, hb, t]} P[b, hb, t, i] + own_b)

with ``own_b`` the mass layer ``b``'s head ``hb`` puts on the tile's own keys. The minimum over tiles (tiles with
fewer than k earlier keys left out) is taken per window; windows are averaged. Importance
``imp(b) = 1 - cos(x_b, x_b + attn_out_b)`` is averaged over tokens and windows, from hooks on the decoder layers.
No layer's probabilities outlive its attention call.

    stats = collect_stats(model, windows)            # streaming, one dense forward per window
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..integration.hf import attach, attention_modules
from ..ops.reference import _math_dtype, iter_pooled_prefill
from ..plan import ModelFingerprint

DEFAULT_K = 64  # the authors' selection runs use k = 64


@dataclass
class CalibrationStats:
    """similarity: ``[L, L, H, H]`` indexed ``[a, b, hb, ha]`` (defined for ``a < b``); importance ``[L]``."""

    similarity: torch.Tensor
    importance: torch.Tensor
    windows: int
    seq_len: int
    k: int
    tile: int

    def layer_similarity(self) -> torch.Tensor:
        """``sim(a, b) = mean_hb max_ha S[a, b, hb, ha]`` for ``a < b``; 1 on the diagonal; 0 below it."""
        L = self.similarity.shape[0]
        s = self.similarity.max(-1).values.mean(-1)
        s = torch.triu(s, diagonal=1)
        return s + torch.eye(L, dtype=s.dtype)

    def head_map(self, anchor: int, layer: int) -> tuple[int, ...]:
        """For reuse ``layer`` following ``anchor``: ``argmax_ha S[anchor, layer, hb, ha]`` per KV head ``hb``."""
        if anchor == layer:
            return tuple(range(self.similarity.shape[-1]))
        return tuple(int(x) for x in self.similarity[anchor, layer].argmax(-1))

    def to_dict(self) -> dict:
        return dict(similarity=self.similarity.tolist(), importance=self.importance.tolist(), windows=self.windows,
                    seq_len=self.seq_len, k=self.k, tile=self.tile)


def window_similarity(pooled_chunks, num_layers: int, layer: int, index_sets: torch.Tensor, k: int, tile: int):
    """Similarity of all earlier layers to ``layer`` for one window, from its pooled probabilities.

    ``pooled_chunks`` yields ``(t0, P [H, c, m])`` like :func:`iter_pooled_prefill` over all tiles of the window
    (from tile 0). ``index_sets [num_layers, H, tiles, k]`` holds earlier layers' sets; this layer's are written
    into it. Returns ``[layer, H(hb), H(ha)]``: the minimum over tiles with at least ``k`` earlier keys (NaN-free;
    +inf where no tile qualifies).
    """
    H = index_sets.shape[1]
    smin = None
    for t0, P in pooled_chunks:
        c, m = P.shape[1], P.shape[2]
        s = (torch.arange(t0, t0 + c, device=P.device) * tile)[:, None]  # [c, 1] first position of each tile
        pos = torch.arange(m, device=P.device)[None, :]
        own = P.masked_fill((pos < s) | (pos >= s + tile), 0).sum(-1)  # [H, c]
        cand = P.masked_fill(pos >= s, float("-inf"))
        kk = min(k, m)
        idx = cand.topk(kk, dim=-1).indices  # [H, c, kk]; tiles with s < k are dropped below
        index_sets[layer, :, t0 : t0 + c, :kk] = idx
        den = P.gather(-1, idx).sum(-1) + own  # [H, c]
        valid = s[:, 0] >= k  # [c]
        if layer > 0:
            prev = index_sets[:layer, :, t0 : t0 + c]  # [A, Ha, c, k]
            A = prev.shape[0]
            flat = prev.permute(2, 0, 1, 3).reshape(1, c, A * H * k).expand(H, c, A * H * k)
            num = P.gather(-1, flat).view(H, c, A, H, k).sum(-1) + own[:, :, None, None]  # [Hb, c, A, Ha]
            sim = num / den[:, :, None, None]
            sim = sim.masked_fill(~valid[None, :, None, None], float("inf")).amin(1)  # [Hb, A, Ha]
            sim = sim.permute(1, 0, 2)  # [A, Hb, Ha]
            smin = sim if smin is None else torch.minimum(smin, sim)
    return smin


class StatsRecorder:
    """Attention runtime for :func:`kascade.integration.hf.attach` (``begin(fwd, q, k)`` per forward,
    ``attend(layer, q, k, v, fwd, scale)`` per layer): dense outputs, calibration statistics on the side."""

    def __init__(self, num_layers: int, num_kv_heads: int, k: int, tile: int):
        self.L, self.H, self.k, self.tile = num_layers, num_kv_heads, k, tile
        self.sim_sum = torch.zeros(num_layers, num_layers, num_kv_heads, num_kv_heads, dtype=torch.float64)
        self.sim_count = torch.zeros(num_layers, num_layers, dtype=torch.float64)
        self.imp_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.imp_count = torch.zeros(num_layers, dtype=torch.float64)
        self.windows = 0
        self._index_sets = None
        self._x = {}

    # -- the attention runtime (kascade.integration.hf.attach) -------------------------------------------------
    def begin(self, fwd, q, k):
        if q.shape[0] != 1 or q.shape[2] != k.shape[2] or bool(torch.as_tensor(fwd.kv_start).any()):
            raise ValueError("calibration runs one unpadded window at a time, without a KV cache")

    def attend(self, layer, q, k, v, fwd, scale):
        B, HQ, L, D = q.shape
        N = k.shape[2]
        scale = D**-0.5 if scale is None else scale
        md = _math_dtype(q.dtype)
        qb, kb = q[0].to(md), k[0].to(md)
        if layer == 0:
            tiles = (N + self.tile - 1) // self.tile
            self._index_sets = torch.zeros(self.L, self.H, tiles, self.k, dtype=torch.long, device=q.device)
            self.windows += 1
        chunks = iter_pooled_prefill(qb, kb, scale, self.tile)
        smin = window_similarity(chunks, self.L, layer, self._index_sets, self.k, self.tile)
        if smin is not None and bool(torch.isfinite(smin).all()):
            self.sim_sum[:layer, layer] += smin.double().cpu()
            self.sim_count[:layer, layer] += 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    # -- importance hooks --------------------------------------------------------------------------------------
    def layer_input_hook(self, layer):
        def hook(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            self._x[layer] = x

        return hook

    def attn_output_hook(self, layer):
        def hook(module, args, output):
            x = self._x.pop(layer).float()
            o = (output[0] if isinstance(output, tuple) else output).float()
            cos = F.cosine_similarity(x, x + o, dim=-1)  # [B, L]
            self.imp_sum[layer] += (1 - cos).sum().double().cpu()
            self.imp_count[layer] += cos.numel()

        return hook

    def result(self, seq_len: int) -> CalibrationStats:
        if self.windows == 0:
            raise ValueError("no calibration window was recorded")
        cnt = self.sim_count.clamp_min(1)[:, :, None, None]
        return CalibrationStats(
            similarity=(self.sim_sum / cnt).float(),
            importance=(self.imp_sum / self.imp_count.clamp_min(1)).float(),
            windows=self.windows, seq_len=seq_len, k=self.k, tile=self.tile,
        )


def min_window_tokens(k: int, tile: int) -> int:
    """Shortest window with one whole query tile after the first ``k`` keys (every query of it has ``k`` earlier
    keys); a shorter window compares the layers' top-k sets on a handful of queries at most."""
    return math.ceil(k / tile) * tile + tile


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
