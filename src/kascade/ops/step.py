"""The plan of one forward step (FlashInfer's plan / run split): what every layer's ops need, built once.

A model's forward runs the same key geometry through every layer: which key slots each sequence owns, where the
queries sit, how many keys each row keeps. :class:`Step` holds it, built once per forward by
:func:`kascade.ops.plan_step` and passed to the public ops (``step=``), which then check nothing that needs the
device and build nothing per layer. Budget counts come from :mod:`kascade.budget`.

These are the ops' per-call metadata, below the runtime: the runtime's pass object, :class:`kascade.Forward`, holds
one Step (``fwd.step``) beside the plan and the selections; a decode step's Step holds a :class:`DecodeMeta`
(``step.meta``) on the Triton backend, and in every decode step planned on the device (a static cache).

A decode step over a static KV cache can be planned from device tensors alone (:func:`decode_meta_static`): it
then reads nothing back to the host, so the step can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _renamed
from ..budget import Budget


@dataclass(frozen=True)
class DecodeMeta:
    """Per-sequence metadata of one decode step for the Triton kernels, shared by every layer of the step: the
    ``meta`` of its :class:`Step`.

    tensor: ``[B, 4]`` int32 on the device: first valid slot (0 when paged), valid keys ``n_b``, budget ``k_b``, 0.
    n, k:   the same ``n_b`` and ``k_b`` on the host (``k`` is ``None`` when no budget was given); for a step planned
            on the device (:func:`decode_meta_static`) they are launch bounds: the cache capacity (on the Triton
            backend rounded up, :func:`launch_bound`) and its budget.
    paged:  whether it describes a paged cache.
    fused:  whether :meth:`counts` and :meth:`with_counts` compute in one Triton launch
            (:func:`kascade.ops.triton.step.counts_tensor`, eager steps on a GPU) rather than about 18 torch ops.
    derived: tensors computed from it once per step (:meth:`with_counts`).
    """

    tensor: torch.Tensor
    n: tuple
    k: tuple | None
    paged: bool
    fused: bool = field(default=False, compare=False)
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_max(self) -> int:
        return max(self.n)

    @property
    def k_max(self) -> int:
        return max(self.k)

    @_renamed.keywords(_renamed.FACTOR, scale="factor")
    def counts(self, budget: Budget, factor: float) -> torch.Tensor:
        """``[B]`` int32 on the device: the keys each sequence keeps at budget multiplier ``factor``
        (:meth:`Budget.decode_counts` of ``n_b``), from device ops only (graph-capturable); memoised."""
        key = ("counts", float(factor))
        if key not in self.derived:
            if self.fused:
                self.derived[key] = self._counts_launch(budget, factor, rows=False)
            else:
                self.derived[key] = budget.decode_counts(self.tensor[:, 1].long(), factor).to(torch.int32).contiguous()
        return self.derived[key]

    @_renamed.keywords(_renamed.FACTOR, scale="factor")
    def with_counts(self, budget: Budget, factor: float) -> "DecodeMeta":
        """This metadata with each budget ``k_b`` replaced by the count at multiplier ``factor`` (what a ranked
        selection at that factor keeps), memoised."""
        key = ("with_counts", float(factor))
        if key not in self.derived:
            if self.fused:
                t = self._counts_launch(budget, factor, rows=True)
            else:
                t = self.tensor.clone()
                t[:, 2] = self.counts(budget, factor)
            self.derived[key] = DecodeMeta(tensor=t, n=self.n, k=tuple(budget.decode_counts(n, factor) for n in self.n),
                                           paged=self.paged, fused=self.fused)
        return self.derived[key]

    def _counts_launch(self, budget: Budget, factor: float, rows: bool) -> torch.Tensor:
        from .triton.step import counts_tensor

        return counts_tensor(self.tensor, budget.ratio, budget.k_min, factor, rows=rows)


def fused_step(device) -> bool:
    """Whether a decode step on ``device`` plans its metadata, and counts its keys at a budget multiplier, in one
    Triton launch each (:mod:`kascade.ops.triton.step`; :attr:`DecodeMeta.fused`): eagerly, on a GPU (or the
    interpreter)."""
    from .triton.step import usable

    return usable(device)


def decode_meta(B: int, *, device, kv_start=None, q_offset=None, seq_lens=None, budget: Budget | None = None,
                paged: bool = False, fused: bool = False) -> DecodeMeta:
    """:class:`DecodeMeta` from host values. Contiguous: ``kv_start`` (``None`` = zeros, list or tensor) and
    ``q_offset``. Paged: ``seq_lens`` (list or tensor; read on the host once). ``fused``: :attr:`DecodeMeta.fused`."""
    if paged:
        assert seq_lens is not None, "a paged cache needs seq_lens"
        n = [int(x) for x in torch.as_tensor(seq_lens).reshape(-1).tolist()]
        base = [0] * B
    else:
        assert q_offset is not None
        base = [0] * B if kv_start is None else [int(x) for x in torch.as_tensor(kv_start).reshape(-1).tolist()]
        n = [q_offset + 1 - s for s in base]
    assert len(n) == B and min(n) >= 1
    k = None if budget is None else [budget.decode(x) for x in n]
    rows = [[base[b], n[b], 0 if k is None else k[b], 0] for b in range(B)]
    t = torch.tensor(rows, dtype=torch.int32).to(device)
    return DecodeMeta(tensor=t, n=tuple(n), k=None if k is None else tuple(k), paged=paged, fused=fused)


def decode_meta_static(B: int, kv_start, q_offset: torch.Tensor, capacity: int, budget: Budget, *,
                       fused: bool = False) -> DecodeMeta:
    """:class:`DecodeMeta` of a decode step over a static KV cache, computed on the device with no host
    synchronisation. ``q_offset``: the new query's slot (0-d integer tensor on the device, the same for every
    sequence); ``kv_start``: ``[B]`` integer tensor on the device, or ``None`` (no left padding); ``capacity``: the
    cache's slots, or any larger bound (:func:`launch_bound`). The host ``n`` and ``k`` are launch bounds (the
    capacity and its budget: grid sizes and index widths; the budget never decreases with ``n``); the kernels read
    each sequence's ``n_b`` and ``k_b`` from the device tensor. ``fused``: in one Triton launch
    (:func:`kascade.ops.triton.step.meta_tensor`, eager only) instead of about ten torch ops, the same values."""
    if fused:
        from .triton.step import meta_tensor

        t = meta_tensor(kv_start, q_offset, B, budget.ratio, budget.k_min)
    else:
        dev = q_offset.device
        start = torch.zeros(B, dtype=torch.long, device=dev) if kv_start is None else kv_start.to(torch.long)
        n = q_offset.to(torch.long) + 1 - start  # [B] valid keys
        t = torch.stack([start, n, budget.decode(n), torch.zeros_like(n)], 1).to(torch.int32)
    return DecodeMeta(tensor=t, n=(int(capacity),) * B, k=(budget.decode(int(capacity)),) * B, paged=False,
                      fused=fused)


# A device-planned decode step's launch bound on the Triton backend: the key slots rounded up to a multiple of this.
LAUNCH_BOUND_STEP = 256


def launch_bound(keys: int) -> int:
    """The host bound of a device-planned decode step's keys on the Triton backend (:attr:`DecodeMeta.n`): ``keys``
    rounded up to a multiple of :data:`LAUNCH_BOUND_STEP`. A dynamic cache (transformers' default, eager
    ``generate``) grows by a key a step; with the bound its steps share their launch plans, index widths and kernel
    launches for 256 steps instead of making new ones each step. The kernels read each sequence's ``n_b`` from the
    device and never touch a slot at or past it, so a bound past the tensors' slots is only room: score rows
    (``B * HQ * bound`` fp32 a scoring pass), -1 padded index columns (``k(bound) - k(keys)``) and grid programs
    with nothing to do."""
    return -(-keys // LAUNCH_BOUND_STEP) * LAUNCH_BOUND_STEP


@dataclass(eq=False)
class Step:
    """One forward step's plan (see the module docstring): what the ops need, held by the pass's
    :class:`kascade.Forward` as ``fwd.step``. Build it with :func:`kascade.ops.plan_step`.

    backend:  "reference" or "triton"; budget: the budget every selection of the step uses.
    batch, q_heads, kv_heads, queries, keys, head_dim, dtype, device: the shapes every layer's ``q [B, HQ, L, D]``
              and ``k, v [B, H, N, D]`` have.
    kv_start: ``[B]`` int64 on the host: each sequence's first valid key slot; ``None`` in a step planned on the
              device (static-cache decode), whose geometry only ``meta`` holds.
    q_offset: key slot of the first query (``None`` with ``kv_start``).
    meta:     decode steps on the Triton backend, and every decode step planned on the device: :class:`DecodeMeta`
              (the ops then run the decode forms of :mod:`kascade.ops.library`).
    index_dtype: the dtype of the selections the step's ops make (int32 on the Triton backend: half the memory).
    """

    backend: str
    budget: Budget
    batch: int
    q_heads: int
    kv_heads: int
    queries: int
    keys: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_start: torch.Tensor | None
    q_offset: int | None
    meta: DecodeMeta | None = None
    index_dtype: torch.dtype = torch.long
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # the shapes every call of the step must have, compared whole on the hot path
        self.q_shape = torch.Size((self.batch, self.q_heads, self.queries, self.head_dim))
        self.k_shape = torch.Size((self.batch, self.kv_heads, self.keys, self.head_dim))

    @property
    def decode(self) -> bool:
        return self.queries == 1

    @property
    def on_device(self) -> bool:
        """Whether only the device knows the geometry (a static-cache decode step: graph-capturable)."""
        return self.kv_start is None

    def _host(self) -> None:
        if self.on_device:
            raise RuntimeError("this step was planned on the device (static-cache decode); its geometry is not on "
                               "the host")

    @property
    def n(self) -> torch.Tensor:
        """``[B]`` int64 on the host: each sequence's valid keys in this call."""
        self._host()
        return self.q_offset + self.queries - self.kv_start

    @property
    def longest(self) -> int:
        """The most valid keys any sequence has (on the host)."""
        return int(self.n.max())

    def tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: ``(first tile [B], tiles [B])`` of each sequence in this call (host)."""
        return self.budget.tiles(self.n, self.queries)

    @property
    def rows(self) -> int:
        """Rows of a selection made in this step: tiles of the longest run of tiles (1 in decode)."""
        return 1 if self.decode else int(self.tiles()[1].max())

    def on_host(self) -> "Step":
        """This step with its geometry read back to the host (one synchronisation: for what needs it, e.g. checking
        a selection's values, never on the hot path)."""
        if not self.on_device:
            return self
        t = self.meta.tensor.long().cpu()
        q_offset = int(t[0, 0] + t[0, 1]) - 1
        kv_start = t[:, 0].clone()
        meta = decode_meta(self.batch, device=self.device, kv_start=kv_start, q_offset=q_offset, budget=self.budget) \
            if self.backend == "triton" else None
        return Step(self.backend, self.budget, self.batch, self.q_heads, self.kv_heads, self.queries, self.keys,
                    self.head_dim, self.dtype, self.device, kv_start, q_offset, meta, self.index_dtype)

    def zeros(self) -> torch.Tensor:
        """``[B]`` int64 zeros on the step's device (a decode selection's ``row_start``), made once per step."""
        if "zeros" not in self._memo:
            self._memo["zeros"] = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        return self._memo["zeros"]

    def starts_on_device(self) -> torch.Tensor:
        """``kv_start`` as an int32 tensor on the step's device (copied once per step)."""
        if "starts" not in self._memo:
            self._memo["starts"] = self.kv_start.to(torch.int32).to(self.device)
        return self._memo["starts"]

    def candidates(self) -> torch.Tensor:
        """``[B, R]`` int64 on the step's device: the keys each row may choose from (decode: the sequence's valid
        keys; prefill: the keys before the row's tile), from device ops only in a step planned on the device."""
        if self.meta is not None:
            return self.meta.tensor[:, 1].long()[:, None]
        if self.decode:
            return self.n[:, None].to(self.device)
        first, _ = self.tiles()
        return ((first[:, None] + torch.arange(self.rows)[None, :]) * self.budget.tile).to(self.device)

    @_renamed.keywords(_renamed.FACTOR, scale="factor")
    def counts(self, factor: float) -> tuple[torch.Tensor, int]:
        """The keys each row keeps at budget multiplier ``factor`` (:mod:`kascade.budget`): int32 on the step's
        device, ``[B]`` in decode or ``[B, R]`` in prefill, and the largest of them (a host bound: the width of
        the index rows they need). Memoised per step and factor; from device ops only in a step planned on the
        device."""
        key = ("counts", float(factor))
        if key not in self._memo:
            if self.meta is not None:
                most = max(self.budget.decode_counts(n, factor) for n in self.meta.n)
                self._memo[key] = (self.meta.counts(self.budget, factor), most)
            elif self.decode:
                c = self.budget.decode_counts(self.n, factor)
                self._memo[key] = (c.to(torch.int32).to(self.device), int(c.max()))
            else:
                first, _ = self.tiles()
                c = self.budget.row_counts(self.n, first, self.rows, factor)
                self._memo[key] = (c.to(torch.int32).to(self.device), int(c.max()) if c.numel() else 0)
        return self._memo[key]


__all__ = ["DecodeMeta", "LAUNCH_BOUND_STEP", "Step", "decode_meta", "decode_meta_static", "fused_step",
           "launch_bound"]
