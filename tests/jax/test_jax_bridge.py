"""backend="triton" on the JAX ops: refusals (traced calls, arrays off CUDA), and the DLPack path itself.

The DLPack path runs wherever the project's Triton tests run: on the CPU in Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py), or compiled on a GPU with KASCADE_TEST_DEVICE=cuda (the JAX arrays then live on JAX's
GPU)."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # not "jax": see test_jax_reference.py
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import kascade.jax as kj  # noqa: E402
from jax_device import ON_GPU, kernel_device  # noqa: E402
from kascade.budget import Budget  # noqa: E402
from kascade.jax import bridge  # noqa: E402

BUDGET = Budget(ratio=0.5, k_min=4, tile=8)


def _qkv(B=2, HQ=4, H=2, L=40, N=40, D=16, dtype=jnp.float32, seed=0, device=None):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((B, HQ, L, D), (B, H, N, D), (B, H, N, D))]
    return [jax.device_put(jnp.asarray(x, dtype), device) for x in arrays]


OPS = [
    lambda q, k, v, **kw: kj.dense_attention(q, k, v, backend="triton", **kw),
    lambda q, k, v, **kw: kj.select(q, k, budget=BUDGET, backend="triton", **kw),
    lambda q, k, v, **kw: kj.sparse_attention(q, k, v, kj.select(q, k, budget=BUDGET), backend="triton", **kw),
]


@pytest.mark.parametrize("op", OPS, ids=["dense", "select", "sparse"])
def test_triton_refuses_traced_calls(op):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"cannot run under jax.jit.*use backend='reference' inside jit"):
        jax.jit(lambda q, k, v: op(q, k, v))(q, k, v)
    with pytest.raises(ValueError, match="cannot run under jax.jit"):  # a traced kv_start alone is enough
        jax.jit(lambda s: op(q, k, v, kv_start=s))(jnp.zeros(2, jnp.int32))


@pytest.mark.parametrize("op", OPS, ids=["dense", "select", "sparse"])
def test_triton_refuses_arrays_off_cuda(op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(device=jax.devices("cpu")[0])
    with pytest.raises(ValueError, match=r"needs JAX arrays on a CUDA device, got cpu \(use backend='reference'\)"):
        op(q, k, v)


def _sets(sel, shape):
    idx = np.full(shape, -1, np.int64)
    got = np.asarray(sel.indices)
    idx[:, :, : got.shape[2], : got.shape[3]] = got
    return idx


# (B, HQ, H, N, L, q_offset, kv_start): prefill with left padding, a chunk with unused cache slots, decode.
GEOMETRIES = [(2, 4, 2, 40, 40, None, [0, 7]), (2, 8, 2, 70, 30, 33, [0, 40]), (2, 4, 2, 50, 1, 44, [0, 9])]


@pytest.mark.parametrize("dtype", ["float32"] + (["bfloat16"] if ON_GPU else []))
@pytest.mark.parametrize("geo", GEOMETRIES, ids=["prefill", "chunk", "decode"])
def test_triton_through_dlpack_matches_the_reference(geo, dtype):
    pytest.importorskip("triton")
    device = kernel_device()
    B, HQ, H, N, L, q_offset, starts = geo
    q, k, v = _qkv(B, HQ, H, L, N, 16, getattr(jnp, dtype), seed=N + L, device=device)
    kw = dict(kv_start=np.array(starts), q_offset=q_offset)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)

    dense = kj.dense_attention(q, k, v, backend="triton", **kw)
    assert isinstance(dense, jax.Array) and dense.dtype == q.dtype and dense.devices() == {device}
    np.testing.assert_allclose(np.asarray(dense, np.float32),
                               np.asarray(kj.dense_attention(q, k, v, **kw), np.float32), **tol)
    sel, ref = kj.select(q, k, budget=BUDGET, backend="triton", **kw), kj.select(q, k, budget=BUDGET, **kw)
    np.testing.assert_array_equal(np.asarray(sel.row_start), np.asarray(ref.row_start))
    np.testing.assert_array_equal(_sets(sel, ref.indices.shape), np.asarray(ref.indices))
    assert (np.asarray(ref.indices) >= 0).any()
    want = np.asarray(kj.sparse_attention(q, k, v, ref, **kw), np.float32)
    np.testing.assert_allclose(np.asarray(kj.sparse_attention(q, k, v, sel, backend="triton", **kw), np.float32),
                               want, **tol)
    # The reference's selection (static room for more rows and columns) runs on the kernels too.
    np.testing.assert_allclose(np.asarray(kj.sparse_attention(q, k, v, ref, backend="triton", **kw), np.float32),
                               want, **tol)


def test_dlpack_hands_buffers_over_without_copies():
    device = kernel_device()
    (q,) = _qkv(device=device)[:1]
    t = bridge._torch(q)
    assert t.data_ptr() == q.unsafe_buffer_pointer() and tuple(t.shape) == q.shape
    back = bridge._jax(t)
    assert back.unsafe_buffer_pointer() == t.data_ptr()
    assert isinstance(t, torch.Tensor)


def test_triton_geometry_stays_on_the_host():
    """The Triton backend's kv_start is read on the host by the torch op: the JAX side keeps it a NumPy array (no JAX
    dispatch, no read-back from the device per call; docs/jax.md), with the same values and checks."""
    from kascade.jax import _geometry

    q, k, v = _qkv(device=kernel_device())
    starts, off = _geometry(q, k, v, None, None, "triton")
    assert isinstance(starts, np.ndarray) and starts.dtype == np.int32 and starts.tolist() == [0] * q.shape[0]
    given, _ = _geometry(q, k, v, jnp.array([0, 3]), None, "triton")
    assert isinstance(given, np.ndarray) and given.tolist() == [0, 3] and off == k.shape[2] - q.shape[2]
    with pytest.raises(ValueError, match="leaves a sequence without keys"):
        _geometry(q, k, v, np.array([0, k.shape[2] + 5]), None, "triton")
    assert isinstance(_geometry(q, k, v, None, None, "reference")[0], jax.Array)
