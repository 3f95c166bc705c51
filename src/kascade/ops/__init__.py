"""Public Kascade attention ops: argument checks, defaults and backend dispatch.

Tensor layout: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]``, outputs ``[B, HQ, L, D]`` in the input dtype; ``HQ`` a
multiple of ``H`` (``G = HQ / H``); query head ``hq`` reads KV head ``hq // G``.

Which keys a sequence sees: key slots ``[kv_start[b], q_offset + L)`` are valid for sequence ``b`` (left padding
sits before ``kv_start[b]``; slots from ``q_offset + L`` on are unused cache space), and query ``i`` sits at slot
``q_offset + i``. Defaults: ``kv_start = 0`` for all sequences, ``q_offset = N - L`` (the new queries are the last
``L`` keys, as in a dynamic KV cache). Positions, tiles and budgets count from a sequence's first valid key, so
a left-padded sequence is treated exactly as if it ran alone.

A call with ``L == 1`` is a decode step; ``L > 1`` is (chunked) prefill in tiles of ``budget.tile`` queries.

Plan / run: :func:`plan_step` checks the geometry once and builds what every layer of a forward step needs (a
:class:`Step`); the ops then take ``step=`` instead of ``kv_start`` / ``q_offset`` / ``budget`` / ``backend`` and
check only what costs nothing (shapes). Called without ``step`` an op plans its own. Each op then runs one of the
torch custom ops of :mod:`kascade.ops.library` (tensors and numbers in, tensors out), so that ``torch.compile`` traces
a forward step through them; a decode step planned from device tensors runs their decode forms, which read nothing
back to the host.

Backends: ``"reference"`` (pure PyTorch, any device: the specification) and ``"triton"`` (CUDA tensors, fp16 /
bf16 / fp32, ``D`` in {16, 32, 64, 128, 256}, ``G <= 16``; decode and prefill kernels in :mod:`kascade.ops.triton`).
Asking for ``"triton"`` where it cannot run is an error, never a silent fallback. With ``TRITON_INTERPRET=1`` the
Triton kernels also run on CPU tensors (slowly: for tests).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import torch

from .. import _renamed
from ..budget import Budget
from . import library, reference
from .geometry import check_dtypes, check_scale, check_shapes
from .selection import Selection
from .step import Step, decode_meta, decode_meta_static, fused_step, launch_bound

__all__ = ["Budget", "Selection", "Step", "attended_keys", "dense_attention", "dense_select", "plan_step",
           "resolve_backend", "select", "sparse_attention"]

BACKENDS = ("reference", "triton")
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_GROUP = 16


def triton_unavailable_reason(device, dtype=None, head_dim=None, group=None) -> str | None:
    """Why the Triton backend cannot serve these inputs (None if it can)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if torch.device(device).type != "cuda" and not interpreting:
        return f"backend='triton' needs CUDA tensors, got {torch.device(device).type} (use backend='reference')"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "backend='triton' needs triton: pip install 'kascade[triton]'"
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"backend='triton' supports fp16, bf16 and fp32, got {dtype}"
    if head_dim is not None and head_dim not in TRITON_HEAD_DIMS:
        return f"backend='triton' supports head dims {TRITON_HEAD_DIMS}, got {head_dim}"
    if group is not None and group > TRITON_MAX_GROUP:
        return f"backend='triton' supports GQA groups up to {TRITON_MAX_GROUP} query heads per KV head, got {group}"
    return None


def triton_budget_refusal(budget: Budget) -> str | None:
    """Why the Triton kernels cannot select with this budget (None if they can): the budget options the reference
    alone implements. The one place that says so (:func:`resolve_backend`, :func:`plan_step`)."""
    if budget.mass is not None:
        return "backend='triton' selects by count: a budget by attention mass (budget.mass) runs on 'reference'"
    return None


