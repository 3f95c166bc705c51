"""The JAX ops (kascade.jax) against the PyTorch reference (kascade.ops, backend "reference"), eagerly and under jit.

(Not named test_reference.py: tests/ops/ has one, and test modules here are imported by their basename.)
"""

import numpy as np
import pytest

# "jax.numpy", not "jax": pytest puts tests/ on sys.path, where this folder would pass for a namespace package jax.
pytest.importorskip("jax.numpy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import kascade.jax as kj  # noqa: E402
from kascade import ops  # noqa: E402
from kascade.budget import Budget  # noqa: E402

# What must be static under jit (kascade.jax's docstring); scale and kv_start are traced.
jit_dense = jax.jit(kj.dense_attention, static_argnames=("q_offset", "backend"))
jit_select = jax.jit(kj.select, static_argnames=("budget", "q_offset", "backend"))
jit_sparse = jax.jit(kj.sparse_attention, static_argnames=("q_offset", "backend"))

# (B, HQ, H, N, L, q_offset, D, tile, k_min, ratio, rolling): G in 1..8, N not a multiple of the tile, chunked
# prefill (q_offset > 0, unused cache slots after the chunk, chunks not tile-aligned), L == 1 decode (last slot or
# a static cache with room after it).
CASES = [
    (2, 2, 2, 37, 37, None, 16, 8, 4, 0.4, True),
    (3, 6, 2, 97, 97, None, 64, 8, 4, 0.3, False),
    (2, 8, 1, 70, 30, 33, 16, 8, 6, 0.2, True),
    (2, 10, 2, 130, 45, 85, 64, 16, 16, 0.3, True),
    (1, 4, 1, 50, 50, None, 16, 8, 128, 0.1, True),  # k_min > N: rows capped by k(N) - T
    (2, 14, 2, 61, 2, 39, 16, 4, 3, 0.3, True),  # two queries in two tiles
    (3, 8, 2, 97, 1, None, 64, 16, 8, 0.1, True),  # decode
    (2, 6, 6, 40, 1, 25, 16, 8, 4, 0.2, True),  # decode into a static cache
    (2, 16, 2, 300, 1, None, 16, 32, 16, 0.05, True),
]


def _ids(c):
    return "B{}-HQ{}-H{}-N{}-L{}-off{}-D{}-T{}-kmin{}-r{}-{}".format(*c[:-1], "rolling" if c[-1] else "fixed")


def _inputs(case, seed):
    B, HQ, H, N, L, q_offset, D = case[:7]
    q_offset = N - L if q_offset is None else q_offset
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((B, HQ, L, D), (B, H, N, D), (B, H, N, D)))
    # Sequence 0 uses every slot; the others are left-padded (possibly past the chunk's first queries).
    starts = np.array([0] + rng.integers(0, q_offset + L, B - 1).tolist(), np.int32)
    return q, k, v, starts, q_offset


