"""Kascade attention for a JAX model's layers: the twin of :class:`kascade.Attention` for JAX arrays.

    attn = kascade.jax.Attention(plan, backend="reference")    # once per model
    for every forward pass (a prefill, a chunk of one, or one decode step):
        fwd = kascade.jax.Forward(kv_start=..., q_offset=...)   # its key geometry (defaults: no padding, new keys last)
        for every layer:  out = attn(layer, q, k, v, fwd)       # q [B, HQ, L, D], k, v [B, H, N, D] (the whole cache)

Layer 0 of a pass checks the arrays against the plan and the geometry once; every later layer of the pass reuses
that (no per-layer checks of values, no re-planning) and the anchors' selections the pass made, as the PyTorch
runtime does. The layer kinds are the plan's: layer 0 dense (and it selects), anchors select and attend their
selection, reuse layers attend their anchor's selection through the head map.

Backends:

- ``"reference"``: :mod:`kascade.jax.reference` (``jax.numpy``), any device; the whole layer loop may run under
  ``jax.jit`` (``q_offset`` static: close over it, ``kv_start`` may be traced). It serves the paper's reuse rule
  (anchors + head map); plans with another rule (per-layer budgets, sources, sinks + recent, length-aware plans)
  are refused.
- ``"triton"``: the PyTorch runtime (:class:`kascade.Attention`, backend "triton") on the same buffers through
  DLPack, eagerly: one step plan per pass, the fused layer-0 kernel, every reuse rule, selections kept as torch
  tensors between layers. JAX arrays on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``); not under a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from ..plan import KascadePlan
from . import reference
from .reference import Selection

BACKENDS = ("reference", "triton")


@dataclass(eq=False)
class Forward:
    """One forward pass through the layers (a prefill, a chunk, or one decode step): everything its layers share, as
    :class:`kascade.Forward` holds it for the PyTorch runtime.

    Given when the pass starts:

    kv_start: ``[B]`` each sequence's first valid key slot (left padding before it; default: none): a NumPy or JAX
              integer array (traced under jit with the reference backend).
    q_offset: key slot of the first query, a Python int (default: the last ``L`` slots hold the new queries).

    Filled in at layer 0 by the :class:`Attention`, read by every later layer of the pass:

    geometry:   ``(kv_start, q_offset)`` as layer 0 checked them (defaults filled in).
    shapes:     layer 0's ``q`` and ``k`` shapes, which every later layer must have (reference backend).
    selections: the anchors' selections so far, by layer (reference backend).
    torch:      the backend "triton" runs the PyTorch runtime: its :class:`kascade.Forward` of this pass, which holds
                the step plan, the plan and the selections as torch tensors.
    """

    kv_start: object = None
    q_offset: int | None = None
    geometry: tuple | None = None
    shapes: tuple | None = None
    selections: dict = field(default_factory=dict)
    torch: object = None


class Attention:
    """Kascade attention for every layer of one JAX model, by its plan: ``attn(layer, q, k, v, fwd)``."""

    def __init__(self, plan: KascadePlan, backend: str = "reference"):
        if not isinstance(plan, KascadePlan):
            raise TypeError(f"plan must be a kascade.KascadePlan, got {type(plan).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        if backend == "reference" and (plan.ranked or plan.by_length):
            what = "a length-aware plan (by_length)" if plan.by_length else f"the reuse rule {plan.reuse}"
            raise ValueError(f"kascade.jax.Attention with backend='reference' serves the paper's reuse rule (anchors "
                             f"and head map); this plan has {what}: use backend='triton' (the PyTorch runtime)")
        if backend == "reference" and plan.dense_tail:
            raise ValueError(f"kascade.jax.Attention with backend='reference' attends every query by the plan; this "
                             f"plan prefills its last {plan.dense_tail} queries densely (dense_tail): use "
                             "backend='triton' (the PyTorch runtime)")
        self.plan = plan
        self.backend = backend
        if backend == "triton":
            from ..attention import Attention as TorchAttention

            self._torch = TorchAttention(plan, backend="triton")

    def __call__(self, layer: int, q, k, v, fwd: Forward, scale: float | None = None):
        """Layer ``layer``'s attention in the pass ``fwd``: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]`` -> ``[B, HQ,
        L, D]`` in ``q``'s dtype; ``scale`` defaults to ``D ** -0.5``. Layer 0 runs first in every pass."""
        if not isinstance(fwd, Forward):
            raise TypeError(f"fwd must be a kascade.jax.Forward, got {type(fwd).__name__}")
        n = self.plan.num_layers
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
            raise ValueError(f"layer must be an integer in 0..{n - 1} (the plan's layers), got {layer!r}")
        layer = int(layer)
        if layer == 0:
            self._begin(q, k, v, fwd)
        elif fwd.geometry is None:
            raise RuntimeError(f"Kascade: layer {layer} ran before layer 0 in this forward pass")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.backend == "triton":
            return self._triton(layer, q, k, v, fwd.torch, scale)
        return self._reference(layer, q, k, v, fwd, scale)

    # -- per pass ----------------------------------------------------------------------------------------------
    def _begin(self, q, k, v, fwd: Forward) -> None:
        """Check layer 0's arrays and the pass's geometry, and fill in ``fwd`` afresh (nothing of an earlier pass
        carries over)."""
        from . import _geometry

        fwd.geometry, fwd.shapes, fwd.selections, fwd.torch = None, None, {}, None
        fp = self.plan.fingerprint
        kv_start, q_offset = _geometry(q, k, v, fwd.kv_start, fwd.q_offset, self.backend)
        want = (fp.num_q_heads, fp.num_kv_heads, fp.head_dim)
        if (q.shape[1], k.shape[1], q.shape[-1]) != want:
            raise ValueError(f"the plan was made for {want[0]} query / {want[1]} KV heads of dim {want[2]}; q "
                             f"{tuple(q.shape)} and k {tuple(k.shape)} have {q.shape[1]} / {k.shape[1]} of dim "
                             f"{q.shape[-1]}")
        if self.backend == "triton":
            import torch

            from ..attention import Forward as TorchForward

            fwd.torch = TorchForward(kv_start=torch.as_tensor(np.asarray(kv_start), dtype=torch.long),
                                     q_offset=q_offset)
        else:
            fwd.shapes = (tuple(q.shape), tuple(k.shape))
        fwd.geometry = (kv_start, q_offset)

    # -- the backends ------------------------------------------------------------------------------------------
    def _reference(self, layer, q, k, v, fwd: Forward, scale):
        if (tuple(q.shape), tuple(k.shape)) != fwd.shapes or v.shape != k.shape:
            raise ValueError(f"layer {layer}: q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} differ "
                             f"from layer 0's q {fwd.shapes[0]} / k {fwd.shapes[1]} in this pass")
        plan, sels = self.plan, fwd.selections
        kv_start, q_offset = fwd.geometry
        geo = dict(scale=scale, kv_start=kv_start, q_offset=q_offset)
        for a in [a for a in sels if plan.last_reader(a) < layer]:
            del sels[a]  # no later layer reads it
        if plan.is_anchor(layer):
            sels[layer] = reference.select(q, k, budget=plan.budget, **geo)
            if layer == 0:
                return reference.dense_attention(q, k, v, **geo)
            sel = sels[layer]
        else:
            sel = sels[plan.anchor_of(layer)]
            if plan.head_map[layer] != tuple(range(k.shape[1])):
                sel = sel.take_heads(plan.head_map[layer])
        return reference.sparse_attention(q, k, v, sel, **geo)

    def _triton(self, layer, q, k, v, tfwd, scale):
        from . import bridge

        # Layer 0 checked the arrays (bridge.unavailable_reason); later layers only refuse a trace, which DLPack
        # could not export (a wrong device or shape is refused by the torch runtime against the pass's step).
        if any(isinstance(x, jax.core.Tracer) for x in (q, k, v)):
            raise ValueError(bridge._TRACED)
        out = self._torch(layer, bridge._torch(q), bridge._torch(k), bridge._torch(v), tfwd, scale)
        return bridge._jax(out)


__all__ = ["Attention", "Forward", "Selection"]
