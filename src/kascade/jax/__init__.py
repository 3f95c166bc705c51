"""Kascade attention ops for JAX: the public ops of :mod:`kascade.ops` on JAX arrays (argument checks, defaults and
backend dispatch here; the math in :mod:`kascade.jax.reference`).

Tensor layout: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]``, outputs ``[B, HQ, L, D]`` in the input dtype; ``HQ`` a
multiple of ``H`` (``G = HQ / H``); query head ``hq`` reads KV head ``hq // G``. Key slots ``[kv_start[b], q_offset
+ L)`` are valid for sequence ``b`` (left padding before, unused cache space after) and query ``i`` sits at slot
``q_offset + i``. Defaults: ``kv_start`` zeros, ``q_offset = N - L``. ``L == 1`` is a decode step, ``L > 1``
(chunked) prefill in tiles of ``budget.tile`` queries. Selections are :class:`Selection` pytrees (``indices
[B, H, R, K]`` int32 key slots, ascending, -1 padded; ``row_start [B]``; static ``tile`` and ``decode``).

Under ``jax.jit``: ``budget``, ``q_offset`` and ``backend`` are static (Python values: pass them in
``static_argnames`` or close over them), shapes are static as always; ``scale`` and ``kv_start`` may be traced (a
traced ``kv_start`` is not range-checked: keep it in ``0 .. q_offset + L - 1``)::

    select = jax.jit(kascade.jax.select, static_argnames=("budget", "q_offset", "backend"))
    sel = select(q, k, budget=Budget(ratio=0.1), kv_start=starts)

An eager call runs each op as one compiled program per shape and budget (``q_offset`` and ``kv_start`` enter it as
values), so a decode loop does not recompile at every step.

A selection's shape depends only on static values (:func:`selection_shape`), never on ``kv_start``; it may have
more rows and columns than the torch op's (all -1), and its keys are the same sets. Ties in the top-k may break
differently from ``torch.topk``.

For a whole model, :class:`Attention` (``attn(layer, q, k, v, fwd)`` with one :class:`Forward` per pass, like
:class:`kascade.Attention`) runs the plan's layer kinds and keeps the anchors' selections between layers; it checks
the arrays once per pass, at layer 0 (:mod:`kascade.jax.attention`).

Backends: ``"reference"`` (``jax.numpy``, any device, any transformation) and ``"triton"``: JAX arrays on a CUDA
device go to the project's Triton kernels (:mod:`kascade.ops`, backend ``"triton"``) through DLPack, zero-copy,
eagerly; it refuses traced calls (use the reference inside jit) and arrays on other devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..budget import Budget
from ..ops.geometry import check_scale, check_shapes
from . import reference
from .reference import Selection, selection_shape

__all__ = ["Attention", "Budget", "Forward", "Selection", "dense_attention", "select", "selection_shape",
           "sparse_attention"]

BACKENDS = ("reference", "triton")


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _geometry(q, k, v, kv_start, q_offset, backend):
    """Check the arrays and the geometry; -> ``(kv_start, q_offset)`` (``kv_start`` an int32 array -- NumPy for the
    Triton backend --, a concrete one range-checked, or the traced one as given)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None and name == "v":
            continue  # selection needs no values
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
    check_shapes(q, k, v)
    B, _, L, _ = q.shape
    N = k.shape[2]
    if backend == "triton":
        from . import bridge

        why = bridge.unavailable_reason(q, k, v, kv_start)
        if why:
            raise ValueError(why)
    if q_offset is None:
        q_offset = N - L
    if _traced(q_offset):
        raise TypeError("q_offset must be a Python int (static under jit: pass it in static_argnames)")
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)):
        raise TypeError(f"q_offset must be an integer, got {q_offset!r}")
    q_offset = int(q_offset)
    if not 0 <= q_offset <= N - L:
        raise ValueError(f"q_offset={q_offset} puts the {L} queries outside the {N} key slots")
    # The Triton backend reads kv_start on the host (the torch op plans there): keep it a NumPy array, which costs
    # no JAX dispatch and no read-back; the reference keeps a JAX array.
    host = backend == "triton"
    if kv_start is None:
        return (np.zeros(B, np.int32) if host else jnp.zeros(B, jnp.int32)), q_offset
    starts = kv_start if _traced(kv_start) else np.asarray(kv_start)
    if tuple(starts.shape) != (B,):
        raise ValueError(f"kv_start must have shape [B]=[{B}], got {tuple(starts.shape)}")
    if not jnp.issubdtype(starts.dtype, jnp.integer):
        raise TypeError(f"kv_start must hold integers, got {starts.dtype}")
    if _traced(starts):
        return starts.astype(jnp.int32), q_offset
    if (starts < 0).any() or (starts > q_offset + L - 1).any():
        raise ValueError(f"kv_start {starts.tolist()} leaves a sequence without keys (valid range "
                         f"0..{q_offset + L - 1})")
    return (starts.astype(np.int32) if host else jnp.asarray(starts, jnp.int32)), q_offset


def _scale(scale, q):
    """The softmax scale: ``D ** -0.5`` by default; a given concrete one must be a finite real number (a traced one
    is taken as it is)."""
    if scale is None:
        return q.shape[-1] ** -0.5
    return scale if _traced(scale) else check_scale(scale)


