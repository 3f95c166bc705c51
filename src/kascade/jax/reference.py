"""Kascade attention in ``jax.numpy``: :mod:`kascade.ops.reference` (the specification) for JAX, usable under jit.

Layout and geometry are those of :mod:`kascade.ops`: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]``, outputs
``[B, HQ, L, D]`` in the input dtype; query head ``hq`` reads KV head ``hq // G``. Key slots
``[kv_start[b], q_offset + L)`` are valid for sequence ``b`` and query ``i`` sits at slot ``q_offset + i``;
positions, tiles and budgets count from a sequence's first valid key; queries at padding slots get zeros.
``L == 1`` is a decode step, ``L > 1`` (chunked) prefill in tiles of ``budget.tile`` queries.

Static and traced: shapes, ``q_offset``, ``budget`` and the tile are Python values (static under jit); ``kv_start``
and ``scale`` may be traced. The torch reference cuts each sequence out at its own length; here every sequence is
computed over all ``N`` slots with masks, and a selection's shape is a static bound (:func:`selection_shape`) that
does not depend on ``kv_start``: rows and columns a sequence does not use are -1.

Budgets come from :class:`kascade.budget.Budget` itself (one rule, one place): on the host with Python ints and
host tensors when ``kv_start`` is concrete, and through ``jax.pure_callback`` (the same host function) when it is
traced: a ``[B]`` host round trip per selection, the price of keeping the float64 budget arithmetic exact.

Math is done in fp32 (fp64 for fp64 inputs, which need ``jax_enable_x64``) at full matmul precision (no TF32).
Unlike the torch reference this builds the whole ``[B, HQ, L, N]`` probability tensor: it is a specification, for
moderate sizes. Ties in the top-k may break differently from ``torch.topk`` (``lax.top_k`` prefers the lower
slot); with continuous inputs ties have probability zero, everything else matches the torch reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..budget import Budget

INDEX_DTYPE = jnp.int32
_HIGHEST = jax.lax.Precision.HIGHEST
_BIG = np.iinfo(np.int32).max


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Selection:
    """Top-k key slots chosen by an anchor layer: the JAX twin of :class:`kascade.ops.Selection` (a pytree: the
    arrays are its leaves, ``tile`` and ``decode`` static).

    indices:   ``[B, H, R, K]`` int32 key slots (into the ``N`` axis), ascending, -1 padded at the end of each row.
               In prefill row ``r`` of sequence ``b`` is tile ``row_start[b] + r`` (counted from the sequence's first
               valid key); in decode there is one row, for the single new query.
    row_start: ``[B]`` int32, the tile of row 0 (zeros in decode).
    tile:      the tile size ``T`` the rows were made with.
    decode:    whether this is a decode step (one query per sequence, no own tile).
    """

    indices: jax.Array
    row_start: jax.Array
    tile: int
    decode: bool

    def tree_flatten(self):
        return (self.indices, self.row_start), (self.tile, self.decode)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, *aux)

    def take_heads(self, head_map) -> "Selection":
        """The selection as seen by a reuse layer whose KV head ``h`` takes this selection's head ``head_map[h]``."""
        return Selection(jnp.take(self.indices, jnp.asarray(head_map), axis=1), self.row_start, self.tile,
                         self.decode)

    def attended_counts(self) -> jax.Array:
        """Number of selected keys per (sequence, head, row): ``[B, H, R]``."""
        return (self.indices >= 0).sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# Budgets: kascade.budget on the host, static bounds for the shapes
# ----------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def selection_shape(budget: Budget, L: int, q_offset: int) -> tuple[int, int]:
    """``(R, K)`` of every selection of a call with ``L`` queries at slot ``q_offset``, whatever ``kv_start``: ``R``
    the most tiles the call's queries span in any sequence, ``K`` the widest row budget (an unpadded sequence's
    last row: the budget rules never decrease with the prefix or the context length)."""
    n_max = q_offset + L
    if L == 1:
        return 1, int(budget.decode(n_max))
    R = int(budget.tiles(torch.arange(1, n_max + 1), L)[1].max())  # any valid kv_start leaves 1..n_max keys
    n = torch.tensor([n_max])
    K = int(budget.row_counts(n, budget.tiles(n, L)[0], R).max())
    return R, K


