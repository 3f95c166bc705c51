"""The runtime: every attention layer of an enabled model, computed by its plan through the public ops.

Per forward pass (one prefill or one decode step) layer 0 plans the step once (:func:`kascade.ops.plan_step`: key
geometry, decode metadata, budgets) and keeps it, with the anchors' selections, in a :class:`ForwardState` that
belongs to that forward alone (it travels with the forward's mask object, so concurrent forwards never share one).
Every layer is then one of three kinds:

- layer 0: dense output and its selection (one pass where the backend fuses them);
- anchor:  its own selection, then sparse attention over it;
- reuse:   the keys its plan's reuse rule takes from the anchors' selections (:mod:`kascade.reuse`), then sparse
           attention over them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .. import ops, reuse
from ..ops import Selection, Step
from ..plan import KascadePlan
from .tensor_parallel import gather_heads


@dataclass
class ForwardState:
    """One forward pass: its step plan, the (sub-)plan serving it, and the anchors' selections so far."""

    step: Step
    plan: KascadePlan
    selections: dict[int, Selection] = field(default_factory=dict)


class KascadeRuntime:
    """Computes every layer's attention for one enabled model according to its plan.

    ``backend``: "reference" (the PyTorch specification) or "triton" (the kernels of :mod:`kascade.ops.triton`); see
    :func:`kascade.integration.hf.resolve_backend`. ``selector`` (default: Kascade's exact pooled top-k,
    :func:`kascade.ops.select`) is what an anchor layer calls to choose its keys, as ``selector(q, k, scale=...,
    step=...)``; the evaluation baselines (StreamingLLM, Quest, ...) swap it and keep everything else, so every
    strategy runs through the same sparse attention. With ``account=True`` the runtime sums, per layer, the keys
    actually attended and the keys dense attention would attend (``self.attended``: layer -> [attended, dense]).
    """

    def __init__(self, plan: KascadePlan, backend: str = "reference", selector=None, account: bool = False,
                 shard=None, exchange: bool = False):
        if backend not in ops.BACKENDS:
            raise ValueError(f"KascadeRuntime takes backend 'reference' or 'triton' (resolve 'auto' with "
                             f"resolve_backend), got {backend!r}")
        plans = (plan, *(p for _, p in plan.by_length))
        if selector is not None and any(p.ranked for p in plans):
            raise ValueError("a plan with a ranked reuse rule (per-layer budgets, sources, sinks + recent) selects "
                             "with its own ranking; pass selector=None")
        self.plan = plan
        self.backend = backend
        self.selector = selector
        self.account = account
        # Tensor parallelism (kascade.integration.tensor_parallel): this rank's KV heads, and whether the anchors'
        # selections are exchanged between ranks (else the plan must be shard-local).
        self.shard, self.exchange = shard, exchange
        self.heads = reuse.Heads(shard, gathered=exchange)
        self.attended: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        # What needs each sequence's geometry on the host (a static-cache decode step then reads it back once):
        # a custom selector, accounting, merged reuse rules and the choice of a sub-plan by length.
        self.host_geometry = (selector is not None or account or bool(plan.by_length)
                              or any(p.reuse.sources is not None or p.reuse.recent for p in plans))

    # -- per forward -------------------------------------------------------------------------------------------
    def begin(self, q, k, kv_start, q_offset) -> ForwardState:
        """Plan the forward whose layer 0 receives ``q``, ``k`` (``kv_start`` / ``q_offset``: host values, or device
        tensors in a static-cache decode step)."""
        if self.host_geometry and isinstance(q_offset, torch.Tensor):
            q_offset = int(q_offset)
            kv_start = None if kv_start is None else kv_start.cpu()
        step = ops.plan_step(q, k, budget=self.plan.budget, kv_start=kv_start, q_offset=q_offset,
                             backend=self.backend)
        plan = self.plan.for_length(step.longest) if self.plan.by_length else self.plan
        return ForwardState(step=step, plan=plan)

    def attend(self, layer: int, q, k, v, fs: ForwardState, scale) -> torch.Tensor:
        """``q [B, HQ, L, D]``, ``k, v [B, H, N, D]`` of ``layer`` in the forward ``fs`` -> ``[B, HQ, L, D]``."""
        plan, step, sels = fs.plan, fs.step, fs.selections
        for a in [a for a in sels if plan.last_reader(a) < layer]:
            del sels[a]  # no later layer reads it: free it before this layer allocates its own
        if plan.is_anchor(layer):
            depth = plan.depth(layer) if plan.ranked else None
            if layer == 0:
                if self.selector is None:
                    out, sel = ops.dense_select(q, k, v, scale=scale, step=step, depth=depth)
                else:
                    out = ops.dense_attention(q, k, v, scale=scale, step=step)
                    sel = self.selector(q, k, scale=scale, step=step)
                sels[0] = gather_heads(sel, self.shard) if self.exchange else sel
                if self.account:
                    self._count(layer, None, step)
                return out
            if self.selector is None:
                sel = ops.select(q, k, scale=scale, step=step, depth=depth)
            else:
                sel = self.selector(q, k, scale=scale, step=step)
            sels[layer] = gather_heads(sel, self.shard) if self.exchange else sel
        keys = reuse.layer_selection(plan, layer, sels, step, self.heads)
        if self.account:
            self._count(layer, keys, step)
        return ops.sparse_attention(q, k, v, keys, scale=scale, step=step)

    def _count(self, layer: int, sel: Selection | None, step: Step) -> None:
        att, dense = ops.attended_keys(sel, kv_start=step.kv_start, q_offset=step.q_offset, L=step.queries,
                                       num_kv_heads=step.kv_heads)
        with self._lock:
            tot = self.attended.setdefault(layer, [0, 0])
            tot[0] += att
            tot[1] += dense


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

    def begin(self, q, k, kv_start, q_offset) -> ForwardState:
        step = ops.plan_step(q, k, kv_start=kv_start, q_offset=q_offset, backend=self.backend)
        return ForwardState(step=step, plan=None)

    def attend(self, layer: int, q, k, v, fs: ForwardState, scale) -> torch.Tensor:
        st = fs.step
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

    def begin(self, q, k, kv_start, q_offset):
        return None

    def attend(self, layer: int, q, k, v, state, scale) -> torch.Tensor:
        return torch.zeros_like(q)