@pytest.fixture
def fast_compile():
    """XLA without most optimisations: compiles several times faster, same results up to rounding (the other tests
    here run fully optimised)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(params=["fp32", "fp64"])
def dtype(request):
    """fp64 runs with jax_enable_x64, for this test only."""
    if request.param == "fp32":
        yield np.float32, torch.float32, dict(rtol=2e-5, atol=2e-6)
        return
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield np.float64, torch.float64, dict(rtol=1e-12, atol=1e-13)
    finally:
        jax.config.update("jax_enable_x64", before)


def _as_jax_selection(sel: ops.Selection) -> kj.Selection:
    return kj.Selection(jnp.asarray(sel.indices.numpy()), jnp.asarray(sel.row_start.numpy()), sel.tile, sel.decode)


def _padded(idx: np.ndarray, shape) -> np.ndarray:
    """A torch selection's indices with -1 rows and columns up to the JAX selection's static shape."""
    out = np.full(shape, -1, np.int64)
    out[:, :, : idx.shape[2], : idx.shape[3]] = idx
    return out


def _assert_selects_and_is_sparse(sel: kj.Selection, starts, q_offset: int, L: int):
    """The case tests something: rows keep keys, and at least one keeps fewer than its candidates."""
    idx = np.asarray(sel.indices)
    kept = (idx >= 0).sum(-1)  # [B, H, R]
    n = q_offset + L - starts.astype(np.int64)
    if sel.decode:
        cand = n[:, None, None]
    else:
        cand = ((np.asarray(sel.row_start)[:, None] + np.arange(idx.shape[2])) * sel.tile)[:, None, :]
    assert kept.sum() > 0, "no row selects a key: the case tests nothing"
    assert ((kept > 0) & (kept < cand)).any(), "no row leaves a candidate out: the case tests no top-k"


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_ops_match_the_torch_reference_eagerly_and_under_jit(case, dtype):
    """fp32: eagerly and under jit; fp64: eagerly, also on the torch op's own selection."""
    np_dt, torch_dt, tol = dtype
    B, HQ, H, N, L, _, D, tile, k_min, ratio, rolling = case
    budget = Budget(ratio=ratio, k_min=k_min, tile=tile, rolling=rolling)
    q, k, v, starts, q_offset = _inputs(case, seed=N + L)
    tq, tk, tv = (torch.tensor(x, dtype=torch_dt) for x in (q, k, v))
    jq, jk, jv = (jnp.asarray(x.astype(np_dt)) for x in (q, k, v))
    assert jq.dtype == np_dt
    geo = dict(kv_start=torch.tensor(starts, dtype=torch.long), q_offset=q_offset)
    jgeo = dict(kv_start=jnp.asarray(starts), q_offset=q_offset)

    want_dense = ops.dense_attention(tq, tk, tv, **geo).numpy()
    want_sel = ops.select(tq, tk, budget=budget, **geo)
    want_sparse = ops.sparse_attention(tq, tk, tv, want_sel, **geo).numpy()

    dense = kj.dense_attention(jq, jk, jv, **jgeo)
    sel = kj.select(jq, jk, budget=budget, **jgeo)
    sparse = kj.sparse_attention(jq, jk, jv, sel, **jgeo)
    assert dense.dtype == sparse.dtype == np_dt
    np.testing.assert_allclose(np.asarray(dense), want_dense, **tol)
    # Selections: the same row starts, the same key sets (rows are ascending, so equal sets are equal rows).
    assert sel.decode == want_sel.decode and sel.tile == tile
    np.testing.assert_array_equal(np.asarray(sel.row_start), want_sel.row_start.numpy())
    assert sel.indices.shape == (B, H) + kj.selection_shape(budget, L, q_offset)
    np.testing.assert_array_equal(np.asarray(sel.indices), _padded(want_sel.indices.numpy(), sel.indices.shape))
    _assert_selects_and_is_sparse(sel, starts, q_offset, L)
    np.testing.assert_allclose(np.asarray(sparse), want_sparse, **tol)
    if np_dt == np.float64:  # sparse attention on the torch op's own selection (shaped as torch shapes it)
        got = kj.sparse_attention(jq, jk, jv, _as_jax_selection(want_sel), **jgeo)
        np.testing.assert_allclose(np.asarray(got), want_sparse, **tol)
        return

    # Under jit, with kv_start traced: the same selection, the same outputs.
    scale = D**-0.5  # traced under jit
    jsel = jit_select(jq, jk, budget=budget, scale=scale, **jgeo)
    np.testing.assert_array_equal(np.asarray(jsel.indices), np.asarray(sel.indices))
    np.testing.assert_array_equal(np.asarray(jsel.row_start), np.asarray(sel.row_start))
    np.testing.assert_allclose(np.asarray(jit_dense(jq, jk, jv, scale=scale, **jgeo)), np.asarray(dense), **tol)
    np.testing.assert_allclose(np.asarray(jit_sparse(jq, jk, jv, jsel, scale=scale, **jgeo)), np.asarray(sparse),
                               **tol)


