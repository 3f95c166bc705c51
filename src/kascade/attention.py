"""Kascade attention for a model's layers: the API for people who write their own models, and what the
transformers integration runs on.

    attn = kascade.Attention(plan)                              # once per model
    for every forward pass (a prefill, a chunk of one, or one decode step):
        fwd = kascade.Forward(kv_start=..., q_offset=...)       # its key geometry (defaults: no padding, new keys last)
        for every layer:  out = attn(layer, q, k, v, fwd)       # q [B, HQ, L, D], k, v [B, H, N, D] (the whole cache)

One :class:`Forward` holds everything a pass's layers share, and belongs to that pass alone (concurrent passes never
share one): the key geometry it was made with, then what layer 0 fills in (``Attention.begin``): the step plan
(:func:`kascade.ops.plan_step`: shapes, budget, backend and, in a decode step, the kernels' per-sequence metadata),
the (sub-)plan serving the pass, and the anchors' selections as the layers make them. Every layer is then one of
three kinds:

- layer 0: dense output and its selection (one pass where the backend fuses them);
- anchor:  its own selection, then sparse attention over it;
- reuse:   the keys its plan's reuse rule takes from the anchors' selections (:mod:`kascade.reuse`), then sparse
           attention over them.

A decode step over a static cache may give ``q_offset`` as a 0-d tensor on the device (and ``kv_start`` as a device
tensor): with the Triton backend the step then reads nothing back to the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import copy
import numbers
import threading
from dataclasses import dataclass, field

import torch

from . import _renamed, ops, reuse
from .ops import Selection, Step
from .tensor_parallel import gather_heads
from .plan import KascadePlan


@dataclass(eq=False)
class Forward:
    """One forward pass through the layers (a prefill, a chunk of one, or one decode step): everything its layers
    share, in one object that belongs to this pass alone.

    Given when the pass starts (by the caller, or by Kascade's mask function in the transformers integration, whose
    :class:`~kascade.integration.functions.KeyMask` is a Forward made from the padding mask):

    kv_start: ``[B]`` each sequence's first valid key slot (left padding before it; default: none), on the host, or
              on the device in a static-cache decode step.
    q_offset: key slot of the first query (default: the last ``L`` slots hold the new queries); a 0-d device tensor
              in a static-cache decode step.
    refused:  why no layer can run in this pass (the transformers integration's mask kinds Kascade does not serve).

    Filled in at layer 0 by the runtime's ``begin(fwd, q, k)`` (:meth:`Attention.begin`), read by every later layer:

    step:       the ops' plan of the pass (:class:`kascade.ops.Step`, from :func:`kascade.ops.plan_step`): shapes,
                budget, backend, the geometry on the host and, in a decode step on the Triton backend or planned on
                the device, the kernels' per-sequence metadata (``step.meta``, a :class:`kascade.ops.step.DecodeMeta`).
                Built once, passed to every op of the pass as ``step=``.
    plan:       the plan serving the pass (a length-aware plan's sub-plan for the pass's longest sequence).
    selections: the anchors' selections so far, by layer; each is dropped once no later layer reads it.
    tail:       in a pass of more than one query whose plan has ``dense_tail``, the step of its last
                ``min(dense_tail, L)`` queries, which every layer attends densely (None otherwise).
    begun:      whether layer 0 has run (a later layer of a pass that never ran it is refused).
    """

    kv_start: object = None
    q_offset: object = None
    refused: str | None = None
    step: Step | None = None
    plan: KascadePlan | None = None
    selections: dict[int, Selection] = field(default_factory=dict)
    tail: Step | None = None
    begun: bool = False

    def at_layer(self, runtime, layer: int, q, k) -> "Forward":
        """This pass, ready for ``layer``: at layer 0 ``runtime.begin`` fills it in afresh (the step, plan and
        selections of an earlier pass never carry over)."""
        if self.refused:
            raise ValueError(self.refused)
        if layer == 0:
            self.step, self.plan, self.selections, self.tail, self.begun = None, None, {}, None, False
            runtime.begin(self, q, k)
            self.begun = True
        elif not self.begun:
            raise RuntimeError(f"Kascade: layer {layer} ran before layer 0 in this forward pass")
        return self


class Attention:
    """Kascade attention for every layer of one model, by its plan: ``attn(layer, q, k, v, fwd)``.

    ``backend``: "auto" (the Triton kernels on CUDA when they serve the tensors' dtype and shapes, else the
    reference; decided once per forward pass, from layer 0's tensors), "reference" (the PyTorch specification) or
    "triton" (the kernels of :mod:`kascade.ops.triton`; an error where they cannot run). ``selector`` (default: Kascade's exact pooled top-k,
    :func:`kascade.ops.select`) is what an anchor layer calls to choose its keys, as ``selector(q, k, scale=...,
    step=...)``; the evaluation baselines (StreamingLLM, Quest, ...) swap it and keep everything else, so every
    strategy runs through the same sparse attention. With ``account=True`` the runtime sums, per layer, the keys
    actually attended and the keys dense attention would attend (``self.attended``: layer -> [attended, dense]).
    """

    def __init__(self, plan: KascadePlan, backend: str = "auto", *, selector=None, account: bool = False,
                 shard=None, exchange: bool = False):
        if not isinstance(plan, KascadePlan):
            raise TypeError(f"plan must be a kascade.KascadePlan, got {type(plan).__name__}")
        if backend not in ("auto", *ops.BACKENDS):
            raise ValueError(f"unknown backend {backend!r}; choose one of {('auto', *ops.BACKENDS)}")
        if exchange and shard is None:
            raise ValueError("exchange=True exchanges selections between tensor-parallel ranks: give their shard")
        plans = (plan, *(p for _, p in plan.by_length))
        if selector is not None and any(p.ranked for p in plans):
            raise ValueError("a plan with a ranked reuse rule (per-layer budgets, sources, sinks + recent) selects "
                             "with its own ranking; pass selector=None")
        self.plan = plan
        self.backend = backend
        self.selector = selector
        self.account = account
        # Tensor parallelism (kascade.tensor_parallel): this rank's KV heads, and whether the anchors'
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
    def begin(self, fwd: Forward, q, k) -> None:
        """Plan the pass ``fwd`` whose layer 0 receives ``q``, ``k``: its ``step`` and ``plan`` (``fwd.kv_start`` /
        ``fwd.q_offset``: host values, or device tensors in a static-cache decode step; read, never changed)."""
        kv_start, q_offset = fwd.kv_start, fwd.q_offset
        if self.host_geometry and isinstance(q_offset, torch.Tensor):
            q_offset = int(q_offset)
            kv_start = None if kv_start is None else kv_start.cpu()
        backend = self.backend
        if backend == "auto":
            backend = ops.resolve_backend(backend, q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1],
                                          self.plan.budget)
        fwd.step = ops.plan_step(q, k, budget=self.plan.budget, kv_start=kv_start, q_offset=q_offset, backend=backend)
        fwd.plan = self.plan.for_length(fwd.step.longest) if self.plan.by_length else self.plan
        step = fwd.step
        if fwd.plan.dense_tail and step.queries > 1:  # the pass's last queries: dense in every layer
            t = min(fwd.plan.dense_tail, step.queries)
            fwd.tail = ops.plan_step(q[:, :, -t:], k, budget=step.budget, kv_start=step.kv_start,
                                     q_offset=step.q_offset + step.queries - t, backend=backend)

    def __call__(self, layer: int, q, k, v, fwd: "Forward", scale: float | None = None) -> torch.Tensor:
        """Layer ``layer``'s attention in the forward pass ``fwd``: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]`` ->
        ``[B, HQ, L, D]``; ``scale`` defaults to ``D ** -0.5``. Layer 0 runs first in every pass. The layer index and
        layer 0's head counts and head dim are checked against the plan (its shard's under tensor parallelism); each
        op checks its tensors against layer 0's."""
        if not isinstance(fwd, Forward):
            raise TypeError(f"fwd must be a kascade.Forward, got {type(fwd).__name__}")
        n = self.plan.num_layers
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < n:
            raise ValueError(f"layer must be an integer in 0..{n - 1} (the plan's layers), got {layer!r}")
        layer = int(layer)
        if layer == 0:
            self._check_heads(q, k, v)
        return self.attend(layer, q, k, v, fwd.at_layer(self, layer, q, k), scale)

    def _check_heads(self, q, k, v) -> None:
        fp = self.plan.fingerprint
        kv = fp.num_kv_heads if self.shard is None else self.shard.count
        want = (kv * (fp.num_q_heads // fp.num_kv_heads), kv, fp.head_dim)
        shapes = [tuple(getattr(t, "shape", ())) for t in (q, k, v)]
        if any(len(s) != 4 for s in shapes):
            raise ValueError(f"q, k, v must be [B, heads, tokens, head_dim] tensors, got shapes {shapes}")
        got = (shapes[0][1], shapes[1][1], shapes[0][3])
        if got != want or shapes[2][1] != got[1] or shapes[1][3] != got[2] or shapes[2][3] != got[2]:
            where = "" if self.shard is None else f" (this rank's shard of {fp.num_kv_heads} KV heads)"
            raise ValueError(f"the plan was made for {want[0]} query / {want[1]} KV heads of dim {want[2]}{where}; "
                             f"got q {shapes[0]}, k {shapes[1]}, v {shapes[2]}")

    def __deepcopy__(self, memo):
        """A copy with its own lock (a lock cannot be copied; copying an enabled model copies its runtime)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, threading.Lock() if name == "_lock" else copy.deepcopy(value, memo))
        return new

    def attend(self, layer: int, q, k, v, fwd: Forward, scale) -> torch.Tensor:
        """:meth:`__call__` in a pass that :meth:`begin` planned (the protocol of every runtime
        :func:`kascade.integration.hf.attach` takes, :class:`kascade.integration.runtime.Runtime`)."""
        plan, step, sels = fwd.plan, fwd.step, fwd.selections
        for a in [a for a in sels if plan.last_reader(a) < layer]:
            del sels[a]  # no later layer reads it: free it before this layer allocates its own
        if plan.is_anchor(layer):
            rank_factor = plan.rank_factor(layer) if plan.ranked else None
            if layer == 0:
                if self.selector is None:
                    out, sel = ops.dense_select(q, k, v, scale=scale, step=step, rank_factor=rank_factor)
                else:
                    out = ops.dense_attention(q, k, v, scale=scale, step=step)
                    sel = self.selector(q, k, scale=scale, step=step)
                sels[0] = gather_heads(sel, self.shard) if self.exchange else sel
                if self.account:
                    self._count(layer, None, step)
                return out
            if self.selector is None:
                sel = ops.select(q, k, scale=scale, step=step, rank_factor=rank_factor)
            else:
                sel = self.selector(q, k, scale=scale, step=step)
            sels[layer] = gather_heads(sel, self.shard) if self.exchange else sel
        keys, head_map = reuse.layer_keys(plan, layer, sels, step, self.heads)
        if self.account:
            self._count(layer, keys if head_map is None else keys.take_heads(head_map), step, fwd.tail)
        out = ops.sparse_attention(q, k, v, keys, scale=scale, step=step, heads=head_map)
        if fwd.tail is not None:  # the pass's last queries attend every key (over the sparse pass's rows: one tile)
            t = fwd.tail.queries
            out[:, :, -t:] = ops.dense_attention(q[:, :, -t:], k, v, scale=scale, step=fwd.tail)
        return out

    def _count(self, layer: int, sel: Selection | None, step: Step, tail: Step | None = None) -> None:
        t = 0 if tail is None or sel is None else tail.queries
        att, dense = ops.attended_keys(sel, kv_start=step.kv_start, q_offset=step.q_offset, L=step.queries - t,
                                       num_kv_heads=step.kv_heads)
        if t:  # the tail's queries attend every key
            a, d = ops.attended_keys(None, kv_start=tail.kv_start, q_offset=tail.q_offset, L=t,
                                     num_kv_heads=step.kv_heads)
            att, dense = att + a, dense + d
        with self._lock:
            tot = self.attended.setdefault(layer, [0, 0])
            tot[0] += att
            tot[1] += dense


__getattr__ = _renamed.module_getattr(__name__, "one object holds a pass: its step, plan and selections",
                                      ForwardState="Forward")
