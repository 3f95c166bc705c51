"""``backend="triton"`` for the JAX ops: the project's Triton kernels (:mod:`kascade.ops`, backend ``"triton"``) on
JAX arrays, handed over through DLPack without copies, eagerly.

Each call converts its inputs with ``torch.from_dlpack`` (a view of the JAX buffer), runs the public torch op, and
converts the result back with ``jax.dlpack.from_dlpack`` (a view of the torch buffer). The torch op checks and
plans everything as it does for torch callers (dtype, head dim, group size, kernel limits); the only checks here
are the ones it cannot make: not under a JAX trace, arrays on a CUDA device.

Both frameworks allocate on the same GPU: JAX takes 75% of its memory at start-up unless told otherwise, so give the
torch side room (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or a smaller ``XLA_PYTHON_CLIENT_MEM_FRACTION``).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import torch

from .. import ops
from ..budget import Budget
from .reference import Selection

_TRACED = ("backend='triton' cannot run under jax.jit or another JAX transformation (the Triton kernels are called "
           "eagerly, through DLPack): use backend='reference' inside jit, or call the op outside jit")


def unavailable_reason(q, k, v=None, kv_start=None) -> str | None:
    """Why the Triton backend cannot take these JAX arrays (None if it can). CPU arrays are accepted only with
    ``TRITON_INTERPRET=1`` (Triton's interpreter: for tests), as :mod:`kascade.ops` does for torch tensors."""
    if any(isinstance(x, jax.core.Tracer) for x in (q, k, v, kv_start)):
        return _TRACED
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    for x in (q, k) if v is None else (q, k, v):
        if not isinstance(x, jax.Array):
            return f"backend='triton' needs jax.Array inputs, got {type(x).__name__}"
        devices = x.devices()
        if len(devices) != 1:
            return f"backend='triton' needs arrays on one device, got one sharded over {len(devices)}"
        platform = next(iter(devices)).platform
        if platform not in ("gpu", "cuda") and not (platform == "cpu" and interpreting):
            return f"backend='triton' needs JAX arrays on a CUDA device, got {platform} (use backend='reference')"
    return None


def _torch(x: jax.Array) -> torch.Tensor:
    return torch.from_dlpack(x)


def _jax(t: torch.Tensor) -> jax.Array:
    return jax.dlpack.from_dlpack(t.contiguous())


def _starts(kv_start) -> torch.Tensor:
    return torch.tensor(np.asarray(kv_start), dtype=torch.long)  # host values: the torch op reads them there


def dense_attention(q, k, v, *, scale: float, kv_start, q_offset: int):
    out = ops.dense_attention(_torch(q), _torch(k), _torch(v), scale=scale, kv_start=_starts(kv_start),
                              q_offset=q_offset, backend="triton")
    return _jax(out)


def select(q, k, *, budget: Budget, scale: float, kv_start, q_offset: int) -> Selection:
    sel = ops.select(_torch(q), _torch(k), budget=budget, scale=scale, kv_start=_starts(kv_start), q_offset=q_offset,
                     backend="triton")
    return Selection(_jax(sel.indices), _jax(sel.row_start.to(torch.int32)), sel.tile, sel.decode)


def sparse_attention(q, k, v, selection: Selection, *, scale: float, kv_start, q_offset: int):
    L = q.shape[2]
    idx = _torch(selection.indices)
    starts = _starts(kv_start)
    if not selection.decode:  # a reference selection has static room for more rows than this call's tiles
        idx = idx[:, :, : int(Budget(tile=selection.tile).tiles(q_offset + L - starts, L)[1].max())].contiguous()
    sel = ops.Selection(idx, _torch(selection.row_start).long(), selection.tile, selection.decode)
    out = ops.sparse_attention(_torch(q), _torch(k), _torch(v), sel, scale=scale, kv_start=starts,
                               q_offset=q_offset, backend="triton")
    return _jax(out)