def test_one_jitted_layer_serves_every_padding_without_recompiling():
    """kv_start is traced: one compiled program serves batches padded differently, and its selection rows and
    columns beyond a sequence's own are -1."""
    budget = Budget(ratio=0.3, k_min=4, tile=8)
    q, k, v, _, _ = _inputs((2, 4, 2, 60, 60, None, 16), seed=3)
    jq, jk, jv = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    traces = []

    @jax.jit
    def layer(q, k, v, kv_start):
        traces.append(kv_start)
        sel = kj.select(q, k, budget=budget, kv_start=kv_start)
        return sel, kj.sparse_attention(q, k, v, sel, kv_start=kv_start)

    for starts in ([0, 0], [0, 17], [41, 3]):
        sel, out = layer(jq, jk, jv, jnp.asarray(starts, jnp.int32))
        tq, tk, tv = (torch.tensor(x, dtype=torch.float32) for x in (q, k, v))
        want = ops.select(tq, tk, budget=budget, kv_start=torch.tensor(starts))
        np.testing.assert_array_equal(np.asarray(sel.indices), _padded(want.indices.numpy(), sel.indices.shape))
        np.testing.assert_allclose(np.asarray(out), ops.sparse_attention(tq, tk, tv, want, kv_start=torch.tensor(
            starts)).numpy(), rtol=2e-5, atol=2e-6)
        pad = np.asarray(out)[1, :, : starts[1]]
        assert (pad == 0).all(), "queries at padding slots get zeros"
    assert len(traces) == 1


def test_low_precision_inputs_keep_their_dtype():
    q, k, v, starts, q_offset = _inputs((2, 4, 2, 40, 40, None, 16), seed=5)
    budget = Budget(ratio=0.25, k_min=4, tile=8)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    tq, tk, tv = (torch.tensor(x, dtype=torch.bfloat16) for x in (q, k, v))
    sel = kj.select(jq, jk, budget=budget, kv_start=starts)
    want_sel = ops.select(tq, tk, budget=budget, kv_start=torch.tensor(starts))
    np.testing.assert_array_equal(np.asarray(sel.indices), _padded(want_sel.indices.numpy(), sel.indices.shape))
    out = kj.sparse_attention(jq, jk, jv, sel, kv_start=starts)
    want = ops.sparse_attention(tq, tk, tv, want_sel, kv_start=torch.tensor(starts))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want.float().numpy(), rtol=1e-2, atol=1e-2)


def test_take_heads_follows_the_head_map():
    q, k, _, starts, _ = _inputs((2, 6, 3, 40, 40, None, 16), seed=7)
    sel = kj.select(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), budget=Budget(ratio=0.25, k_min=4,
                                                                                              tile=8))
    mapped = sel.take_heads([2, 2, 0])
    for h, a in enumerate([2, 2, 0]):
        np.testing.assert_array_equal(np.asarray(mapped.indices[:, h]), np.asarray(sel.indices[:, a]))