def _host_counts(budget: Budget, L: int, q_offset: int, R: int, K: int, kv_start) -> tuple[np.ndarray, np.ndarray]:
    """``(first tile [B], keys per row [B, R])`` int32 of each sequence (decode: zeros and ``[B, 1]``)."""
    n = q_offset + L - torch.tensor(np.asarray(kv_start), dtype=torch.long)
    if L == 1:
        first, counts = torch.zeros_like(n), budget.decode(n)[:, None]
    else:
        first = budget.tiles(n, L)[0]
        counts = budget.row_counts(n, first, R)
    assert int(counts.max()) <= K, "a row keeps more keys than the selection's static width"
    return first.numpy().astype(np.int32), counts.numpy().astype(np.int32)


def _counts(budget: Budget, kv_start, L: int, q_offset: int, R: int, K: int):
    host = functools.partial(_host_counts, budget, L, q_offset, R, K)
    if isinstance(kv_start, jax.core.Tracer):
        B = kv_start.shape[0]
        shapes = (jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, R), jnp.int32))
        return jax.pure_callback(host, shapes, kv_start)
    first, counts = host(kv_start)
    return jnp.asarray(first), jnp.asarray(counts)


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------------
def _math_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _positions(kv_start, q_offset: int, L: int, N: int):
    """Positions counted from each sequence's first valid key: queries ``[B, L]``, keys ``[B, N]`` (< 0: padding)."""
    start = jnp.asarray(kv_start).astype(jnp.int32)[:, None]
    return (q_offset + jnp.arange(L, dtype=jnp.int32)[None] - start,
            jnp.arange(N, dtype=jnp.int32)[None] - start)


def _causal(qpos, kpos):
    """``[B, L, N]``: the valid keys each query sees."""
    return (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None])