def _check_selection(sel, q, k, kv_start, q_offset) -> None:
    """A selection fits the call: shape and kind always; with concrete values, its rows are this call's tiles."""
    if not isinstance(sel, Selection):
        raise TypeError(f"selection must be a kascade.jax.Selection, got {type(sel).__name__}")
    B, _, L, _ = q.shape
    H = k.shape[1]
    idx = sel.indices
    if idx.ndim != 4 or tuple(idx.shape[:2]) != (B, H):
        raise ValueError(f"selection indices must be [B={B}, H={H}, R, K], got {tuple(idx.shape)}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"selection indices must be integers, got {idx.dtype}")
    if sel.decode != (L == 1):
        raise ValueError(f"a {'decode' if sel.decode else 'prefill'} selection cannot serve {L} queries")
    if sel.decode and idx.shape[2] != 1:
        raise ValueError(f"a decode selection has one row, got {idx.shape[2]}")
    budget = Budget(tile=sel.tile)
    most = selection_shape(budget, L, q_offset)[0]
    if idx.shape[2] > most:
        raise ValueError(f"the selection has {idx.shape[2]} rows; {L} queries at slot {q_offset} span at most {most}")
    if _traced(kv_start) or _traced(sel.row_start) or _traced(idx):
        return
    start = np.asarray(kv_start).reshape(B, 1, 1, 1)
    if sel.decode:
        end = np.full_like(start, q_offset + 1)
    else:
        first, tiles = budget.tiles(q_offset + L - torch.tensor(np.asarray(kv_start), dtype=torch.long), L)
        if not np.array_equal(np.asarray(sel.row_start), first.numpy()):
            raise ValueError(f"the selection's rows start at tiles {np.asarray(sel.row_start).tolist()}, this call's "
                             f"queries at {first.tolist()} (was it made for another chunk?)")
        if idx.shape[2] < tiles.max():
            raise ValueError(f"the selection has {idx.shape[2]} rows; this call's queries span {int(tiles.max())} "
                             "tiles")
        rows = first.numpy().reshape(B, 1, 1, 1) + np.arange(idx.shape[2]).reshape(1, 1, -1, 1)
        end = start + rows * sel.tile
    _check_keys(np.asarray(idx), start, end)


def _check_keys(idx: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
    """As the torch ops check a selection's values: every key one its row may see (``[start, end)``: from the
    sequence's first valid key to the row's tile in prefill, to the query itself in decode), none twice, -1 padding
    only at the end. ``idx`` in rank order (a ranked selection) is read as a set."""
    pad = idx < 0
    if (pad[..., :-1] & ~pad[..., 1:]).any():
        raise ValueError("selection rows must hold their keys first and -1 padding only at the end")
    srt = np.sort(np.where(pad, np.iinfo(idx.dtype).max, idx), axis=-1)
    if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] != np.iinfo(idx.dtype).max)).any():
        raise ValueError("a selection row names the same key twice")
    bad = ~pad & ((idx < start) | (idx >= end))
    if bad.any():
        b, h, r, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"selection key slot {int(idx[b, h, r, j])} (sequence {b}, head {h}, row {r}) is not a key "
                         f"that row may attend (valid: [{int(start[b, 0, 0, 0])}, {int(end[b, 0, min(r, end.shape[2] - 1), 0])}))")


# ----------------------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------------------
def dense_attention(q, k, v, *, scale=None, kv_start=None, q_offset=None, backend: str = "reference"):
    """Exact causal GQA attention. Returns ``[B, HQ, L, D]``; queries at padding slots get zeros."""
    kv_start, q_offset = _geometry(q, k, v, kv_start, q_offset, backend)
    impl = _backend(backend)
    return impl.dense_attention(q, k, v, scale=_scale(scale, q), kv_start=kv_start, q_offset=q_offset)


def select(q, k, *, budget: Budget | None = None, scale=None, kv_start=None, q_offset=None,
           backend: str = "reference") -> Selection:
    """Anchor selection: exact post-softmax probabilities pooled per KV head (over the ``G`` heads of the group, and
    over each tile of ``budget.tile`` queries in prefill), then the top-k keys per (sequence, KV head, row) with the
    spec's budget (:class:`kascade.budget.Budget`). Prefill tiles choose among keys strictly before the tile; a
    decode query chooses among all keys. Returns a :class:`Selection`."""
    budget = Budget() if budget is None else budget
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a kascade.Budget, got {type(budget).__name__}")
    if budget.score_dtype is not None:
        raise ValueError(f"the JAX ops score exactly: {budget.score_dtype.upper()} scoring (budget.score_dtype="
                         f"{budget.score_dtype!r}) runs on "
                         "the torch ops (kascade.ops, backend='reference')")
    if budget.mass is not None:
        raise ValueError(f"the JAX ops select by count: a budget by attention mass (budget.mass={budget.mass!r}) runs "
                         "on the torch ops (kascade.ops, backend='reference')")
    kv_start, q_offset = _geometry(q, k, None, kv_start, q_offset, backend)
    impl = _backend(backend)
    return impl.select(q, k, budget=budget, scale=_scale(scale, q), kv_start=kv_start, q_offset=q_offset)


def sparse_attention(q, k, v, selection: Selection, *, scale=None, kv_start=None, q_offset=None,
                     backend: str = "reference"):
    """Attention of each query over its row's selected keys (softmax renormalised over them), plus, in prefill,
    causal attention within its own tile. Returns ``[B, HQ, L, D]``; queries at padding slots get zeros."""
    kv_start, q_offset = _geometry(q, k, v, kv_start, q_offset, backend)
    _check_selection(selection, q, k, kv_start, q_offset)
    impl = _backend(backend)
    return impl.sparse_attention(q, k, v, selection, scale=_scale(scale, q), kv_start=kv_start, q_offset=q_offset)


def _backend(name: str):
    if name == "triton":
        from . import bridge

        return bridge
    return reference


from .attention import Attention, Forward  # noqa: E402  (the layer-by-layer API; it uses the helpers above)
