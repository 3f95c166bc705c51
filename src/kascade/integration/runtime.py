"""What :func:`kascade.integration.hf.attach` routes a model's attention to (:class:`Runtime`), and the runtimes
besides Kascade's own (:class:`kascade.Attention`) and calibration's statistics recorder
(:class:`kascade.calibrate.stats.StatsRecorder`): the dense baseline timed under CUDA graphs, and no attention at all
(the share of time attention takes)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .. import ops
from ..attention import Forward


@runtime_checkable
class Runtime(Protocol):
    """A model's attention, one forward pass at a time, each pass one :class:`kascade.Forward` (``fwd``) that belongs
    to it alone (concurrent passes never share one). ``begin(fwd, q, k)`` once per pass with layer 0's queries and
    keys fills in what the runtime needs (``fwd.step``, ``fwd.plan``, ``fwd.selections``) from the pass's key
    geometry (``fwd.kv_start`` / ``fwd.q_offset``: host values, or device tensors in a decode step planned on the
    device); then ``attend(layer, q, k, v, fwd, scale)`` for every layer in order, ``q [B, HQ, L, D]``,
    ``k, v [B, H, N, D]`` (the whole cache) -> ``[B, HQ, L, D]``; ``scale`` is the softmax scale (None: ``D**-0.5``)."""

    def begin(self, fwd: Forward, q: torch.Tensor, k: torch.Tensor) -> None: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd: Forward,
               scale: float | None) -> torch.Tensor: ...


class DenseRuntime:
    """Dense attention for every layer, the baseline Kascade's decode is timed against under CUDA graphs.

    transformers' SDPA path cannot be captured at its best over a static cache: it then attends to the cache's
    whole capacity through an explicit mask (measured on the H200: 106 ms per token for a Llama-3.1-8B shape at
    128K, against 72 ms eager). This runtime serves a decode step with Kascade's dense split-K Triton kernel
    (metadata on the device, like Kascade's own decode) and prefill with PyTorch SDPA (cuDNN attention first,
    GQA native) when no sequence is padded and the prompt fills the cache from its start, else with the Triton
    dense kernel.
    """

    backend = "triton"

    def begin(self, fwd: Forward, q, k) -> None:
        fwd.step = ops.plan_step(q, k, kv_start=fwd.kv_start, q_offset=fwd.q_offset, backend=self.backend)

    def attend(self, layer: int, q, k, v, fwd: Forward, scale) -> torch.Tensor:
        st = fwd.step
        if not st.decode and st.q_offset == 0 and not bool(st.kv_start.any()):
            L = q.shape[2]
            return _sdpa_causal(q, k[:, :, :L], v[:, :, :L], scale)
        return ops.dense_attention(q, k, v, scale=scale, step=st)


def _sdpa_causal(q, k, v, scale):
    """Causal SDPA with cuDNN attention first in priority (the fastest dense prefill on Hopper; it needs the KV
    heads repeated to the query heads), then flash, memory-efficient and math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = q.shape[1] // k.shape[1]
    if q.device.type == "cuda" and G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=k.shape[1] != q.shape[1])


class NoAttention:
    """Zeros for every attention layer (attach it like any runtime): ``1 - t(no attention) / t(dense)`` is the
    share of a forward that dense attention takes."""

    def begin(self, fwd: Forward, q, k) -> None:
        pass

    def attend(self, layer: int, q, k, v, fwd: Forward, scale) -> torch.Tensor:
        return torch.zeros_like(q)