def _probabilities(q, k, scale, mask):
    """``softmax(q k^T * scale)`` over the keys ``mask [B, 1 | H, 1, L, N]`` allows: ``[B, H, G, L, N]`` in the math
    dtype (a row with no key is NaN, as in torch)."""
    B, HQ, L, D = q.shape
    H = k.shape[1]
    md = _math_dtype(q.dtype)
    qg = q.astype(md).reshape(B, H, HQ // H, L, D)
    s = jnp.einsum("bhgld,bhnd->bhgln", qg, k.astype(md), precision=_HIGHEST) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    return e / e.sum(-1, keepdims=True)


def _attend(p, v, qpos, dtype):
    """``p [B, H, G, L, N]`` applied to ``v [B, H, N, D]`` -> ``[B, HQ, L, D]``, zeros at padding queries."""
    B, H, G, L, _ = p.shape
    out = jnp.einsum("bhgln,bhnd->bhgld", p, v.astype(p.dtype), precision=_HIGHEST).reshape(B, H * G, L, -1)
    return jnp.where((qpos >= 0)[:, None, :, None], out, 0).astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# The ops: static bounds and budgets here, the math in one jitted program per op (an eager call compiles once per
# shape and budget, not once per query slot: ``q_offset`` enters it as a value)
# ----------------------------------------------------------------------------------------------------------------
def dense_attention(q, k, v, *, scale, kv_start, q_offset: int):
    """Causal GQA attention over all valid keys. Arguments as in :func:`kascade.jax.dense_attention`."""
    return _dense(q, k, v, scale, kv_start, q_offset)


def select(q, k, *, budget: Budget, scale, kv_start, q_offset: int) -> Selection:
    """Anchor selection. Arguments as in :func:`kascade.jax.select`."""
    R, K = selection_shape(budget, q.shape[2], q_offset)
    first, counts = _counts(budget, kv_start, q.shape[2], q_offset, R, K)  # [B], [B, R]
    return Selection(_select(q, k, scale, kv_start, q_offset, first, counts, K=K, T=budget.tile), first,
                     budget.tile, q.shape[2] == 1)


def sparse_attention(q, k, v, selection: Selection, *, scale, kv_start, q_offset: int):
    """Attention over each row's selected keys (plus, in prefill, the causal part of the own tile). Arguments as in
    :func:`kascade.jax.sparse_attention`."""
    return _sparse(q, k, v, selection.indices, selection.row_start, scale, kv_start, q_offset, T=selection.tile,
                   decode=selection.decode)


@jax.jit
def _dense(q, k, v, scale, kv_start, q_offset):
    L, N = q.shape[2], k.shape[2]
    qpos, kpos = _positions(kv_start, q_offset, L, N)
    p = _probabilities(q, k, scale, _causal(qpos, kpos)[:, None, None])
    return _attend(p, v, qpos, q.dtype)


@functools.partial(jax.jit, static_argnames=("K", "T"))
def _select(q, k, scale, kv_start, q_offset, first, counts, *, K: int, T: int):
    """``indices [B, H, R, K]``: each row's ``counts[b, r]`` best candidates, ascending, -1 padded."""
    L, N = q.shape[2], k.shape[2]
    R = counts.shape[1]
    qpos, kpos = _positions(kv_start, q_offset, L, N)
    causal = _causal(qpos, kpos)  # [B, L, N]
    p = _probabilities(q, k, scale, causal[:, None, None])
    p = jnp.where((qpos >= 0)[:, None, None, :, None], p, 0).sum(2)  # [B, H, L, N]: pooled over the group
    if L == 1:  # decode: the query chooses among all its keys
        pooled, cand = p, causal[:, None]  # [B, H, 1, N], [B, 1, 1, N]
    else:  # prefill: pooled over each tile's queries, chosen among the keys before the tile
        row = qpos // T - first[:, None]  # [B, L]
        onehot = ((qpos >= 0)[..., None] & (row[..., None] == jnp.arange(R))).astype(p.dtype)  # [B, L, R]
        pooled = jnp.einsum("bhln,blr->bhrn", p, onehot, precision=_HIGHEST)  # [B, H, R, N]
        s = (first[:, None] + jnp.arange(R)) * T  # [B, R]: each row's first position = keys before the tile
        cand = ((kpos[:, None, :] >= 0) & (kpos[:, None, :] < s[:, :, None]))[:, None]  # [B, 1, R, N]
    if K == 0:
        return jnp.full(pooled.shape[:3] + (0,), -1, INDEX_DTYPE)
    # A row keeps its counts[b, r] best candidates; it has at least that many, so no -inf is kept.
    top = jax.lax.top_k(jnp.where(cand, pooled, -jnp.inf), K)[1]  # [B, H, R, K]
    keep = jnp.arange(K) < counts[:, None, :, None]
    idx = jnp.sort(jnp.where(keep, top, _BIG), axis=-1)
    return jnp.where(idx == _BIG, -1, idx).astype(INDEX_DTYPE)


@functools.partial(jax.jit, static_argnames=("T", "decode"))
def _sparse(q, k, v, idx, row_start, scale, kv_start, q_offset, *, T: int, decode: bool):
    B, HQ, L, D = q.shape
    _, H, N, _ = k.shape
    R, K = idx.shape[2:]
    qpos, kpos = _positions(kv_start, q_offset, L, N)
    slot = jnp.where(idx >= 0, idx, N)  # -1 -> a spare column, dropped below
    at = jnp.ix_(jnp.arange(B), jnp.arange(H), jnp.arange(R))
    chosen = jnp.zeros((B, H, R, N + 1), bool).at[at[0][..., None], at[1][..., None], at[2][..., None],
                                                  slot].set(True)[..., :N]  # [B, H, R, N]
    if decode:
        mask = chosen[:, :, None]  # [B, H, 1, 1, N]
    else:
        tile = qpos // T  # [B, L]
        row = jnp.clip(tile - row_start[:, None].astype(jnp.int32), 0, R - 1)
        mine = jnp.take_along_axis(chosen, row[:, None, :, None], axis=2, mode="clip")  # [B, H, L, N]
        own = (kpos[:, None, :] >= (tile * T)[:, :, None]) & (kpos[:, None, :] <= qpos[:, :, None])  # [B, L, N]
        mask = mine[:, :, None] | own[:, None, None]  # [B, H, 1, L, N]
    p = _probabilities(q, k, scale, mask)
    return _attend(p, v, qpos, q.dtype)
