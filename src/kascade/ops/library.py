"""Kascade's ops registered as torch custom ops (``torch.library``, namespace ``kascade``), so that
``torch.compile(..., fullgraph=True)`` traces a forward step through them: each op is one node of the graph, which
the compiler describes by the op's fake implementation (output shapes, strides and dtypes from the arguments
alone: no data, no host synchronisation) and runs by its real one (also inside a CUDA graph: ``mode=
"reduce-overhead"``). Tested with ``torch.library.opcheck`` (tests/ops/test_library.py).

Two families, by where the key geometry lives:

- ``*_decode``: one query per sequence, the geometry on the device: ``meta [B, 4]`` int32
  (:attr:`kascade.ops.step.DecodeMeta.tensor`: first valid slot, valid keys ``n_b``, budget ``k_b``, 0) and
  ``keys``, a host bound of every ``n_b`` (the static cache's capacity: grid sizes, index widths). The Triton decode
  steps and every static-cache decode step (the reference's too) run these.
- ``dense_attention``, ``select``, ``dense_select``, ``sparse_attention``: the geometry on the host, ``kv_start [B]``
  int64 (a CPU tensor) and ``q_offset``: prefill, and the reference's decode steps over a dynamic cache.

Every op takes ``backend``: ``"reference"`` (:mod:`kascade.ops.reference`, the specification) or ``"triton"`` (the
launchers of :mod:`kascade.ops.triton`, looked up at call time). The backend is an argument rather than the device
key because the choice is the user's: the reference also runs on CUDA tensors, and the Triton interpreter runs the
kernels on CPU tensors. Ops take tensors and plain numbers only: a :class:`~kascade.ops.Selection` crosses the
boundary as ``indices``, ``row_start``, ``counts`` and ``ranked``, a :class:`~kascade.budget.Budget` as ``ratio``,
``k_min``, ``tile``, ``rolling`` and, for the anchors' selection ops (``select``, ``select_decode``), ``score_dtype``
(layer 0's ``dense_select`` ops score exactly and do not take it). Outputs never alias inputs; they are
inference-only (no autograd formula: the transformers integration refuses gradients before any op runs).

The public ops (:mod:`kascade.ops`) build these arguments from a :class:`~kascade.ops.Step`. In eager mode they
call an op's implementation directly: a call through the dispatcher costs 10-20 us of host time, the whole budget
of a reuse layer (benchmarks/host_overhead.py); while ``torch.compile`` traces, they call the registered op
(:func:`call`).
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from ..budget import Budget
from . import reference
from .selection import Selection
from .step import DecodeMeta, fused_step

NAMESPACE = "kascade"


def _budget(ratio: float, k_min: int, tile: int = 32, rolling: bool = True,
            score_dtype: Optional[str] = None) -> Budget:
    """The one :class:`Budget` of these arguments (made once: the ops of a step then share it, and the metadata that
    :func:`_meta` keeps for it)."""
    return _budget_of(ratio, k_min, tile, rolling, score_dtype)


@functools.lru_cache(maxsize=256)
def _budget_of(ratio, k_min, tile, rolling, score_dtype) -> Budget:  # positional: one cache entry per budget
    return Budget(ratio=ratio, k_min=k_min, tile=tile, rolling=rolling, score_dtype=score_dtype)


_KERNELS: list = []


def _triton(decode: bool):
    """The launcher module (imported on first use: Triton is optional; looked up per call, so that a test's spy on a
    launcher sees the call)."""
    if not _KERNELS:
        from .triton import decode as d, prefill as p

        _KERNELS[:] = [p, d]
    return _KERNELS[decode]


_LAST_META: list = [None]
_direct = threading.local()  # .on: an eager call of an implementation (call()), not the registered op's


def _meta(meta: torch.Tensor, keys: int, budget: Budget | None):
    """The launchers' :class:`~kascade.ops.step.DecodeMeta` of a device ``meta``: every sequence bounded by ``keys``.
    In an eager step the last one made is kept: every anchor of the step passes the same tensor (and its memo of
    ranked counts then serves them all). Never for the registered op, which compiled code runs: a tensor it kept
    would outlive its graph's step (torch.compile's CUDA graphs refuse memory of theirs that no output holds)."""
    cache = getattr(_direct, "on", False)
    last = _LAST_META[0]
    if cache and last is not None and last[0] is meta and last[1] == keys and last[2] is budget:
        return last[3]
    B = meta.shape[0]
    dm = DecodeMeta(tensor=meta, n=(keys,) * B, k=None if budget is None else (budget.decode(keys),) * B, paged=False,
                    fused=fused_step(meta.device))
    _LAST_META[0] = (meta, keys, budget, dm) if cache else None
    return dm


def decode_width(keys: int, ratio: float, k_min: int, rank_factor: Optional[float]) -> int:
    """Entries per row of a decode selection over at most ``keys`` keys: the budget at ``keys`` (at ``rank_factor``)."""
    b = _budget(ratio, k_min)
    return b.decode(keys) if rank_factor is None else b.decode_counts(keys, rank_factor)


def _out_like(q: torch.Tensor, backend: str) -> torch.Tensor:
    """An output's layout: the Triton launchers allocate like ``q`` (``empty_like``), the reference contiguously."""
    return torch.empty_like(q) if backend == "triton" else q.new_empty(q.shape)