@pytest.mark.parametrize("call,needle", [
    (lambda q, k, v: kj.dense_attention(q[0], k, v), "must be 4-D"),
    (lambda q, k, v: kj.dense_attention(q, k, v[:, :, :5]), "same shape"),
    (lambda q, k, v: kj.dense_attention(q[:, :3], k, v), "multiple of KV heads"),
    (lambda q, k, v: kj.dense_attention(q.astype(jnp.int32), k, v), "floating-point"),
    (lambda q, k, v: kj.dense_attention(q, k, v, q_offset=5), "outside the 40 key slots"),
    (lambda q, k, v: kj.dense_attention(q, k, v, kv_start=[0, 40]), "without keys"),
    (lambda q, k, v: kj.dense_attention(q, k, v, kv_start=[0]), r"shape \[B\]=\[2\]"),
    (lambda q, k, v: kj.dense_attention(q, k, v, kv_start=jnp.asarray([0.0, 1.0])), "integers"),
    (lambda q, k, v: kj.dense_attention(q, k, v, backend="cuda"), "unknown backend"),
    (lambda q, k, v: kj.select(q, k, budget=0.1), "kascade.Budget"),
    (lambda q, k, v: kj.sparse_attention(q, k, v, "rows"), "kascade.jax.Selection"),
    (lambda q, k, v: jax.jit(lambda q, k, v, o: kj.dense_attention(q, k, v, q_offset=o))(q, k, v, 0), "Python int"),
    (lambda q, k, v: kj.sparse_attention(q[:, :, 8:], k, v, kj.select(q, k, budget=Budget(k_min=4, tile=8))),
     "made for another chunk"),
    (lambda q, k, v: kj.sparse_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1],
                                         kj.select(q, k, budget=Budget(k_min=4, tile=8))), "prefill selection"),
    (lambda q, k, v: kj.dense_attention(q, k.astype(jnp.float16), v.astype(jnp.float16)), "one dtype"),
    (lambda q, k, v: kj.select(q, k.astype(jnp.bfloat16)), "one dtype"),
    (lambda q, k, v: kj.dense_attention(q, k, v, scale=float("nan")), "finite real number"),
    (lambda q, k, v: kj.dense_attention(q, k, v, scale=jnp.asarray(float("inf"))), "finite real number"),
    (lambda q, k, v: kj.dense_attention(q, k[:, :, :0], v[:, :, :0]), "no keys"),
    (lambda q, k, v: kj.dense_attention(q[:, :0], k, v), r"no query heads \(HQ == 0\)"),
    (lambda q, k, v: kj.dense_attention(q[..., :0], k[..., :0], v[..., :0]), "empty head dim"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_are_refused(call, needle):
    q, k, v, _, _ = _inputs((2, 4, 2, 40, 40, None, 16), seed=0)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    with pytest.raises((ValueError, TypeError), match=needle):
        call(q, k, v)


def test_a_traced_scale_is_taken_under_jit():
    q, k, v, _, _ = _inputs((1, 4, 2, 16, 16, None, 8), seed=1)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    jitted = jax.jit(lambda q, k, v, s: kj.dense_attention(q, k, v, scale=s))
    np.testing.assert_allclose(np.asarray(jitted(q, k, v, 0.3)), np.asarray(kj.dense_attention(q, k, v, scale=0.3)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["decode future", "prefill own tile", "before kv_start", "twice", "padding first"])
def test_a_selection_naming_keys_its_row_may_not_attend_is_refused_as_by_torch(case):
    """kascade.jax.sparse_attention took a selection holding future keys (the torch op refuses it)."""
    decode = case == "decode future"
    L, q_offset = (1, 30) if decode else (16, 24)  # a cache of 40 slots; sequence 1 starts at slot 5
    q, k, v, _, _ = _inputs((2, 4, 2, 40, L, q_offset, 16), seed=3)
    geo = dict(kv_start=[0, 5], q_offset=q_offset)
    qj, kj_, vj = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    sel = kj.select(qj, kj_, budget=Budget(k_min=12, tile=8), **geo)
    idx = np.asarray(sel.indices).copy()
    row = idx[1, 0, -1]  # sequence 1, head 0, last row
    if decode:
        row[0], needle = 35, "slot 35 .* is not a key that row may attend"  # after the query at slot 30
    elif case == "prefill own tile":
        row[0], needle = 38, "slot 38 .* is not a key that row may attend"  # in the row's own tile: slots 37..
    elif case == "before kv_start":
        row[0], needle = 2, "slot 2 .* is not a key that row may attend"  # left padding of sequence 1
    elif case == "twice":
        row[1], needle = row[0], "names the same key twice"
    else:
        row[0], needle = -1, "-1 padding only at the end"
    bad = kj.Selection(indices=jnp.asarray(idx), row_start=sel.row_start, tile=sel.tile, decode=sel.decode)
    with pytest.raises(ValueError, match=needle):
        kj.sparse_attention(qj, kj_, vj, bad, **geo)
    as_torch = ops.Selection(indices=torch.tensor(idx).long(), row_start=torch.tensor(np.asarray(sel.row_start)).long(),
                             tile=sel.tile, decode=decode)
    with pytest.raises(ValueError, match=needle):  # the refusal the torch op gives
        ops.sparse_attention(*(torch.as_tensor(x, dtype=torch.float32) for x in (q, k, v)), as_torch, **geo)
    np.testing.assert_array_equal(np.asarray(kj.sparse_attention(qj, kj_, vj, sel, **geo)).shape, (2, 4, L, 16))