def resolve_backend(backend: str, device, dtype=None, head_dim=None, group=None, budget: Budget | None = None) -> str:
    """The backend that serves these inputs: ``"auto"`` is "triton" on a CUDA device whose dtype, head dim and group
    the kernels serve (and with triton installed), else "reference"; ``"triton"`` where it cannot run raises
    ValueError with the reason (never replaced silently); ``"reference"`` runs anywhere. A ``budget`` the kernels
    do not implement (:func:`triton_budget_refusal`: by attention mass) selects on the reference only.
    The one rule every caller (``enable``, the runtime per pass, ``kascade costs``) applies."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; choose one of {('auto', *BACKENDS)}")
    if backend == "reference":
        return backend
    why = triton_unavailable_reason(device, dtype, head_dim, group)
    if why is None and budget is not None:
        why = triton_budget_refusal(budget)
    if backend == "triton":
        if why:
            raise ValueError(why)
        return backend
    return "triton" if why is None and torch.device(device).type == "cuda" else "reference"


# ----------------------------------------------------------------------------------------------------------------
# Planning: every check that needs values, once per step
# ----------------------------------------------------------------------------------------------------------------
def _check_tensors(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None and name == "v":
            continue  # selection needs no values
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    check_shapes(q, k, v)
    devs = {x.device for x in (q, k, v) if x is not None}
    if len(devs) > 1:
        raise ValueError(f"q, k, v are on different devices: {sorted(map(str, devs))}")


def plan_step(q, k, *, budget: Budget | None = None, kv_start=None, q_offset=None,
              backend: str = "reference") -> Step:
    """Check the geometry of one forward step and build its :class:`Step` (shared by every layer's ops).

    ``q [B, HQ, L, D]`` and ``k [B, H, N, D]`` give the shapes (any layer's). ``kv_start`` ([B], default zeros)
    and ``q_offset`` (default ``N - L``): see the module docstring. A decode step (``L == 1``) may give them as
    tensors on the device (``q_offset`` 0-d, ``kv_start`` [B] or None; a static KV cache): the step is then planned
    with device ops only, on either backend, and its ops read nothing back to the host (it can be captured in a CUDA
    graph or traced by ``torch.compile``); in prefill device values are read back once.
    """
    _check_tensors(q, k, None)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    budget = Budget() if budget is None else budget
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a kascade.Budget, got {type(budget).__name__}")
    B, HQ, L, D = q.shape
    _, H, N, _ = k.shape
    index_dtype = torch.long
    if backend == "triton":
        why = triton_unavailable_reason(q.device, q.dtype, D, HQ // H)
        if why:
            raise ValueError(why)
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            raise ValueError("backend='triton' needs the head dim contiguous (stride 1) in q, k and v")
        index_dtype = torch.int32
        why = triton_budget_refusal(budget)
        if why:
            raise ValueError(why)
    shape = dict(backend=backend, budget=budget, batch=B, q_heads=HQ, kv_heads=H, queries=L, keys=N, head_dim=D,
                 dtype=q.dtype, device=q.device, index_dtype=index_dtype)
    if isinstance(q_offset, torch.Tensor):
        if q_offset.numel() != 1:
            raise ValueError(f"q_offset must be one slot for the whole batch, got shape {tuple(q_offset.shape)}")
        if L == 1:  # static-cache decode: plan on the device, read nothing back
            starts = None if kv_start is None else torch.as_tensor(kv_start).to(q.device)
            if starts is not None and starts.shape != (B,):
                raise ValueError(f"kv_start must have shape [B]=[{B}], got {tuple(starts.shape)}")
            bound = launch_bound(N) if backend == "triton" else N
            meta = decode_meta_static(B, starts, q_offset.reshape(()).to(q.device), bound, budget,
                                      fused=backend == "triton" and fused_step(q.device))
            return Step(kv_start=None, q_offset=None, meta=meta, **shape)
        q_offset = int(q_offset)
    if q_offset is None:
        q_offset = N - L
    if isinstance(q_offset, bool) or not isinstance(q_offset, numbers.Integral):
        raise TypeError(f"q_offset must be an integer, got {q_offset!r}")
    q_offset = int(q_offset)
    if not (0 <= q_offset <= N - L):
        raise ValueError(f"q_offset={q_offset} puts the {L} queries outside the {N} key slots")
    kv_start = torch.zeros(B, dtype=torch.long) if kv_start is None else torch.as_tensor(kv_start)
    if kv_start.is_floating_point() or kv_start.dtype == torch.bool:
        raise TypeError(f"kv_start must hold integers, got {kv_start.dtype}")
    kv_start = kv_start.to(torch.long).cpu()
    if kv_start.shape != (B,):
        raise ValueError(f"kv_start must have shape [B]=[{B}], got {tuple(kv_start.shape)}")
    if bool((kv_start < 0).any()) or bool((kv_start > q_offset + L - 1).any()):
        raise ValueError(f"kv_start {kv_start.tolist()} leaves a sequence without keys (valid range 0..{q_offset + L - 1})")
    meta = None
    if backend == "triton" and L == 1:
        meta = decode_meta(B, device=q.device, kv_start=kv_start, q_offset=q_offset, budget=budget,
                           fused=fused_step(q.device))
    return Step(kv_start=kv_start, q_offset=q_offset, meta=meta, **shape)


def _step(step, q, k, v, **given) -> Step:
    """The step an op runs with: ``step`` (checked against the tensors' shapes: no values, no synchronisation) or
    one planned from ``given`` (kv_start, q_offset, backend, budget)."""
    if step is None:
        _check_tensors(q, k, v)
        return plan_step(q, k, **{n: x for n, x in given.items() if x is not None})
    if not isinstance(step, Step):
        raise TypeError(f"step must be a kascade.ops.Step (from plan_step), got {type(step).__name__}")
    if any(x is not None for x in given.values()):
        extra = [n for n, x in given.items() if x is not None]
        raise ValueError(f"{', '.join(extra)} come from the step: do not pass them with step=")
    if q.shape != step.q_shape or k.shape != step.k_shape or (v is not None and v.shape != step.k_shape):
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match the step's shapes "
                         f"(q [{step.batch}, {step.q_heads}, {step.queries}, {step.head_dim}], "
                         f"k [{step.batch}, {step.kv_heads}, {step.keys}, {step.head_dim}])")
    dt = q.dtype
    if q.device != step.device or dt != step.dtype:
        raise ValueError(f"q is {q.dtype} on {q.device}, the step was planned for {step.dtype} on {step.device}")
    if k.dtype != dt or (v is not None and v.dtype != dt):
        check_dtypes(q, k, v)
    return step


def _scale(scale, q) -> float:
    """The softmax scale: ``D ** -0.5`` by default; a given one must be a finite real number."""
    if scale is None:
        return q.shape[-1] ** -0.5
    if type(scale) is float and math.isfinite(scale):  # what a model passes, checked without the general case
        return scale
    return check_scale(scale)


def _rank_factor(x) -> float | None:
    """A ranked selection's multiplier of each row's budget (None: a set at the budget): a positive number."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"rank_factor must be a positive number, got {x!r}")
    return float(x)


# ----------------------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------------------
def dense_attention(q, k, v, *, scale=None, kv_start=None, q_offset=None, backend=None, step: Step | None = None):
    """Exact causal GQA attention. Returns ``[B, HQ, L, D]``; queries at padding slots get zeros."""
    step = _step(step, q, k, v, kv_start=kv_start, q_offset=q_offset, backend=backend)
    scale = _scale(scale, q)
    if step.meta is not None:
        return library.call("dense_decode", q, k, v, step.meta.tensor, step.meta.n_max, scale, step.backend)
    return library.call("dense_attention", q, k, v, step.kv_start, step.q_offset, scale, step.backend)


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def select(q, k, *, budget: Budget | None = None, scale=None, kv_start=None, q_offset=None, shared: bool = False,
           backend=None, step: Step | None = None, rank_factor: float | None = None) -> Selection:
    """Anchor selection: exact post-softmax probabilities pooled per KV head (over the ``G`` heads of the group,
    and over each tile of ``budget.tile`` queries in prefill), then the top-k keys per (sequence, KV head, row)
    with the spec's budget (:class:`kascade.budget.Budget`). Prefill tiles choose among keys strictly before the
    tile; a decode query chooses among all keys. ``shared=True`` pools over all KV heads too and gives every head
    the same set (the non-head-aware baseline; not Kascade's default).

    ``rank_factor`` (a multiplier of each row's budget): a *ranked* selection for plans whose layers keep different
    numbers of keys: per row the ``at_factor(c, rank_factor, candidates)`` best keys (``c`` the row's budget) in
    descending pooled probability (ties: the earlier key first), -1 padded at the end.

    ``budget.score_dtype="fp8"``: the probabilities are those of FP8 scores (:mod:`kascade.ops.fp8`: each query and
    key vector rounded to e4m3 with a power-of-two scale); ``"int8"``: of INT8 scores (:mod:`kascade.ops.int8`: 8-bit
    integers with a scale per vector)."""
    step = _step(step, q, k, None, kv_start=kv_start, q_offset=q_offset, backend=backend, budget=budget)
    scale = _scale(scale, q)
    rank_factor = _rank_factor(rank_factor)
    if shared and step.backend == "triton":
        raise ValueError("backend='triton' has no shared-across-heads selection (a baseline): use 'reference'")
    b = step.budget
    if b.mass is not None:
        return _select_by_mass(q, k, step, scale, shared, rank_factor)
    if step.meta is not None and not shared:
        idx = library.call("select_decode", q, k, step.meta.tensor, step.meta.n_max, scale, b.ratio, b.k_min,
                           rank_factor, b.score_dtype, step.index_dtype, step.backend)
        return Selection(idx, step.zeros(), b.tile, True, rank_factor is not None)
    if step.on_device:  # the shared baseline of a step planned on the device: its geometry read back once
        step = step.on_host()
    idx, row_start = library.call("select", q, k, step.kv_start, step.q_offset, scale, b.ratio, b.k_min, b.tile,
                                  b.rolling, rank_factor, shared, b.score_dtype, step.rows,
                                  step.counts(rank_factor or 1.0)[1], step.index_dtype, step.backend)
    return Selection(idx, row_start, b.tile, step.decode, rank_factor is not None)


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def dense_select(q, k, v, *, budget: Budget | None = None, scale=None, kv_start=None, q_offset=None, backend=None,
                 step: Step | None = None, rank_factor: float | None = None) -> tuple[torch.Tensor, Selection]:
    """Layer 0: :func:`dense_attention` and :func:`select` of the same inputs, from one pass where the backend
    has one (Triton: the selection reuses the dense pass's softmax statistics). ``-> (out, Selection)``. Its scores
    are exact whatever ``budget.score_dtype`` says: FP8 / INT8 scoring is the anchors' (:func:`select`) only."""
    step = _step(step, q, k, v, kv_start=kv_start, q_offset=q_offset, backend=backend, budget=budget)
    scale = _scale(scale, q)
    rank_factor = _rank_factor(rank_factor)
    b = step.budget
    if b.mass is not None:
        exact = dataclasses.replace(b, score_dtype=None)
        return (dense_attention(q, k, v, scale=scale, step=step),
                _select_by_mass(q, k, step, scale, False, rank_factor, exact))
    if step.meta is not None:
        out, idx = library.call("dense_select_decode", q, k, v, step.meta.tensor, step.meta.n_max, scale, b.ratio,
                                b.k_min, rank_factor, step.index_dtype, step.backend)
        return out, Selection(idx, step.zeros(), b.tile, True, rank_factor is not None)
    out, idx, row_start = library.call("dense_select", q, k, v, step.kv_start, step.q_offset, scale, b.ratio,
                                       b.k_min, b.tile, b.rolling, rank_factor, step.rows,
                                       step.counts(rank_factor or 1.0)[1], step.index_dtype, step.backend)
    return out, Selection(idx, row_start, b.tile, step.decode, rank_factor is not None)


def _select_by_mass(q, k, step: Step, scale: float, shared: bool, rank_factor,
                    budget: Budget | None = None) -> Selection:
    """:func:`select` with a budget by attention mass (``budget``, default the step's): the reference's, eagerly (its
    counts depend on the scores, so its shapes do too: no compiled graph can hold it), the geometry read back to the
    host once in a step planned on the device."""
    if torch.compiler.is_compiling():
        raise RuntimeError("a budget by attention mass (budget.mass) selects eagerly: its shapes depend on the "
                           "scores; run it without torch.compile")
    step = step.on_host()
    sel = reference.select_by_mass(q, k, budget=budget or step.budget, scale=scale, kv_start=step.kv_start,
                                   q_offset=step.q_offset, shared=shared, factor=rank_factor)
    return Selection(sel.indices.to(step.index_dtype), sel.row_start, sel.tile, sel.decode, sel.ranked,
                     kept=sel.kept)


def _check_heads(heads, sel: Selection, step: Step, *, values: bool) -> None:
    """A head map fits the step (``[H]`` integers on its device) and, with ``values``, names heads of ``sel``."""
    if not isinstance(heads, torch.Tensor) or heads.dtype != torch.long or heads.shape != (step.kv_heads,):
        raise ValueError(f"heads must be an int64 tensor of shape [H]=[{step.kv_heads}], got "
                         f"{getattr(heads, 'dtype', type(heads).__name__)} {tuple(getattr(heads, 'shape', ()))}")
    if heads.device != step.device:
        raise ValueError(f"heads is on {heads.device}, the queries on {step.device}")
    if values and sel.indices.dim() == 4 and not bool(((heads >= 0) & (heads < sel.indices.shape[1])).all()):
        raise ValueError(f"heads {heads.tolist()} names a head the selection does not have (it has "
                         f"{sel.indices.shape[1]})")


def _check_selection(sel: Selection, step: Step, heads=None) -> None:
    """A selection fits the step's queries: shape, rows, and (with host geometry) which keys it may name. With a
    head map (``heads``) its head count is free: the map says which of its heads each KV head reads."""
    idx = sel.indices
    B, H = step.batch, step.kv_heads
    if idx.dim() != 4 or idx.shape[0] != B or (idx.shape[1] != H and heads is None):
        raise ValueError(f"selection indices must be [B={B}, H={H}, R, K], got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"selection indices must be int32 or int64, got {idx.dtype}")
    if idx.device != step.device:
        raise ValueError(f"selection indices are on {idx.device}, the queries on {step.device}")
    if sel.decode != step.decode:
        raise ValueError(f"a {'decode' if sel.decode else 'prefill'} selection cannot serve {step.queries} queries")
    if not sel.decode and sel.tile != step.budget.tile:
        raise ValueError(f"the selection was made with tile {sel.tile}, the step's budget has tile {step.budget.tile}")
    if sel.counts is not None:
        want = (B,) if sel.decode else (B, idx.shape[2])
        if sel.counts.dim() == 3:  # per head: a selection by attention mass
            want = (B, H, idx.shape[2])
            if step.backend == "triton":
                raise ValueError("backend='triton' reads a prefix count per row, not per head (a selection by "
                                 "attention mass): use 'reference'")
        if tuple(sel.counts.shape) != want or sel.counts.dtype != torch.int32:
            raise ValueError(f"selection counts must be int32 of shape {list(want)}, got {sel.counts.dtype} "
                             f"{tuple(sel.counts.shape)}")


def _check_selection_values(sel: Selection, step: Step) -> None:
    """What only the values can tell (not on the hot path: one read-back per call): rows are this call's tiles,
    every key is a valid key its row may see (before the tile in prefill), no key twice, -1 only at the end. The
    checks run where the indices are; only their three flags (and, for an error, its first offender) come back."""
    if step.on_device:
        step = step.on_host()
    idx = sel.as_set().indices
    dev = idx.device
    if not step.decode:
        first, count = step.tiles()
        if idx.shape[2] != int(count.max()):
            raise ValueError(f"the selection has {idx.shape[2]} rows; this call's queries span {int(count.max())} "
                             "tiles (was it made for another call?)")
        if not torch.equal(sel.row_start.long().cpu(), first):
            raise ValueError(f"the selection's rows start at tiles {sel.row_start.tolist()}, this call's queries at "
                             f"{first.tolist()} (was it made for another chunk?)")
    pad = idx < 0
    start = step.kv_start.to(dev)[:, None, None, None]
    if step.decode:
        end = (step.q_offset + 1) * torch.ones_like(start)
    else:
        rows = first.to(dev)[:, None, None, None] + torch.arange(idx.shape[2], device=dev)[None, None, :, None]
        end = start + rows * step.budget.tile
    bad = ~pad & ((idx < start) | (idx >= end))
    misplaced, repeated, outside = torch.stack([
        (pad[..., :-1] & ~pad[..., 1:]).any(), ((idx[..., 1:] == idx[..., :-1]) & ~pad[..., 1:]).any(),
        bad.any()]).tolist()
    if misplaced:
        raise ValueError("selection rows must hold their keys first and -1 padding only at the end")
    if repeated:
        raise ValueError("a selection row names the same key twice")
    if outside:
        b, h, r, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"selection key slot {int(idx[b, h, r, j])} (sequence {b}, head {h}, row {r}) is not a key "
                         f"that row may attend (valid: [{int(start[b, 0, 0, 0])}, {int(end[b, 0, r if not step.decode else 0, 0])}))")


def sparse_attention(q, k, v, selection: Selection, *, scale=None, kv_start=None, q_offset=None, backend=None,
                     step: Step | None = None, heads=None):
    """Attention of each query over its row's selected keys (softmax renormalised over them), plus, in prefill,
    causal attention within its own tile. Returns ``[B, HQ, L, D]``.

    ``heads``: ``[H]`` int64 on the device (a reuse layer's head map, :func:`kascade.reuse.layer_keys`): KV head
    ``h`` attends the keys of the selection's head ``heads[h]`` (the selection may have any number of heads), as
    with ``selection.take_heads(heads)``; the Triton kernels read the map in place.

    Without ``step`` the selection is checked against the call in full (rows, key ranges, repeats, the head map's
    values); with ``step`` only its shape is (the runtime's hot path: selections made by this step's ops)."""
    checked = step is not None
    own_tile = None if checked or not isinstance(selection, Selection) else Budget(tile=selection.tile)
    step = _step(step, q, k, v, kv_start=kv_start, q_offset=q_offset, backend=backend, budget=own_tile)
    if not isinstance(selection, Selection):
        raise TypeError(f"selection must be a kascade.ops.Selection, got {type(selection).__name__}")
    if heads is not None:
        _check_heads(heads, selection, step, values=not checked)
        if step.backend != "triton":
            selection, heads = selection.take_heads(heads), None  # no kernel reads it: a copy through the map
    _check_selection(selection, step, heads)
    if not checked:
        _check_selection_values(selection if heads is None else selection.take_heads(heads), step)
    scale = _scale(scale, q)
    if step.meta is not None:
        return library.call("sparse_decode", q, k, v, selection.indices, selection.counts, heads, scale,
                            step.backend)
    return library.call("sparse_attention", q, k, v, selection.indices, selection.row_start, selection.counts,
                        heads, selection.ranked, selection.tile, step.kv_start, step.q_offset, scale, step.backend)


def attended_keys(selection: Selection | None, *, kv_start, q_offset: int, L: int, num_kv_heads: int) -> tuple[int, int]:
    """``(attended, dense)``: keys attended by all (sequence, KV head, real query) triples under ``selection``
    (selected keys plus, in prefill, the causal part of the own tile), and what dense attention would attend.
    ``selection=None`` means dense. Counts are per KV head: the G query heads of a group share a set."""
    kv_start = torch.as_tensor(kv_start, dtype=torch.long).cpu()
    att = dense = 0
    cnt_all = None if selection is None else selection.attended_counts().cpu()  # [B, H, R]
    for b in range(kv_start.shape[0]):
        n = q_offset + L - int(kv_start[b])
        pos = torch.arange(max(0, n - L), n)  # positions of this sequence's real queries
        d = int((pos + 1).sum()) * num_kv_heads
        dense += d
        if selection is None:
            att += d
            continue
        cnt = cnt_all[b]  # [H, R]
        if selection.decode:
            att += int(cnt[:, 0].sum())
            continue
        T = selection.tile
        rows = pos // T - int(selection.row_start[b])
        own = pos - (pos // T) * T + 1
        att += int(cnt[:, rows].sum()) + int(own.sum()) * cnt.shape[0]
    return att, dense