# ----------------------------------------------------------------------------------------------------------------
# Decode, geometry on the device
# ----------------------------------------------------------------------------------------------------------------
def _dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, keys: int, scale: float,
                  backend: str) -> torch.Tensor:
    if backend == "triton":
        return _triton(True).dense_decode(q, k, v, scale=scale, meta=_meta(meta, keys, None))
    return reference.dense_decode(q, k, v, scale=scale, meta=meta)


def _select_decode(q: torch.Tensor, k: torch.Tensor, meta: torch.Tensor, keys: int, scale: float, ratio: float,
                   k_min: int, rank_factor: Optional[float], score_dtype: Optional[str], index_dtype: torch.dtype,
                   backend: str) -> torch.Tensor:
    b = _budget(ratio, k_min, score_dtype=score_dtype)
    if backend == "triton":
        return _triton(True).select_decode_indices(q, k, budget=b, scale=scale, meta=_meta(meta, keys, b),
                                                   rank_factor=rank_factor, index_dtype=index_dtype)
    return reference.select_decode(q, k, scale=scale, meta=meta, budget=b, width=decode_width(keys, ratio, k_min,
                                   rank_factor), rank_factor=rank_factor).to(index_dtype)


def _dense_select_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, keys: int,
                         scale: float, ratio: float, k_min: int, rank_factor: Optional[float], index_dtype: torch.dtype,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    b = _budget(ratio, k_min)
    if backend == "triton":
        return _triton(True).dense_select_decode_indices(q, k, v, budget=b, scale=scale, meta=_meta(meta, keys, b),
                                                         rank_factor=rank_factor, index_dtype=index_dtype)
    out, idx = reference.dense_select_decode(q, k, v, scale=scale, meta=meta, budget=b, rank_factor=rank_factor,
                                             width=decode_width(keys, ratio, k_min, rank_factor))
    return out, idx.to(index_dtype)


def _sparse_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                   counts: Optional[torch.Tensor], heads: Optional[torch.Tensor], scale: float,
                   backend: str) -> torch.Tensor:
    if backend == "triton":
        return _triton(True).sparse_decode(q, k, v, indices, scale=scale, counts=counts, heads=heads)
    if heads is not None:  # the reference reads a head map by a copy through it
        sel = Selection(indices, indices.new_zeros(indices.shape[0]), 1, True, counts=counts).take_heads(heads)
        indices, counts = sel.indices, sel.counts
    return reference.sparse_decode(q, k, v, indices, scale=scale, counts=counts)


def _fake_select_decode(q, k, meta, keys, scale, ratio, k_min, rank_factor, index_dtype, backend):
    return q.new_empty((q.shape[0], k.shape[1], 1, decode_width(keys, ratio, k_min, rank_factor)), dtype=index_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Geometry on the host
# ----------------------------------------------------------------------------------------------------------------
def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_start: torch.Tensor, q_offset: int,
                     scale: float, backend: str) -> torch.Tensor:
    if backend == "triton":
        return _triton(False).dense_prefill(q, k, v, scale=scale, kv_start=kv_start, q_offset=q_offset)
    return reference.dense_attention(q, k, v, scale=scale, kv_start=kv_start, q_offset=q_offset)


def _select(q: torch.Tensor, k: torch.Tensor, kv_start: torch.Tensor, q_offset: int, scale: float, ratio: float,
            k_min: int, tile: int, rolling: bool, rank_factor: Optional[float], shared: bool,
            score_dtype: Optional[str], rows: int, width: int, index_dtype: torch.dtype,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    b = _budget(ratio, k_min, tile, rolling, score_dtype)
    if backend == "triton":
        sel = _triton(False).select_prefill(q, k, scale=scale, budget=b, kv_start=kv_start, q_offset=q_offset,
                                            index_dtype=index_dtype, rank_factor=rank_factor)
    else:
        sel = reference.select(q, k, budget=b, scale=scale, kv_start=kv_start, q_offset=q_offset, shared=shared,
                               rank_factor=rank_factor)
    return _fit(sel.indices, rows, width).to(index_dtype), sel.row_start


def _dense_select(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_start: torch.Tensor, q_offset: int,
                  scale: float, ratio: float, k_min: int, tile: int, rolling: bool, rank_factor: Optional[float],
                  rows: int, width: int, index_dtype: torch.dtype,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        out, sel = _triton(False).dense_select_prefill(q, k, v, scale=scale, budget=_budget(ratio, k_min, tile, rolling),
                                                       kv_start=kv_start, q_offset=q_offset, index_dtype=index_dtype,
                                                       rank_factor=rank_factor)
        return out, _fit(sel.indices, rows, width), sel.row_start
    out = _dense_attention(q, k, v, kv_start, q_offset, scale, backend)
    return (out, *_select(q, k, kv_start, q_offset, scale, ratio, k_min, tile, rolling, rank_factor, False, None,
                          rows, width, index_dtype, backend))


def _fit(indices: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The selection as wide as the caller's step said (a host bound): the backends size it by the same rule
    (:meth:`kascade.ops.Step.counts`); an assertion, not a copy."""
    assert indices.shape[2:] == (rows, width), (tuple(indices.shape), rows, width)
    return indices


def _sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                      row_start: torch.Tensor, counts: Optional[torch.Tensor], heads: Optional[torch.Tensor],
                      ranked: bool, tile: int, kv_start: torch.Tensor, q_offset: int, scale: float,
                      backend: str) -> torch.Tensor:
    sel = Selection(indices, row_start, tile, q.shape[2] == 1, ranked, counts)
    if backend == "triton":
        return _triton(False).sparse_prefill(q, k, v, sel, scale=scale, kv_start=kv_start, q_offset=q_offset,
                                             counts=counts, heads=heads)
    sel = sel if heads is None else sel.take_heads(heads)
    return reference.sparse_attention(q, k, v, sel, scale=scale, kv_start=kv_start, q_offset=q_offset)


def _fake_select(q, k, kv_start, q_offset, scale, ratio, k_min, tile, rolling, rank_factor, shared, score_dtype, rows,
                 width, index_dtype, backend):
    return (q.new_empty((q.shape[0], k.shape[1], rows, width), dtype=index_dtype),
            q.new_empty((q.shape[0],), dtype=torch.long))


# ----------------------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------------------
def _register(name, impl, fake):
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


OPS = {
    "dense_decode": _register("dense_decode", _dense_decode,
                              lambda q, k, v, meta, keys, scale, backend: _out_like(q, backend)),
    "select_decode": _register(
        "select_decode", _select_decode,
        lambda q, k, meta, keys, scale, ratio, k_min, rank_factor, score_dtype, index_dtype, backend:
        _fake_select_decode(q, k, meta, keys, scale, ratio, k_min, rank_factor, index_dtype, backend)),
    "dense_select_decode": _register(
        "dense_select_decode", _dense_select_decode,
        lambda q, k, v, meta, keys, scale, ratio, k_min, rank_factor, index_dtype, backend: (
            _out_like(q, backend), _fake_select_decode(q, k, meta, keys, scale, ratio, k_min, rank_factor, index_dtype,
                                                       backend))),
    "sparse_decode": _register("sparse_decode", _sparse_decode,
                               lambda q, k, v, indices, counts, heads, scale, backend: _out_like(q, backend)),
    "dense_attention": _register("dense_attention", _dense_attention,
                                 lambda q, k, v, kv_start, q_offset, scale, backend: _out_like(q, backend)),
    "select": _register("select", _select, _fake_select),
    "dense_select": _register(
        "dense_select", _dense_select,
        lambda q, k, v, kv_start, q_offset, scale, ratio, k_min, tile, rolling, rank_factor, rows, width, index_dtype,
        backend: (_out_like(q, backend), *_fake_select(q, k, kv_start, q_offset, scale, ratio, k_min, tile, rolling,
                                                       rank_factor, False, None, rows, width, index_dtype, backend))),
    "sparse_attention": _register(
        "sparse_attention", _sparse_attention,
        lambda q, k, v, indices, row_start, counts, heads, ranked, tile, kv_start, q_offset, scale, backend:
        _out_like(q, backend)),
}
_IMPL = {"dense_decode": _dense_decode, "select_decode": _select_decode, "dense_select_decode": _dense_select_decode,
         "sparse_decode": _sparse_decode, "dense_attention": _dense_attention, "select": _select,
         "dense_select": _dense_select, "sparse_attention": _sparse_attention}


def call(name: str, *args):
    """Op ``name`` on ``args``: through the registered op while ``torch.compile`` traces (a node of the graph),
    else its implementation directly (the same computation, without the dispatcher's host time)."""
    if torch.compiler.is_compiling():
        return OPS[name](*args)
    _direct.on = True
    try:
        return _IMPL[name](*args)
    finally:
        _direct.on = False


__all__ = ["NAMESPACE", "OPS", "call", "decode_width"]
