"""The ops as torch custom ops (kascade/ops/library.py): ``torch.library.opcheck`` of every op on both backends
(the Triton one in the interpreter on the CPU, or on CUDA with KASCADE_TEST_DEVICE=cuda), and the reference's
decode forms on device metadata against the per-sequence specification."""

import pytest
import torch

from kascade.budget import Budget
from kascade.ops import dense_attention, dense_select, library, plan_step, reference, select, sparse_attention
from kascade.ops.step import decode_meta
from kernel_checks import dev

BUDGET = Budget(ratio=0.25, k_min=8, tile=8)


def _qkv(B=2, HQ=4, H=2, L=1, N=40, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [dev(torch.randn(*s, generator=g).to(dtype)) for s in ((B, HQ, L, D), (B, H, N, D), (B, H, N, D))]


def _static(N, kv_start, slot):
    """A decode step over a static cache of ``N`` slots: ``(kv_start [B], q_offset 0-d)`` as device tensors."""
    return dev(torch.tensor(kv_start)), dev(torch.tensor(slot))


def _opcheck(name, *args):
    """Every check on the reference backend; on the Triton one (its interpreter on the CPU: slow) the two that depend
    on the backend, the schema (no mutation, no output aliasing an input) and the fake implementation (the real
    outputs' shapes, strides and dtypes); the registration-level ones (autograd, AOT dispatch) are the same op's."""
    utils = ("test_schema", "test_faketensor") if args[-1] == "triton" else \
        ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(library.OPS[name], args, test_utils=utils)


def test_every_op_is_registered_under_the_kascade_namespace():
    assert sorted(library.OPS) == sorted(["dense_decode", "select_decode", "dense_select_decode", "sparse_decode",
                                          "dense_attention", "select", "dense_select", "sparse_attention"])
    for name in library.OPS:
        assert hasattr(torch.ops.kascade, name), name


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rank_factor", [None, 1.5], ids=["set", "ranked"])
def test_opcheck_decode_ops(backend, rank_factor):
    if backend == "triton":
        pytest.importorskip("triton")
    q, k, v = _qkv(N=40)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # as transformers hands it: heads not outermost
    meta = decode_meta(2, device=q.device, kv_start=[0, 7], q_offset=30, budget=BUDGET).tensor
    idx_dtype = torch.int32 if backend == "triton" else torch.long
    _opcheck("dense_decode", q, k, v, meta, 40, 0.25, backend)
    _opcheck("select_decode", q, k, meta, 40, 0.25, BUDGET.ratio, BUDGET.k_min, rank_factor, None, idx_dtype, backend)
    for score_dtype in ("fp8", "int8") if backend == "reference" else ("int8",):  # FP8: the reference's alone
        _opcheck("select_decode", q, k, meta, 40, 0.25, BUDGET.ratio, BUDGET.k_min, rank_factor, score_dtype,
                 idx_dtype, backend)
    _opcheck("dense_select_decode", q, k, v, meta, 40, 0.25, BUDGET.ratio, BUDGET.k_min, rank_factor, idx_dtype, backend)
    idx = library.OPS["select_decode"](q, k, meta, 40, 0.25, BUDGET.ratio, BUDGET.k_min, rank_factor, None, idx_dtype,
                                       backend)
    counts = None if rank_factor is None else dev(torch.tensor([3, 5], dtype=torch.int32))
    _opcheck("sparse_decode", q, k, v, idx, counts, None, 0.25, backend)
    hm = dev(torch.tensor([1, 1]))
    _opcheck("sparse_decode", q, k, v, idx, counts, hm, 0.25, backend)  # a head map
    # which attends the selection as taken through it
    assert torch.equal(library.OPS["sparse_decode"](q, k, v, idx, counts, hm, 0.25, backend),
                       library.OPS["sparse_decode"](q, k, v, idx[:, [1, 1]].contiguous(), counts, None, 0.25, backend))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck_host_geometry_ops(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    q, k, v = _qkv(L=12, N=22)  # two tiles before the queries' (tile 8), one more with them
    b = Budget(ratio=0.25, k_min=16, tile=8)  # a tile selects min(s, k(N) - 8) of its s earlier keys
    step = plan_step(q, k, budget=b, kv_start=torch.tensor([0, 5]), q_offset=10, backend=backend)
    ks = step.kv_start
    rows, width = step.rows, step.counts(1.0)[1]
    assert width > 0  # the tiles select keys
    args = (ks, 10, 0.25, b.ratio, b.k_min, b.tile, b.rolling)
    _opcheck("dense_attention", q, k, v, ks, 10, 0.25, backend)
    _opcheck("select", q, k, *args, None, False, None, rows, width, step.index_dtype, backend)
    for score_dtype in ("fp8", "int8") if backend == "reference" else ("int8",):  # FP8: the reference's alone
        _opcheck("select", q, k, *args, None, False, score_dtype, rows, width, step.index_dtype, backend)
    _opcheck("dense_select", q, k, v, *args, 2.0, rows, step.counts(2.0)[1], step.index_dtype, backend)
    idx, row_start = library.OPS["select"](q, k, *args, None, False, None, rows, width, step.index_dtype, backend)
    _opcheck("sparse_attention", q, k, v, idx, row_start, None, None, False, b.tile, ks, 10, 0.25, backend)
    _opcheck("sparse_attention", q, k, v, idx, row_start, None, dev(torch.tensor([1, 0])), False, b.tile, ks, 10, 0.25,
             backend)  # a head map
    counts = step.counts(0.5)[0]
    _opcheck("sparse_attention", q, k, v, idx, row_start, counts, None, True, b.tile, ks, 10, 0.25, backend)


def test_the_eager_call_and_the_registered_op_compute_the_same():
    q, k, v = _qkv(N=40)
    meta = decode_meta(2, device=q.device, kv_start=[0, 7], q_offset=30, budget=BUDGET).tensor
    direct = library.call("dense_select_decode", q, k, v, meta, 40, 0.25, 0.25, 8, None, torch.long, "reference")
    via_op = torch.ops.kascade.dense_select_decode(q, k, v, meta, 40, 0.25, 0.25, 8, None, torch.long, "reference")
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op))


@pytest.mark.parametrize("rank_factor", [None, 0.6, 1.8], ids=["set", "ranked-shallow", "ranked-deep"])
def test_reference_decode_on_device_metadata_is_the_specification(rank_factor):
    """The reference's decode forms over every slot of a static cache (the geometry in ``meta``) select the keys and
    compute the outputs of the per-sequence specification: a left-padded sequence, unused slots after the query."""
    B, N, slot = 3, 50, 41  # slots 42..49 are unused cache space
    kv_start = [0, 9, 30]
    q, k, v = _qkv(B=B, HQ=6, H=3, N=N, dtype=torch.float64, seed=1)
    k[:, :, slot + 1:] = float("nan")  # unused slots must not be read into any result
    v[:, :, slot + 1:] = float("nan")
    host = plan_step(q, k, budget=BUDGET, kv_start=torch.tensor(kv_start), q_offset=slot)
    device = plan_step(q, k, budget=BUDGET, **dict(zip(("kv_start", "q_offset"), _static(N, kv_start, slot))))
    assert device.on_device and device.meta is not None and host.meta is None
    want_out, want = dense_select(q, k, v, scale=0.3, step=host, rank_factor=rank_factor)
    got_out, got = dense_select(q, k, v, scale=0.3, step=device, rank_factor=rank_factor)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    assert got.ranked == want.ranked and got.decode and got.indices.dtype == torch.long
    assert torch.equal(got.as_set().indices[..., :want.indices.shape[-1]], want.as_set().indices)
    assert (got.indices[..., want.indices.shape[-1]:] == -1).all()  # the width is the capacity's budget
    assert torch.equal(select(q, k, scale=0.3, step=device, rank_factor=rank_factor).indices, got.indices)
    torch.testing.assert_close(dense_attention(q, k, v, scale=0.3, step=device), want_out, rtol=1e-12, atol=1e-12)
    if rank_factor is not None:  # a prefix view (a reuse layer with a smaller budget) reads the first counts entries
        c_host, w_host = host.counts(0.5)
        c_dev, w_dev = device.counts(0.5)
        assert torch.equal(c_dev.cpu(), c_host.cpu())
        want = want.prefix(c_host, w_host)
        got = got.prefix(c_dev, w_dev)
    torch.testing.assert_close(sparse_attention(q, k, v, got, scale=0.3, step=device),
                               sparse_attention(q, k, v, want, scale=0.3, step=host), rtol=1e-12, atol=1e-12)


def test_a_decode_step_planned_on_the_device_reads_nothing_back(monkeypatch):
    """A static-cache decode step on the reference backend: planning it and running every op makes no host read of
    a device value (``Tensor.item``, ``int()``, ``.tolist()``, ``.cpu()`` would each synchronise a GPU)."""
    q, k, v = _qkv(N=40)
    kv_start, slot = _static(40, [0, 6], 30)
    reads = []
    for name in ("item", "tolist", "cpu", "__int__", "__bool__", "__index__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **kw: (reads.append(_n),
                                                                                          _o(self, *a, **kw))[1])
    step = plan_step(q, k, budget=BUDGET, kv_start=kv_start, q_offset=slot)
    out, sel = dense_select(q, k, v, step=step)
    sel2 = select(q, k, step=step, rank_factor=2.0)
    sparse_attention(q, k, v, sel2.prefix(*step.counts(0.5)), step=step)
    monkeypatch.undo()
    assert reads == []
    assert out.shape == q.shape and sel.indices.shape == (2, 2, 1, BUDGET.decode(40))


def test_a_budget_is_one_object_however_its_arguments_are_passed():
    """Layer 0's op passes (ratio, k_min), the anchors' ops add score_dtype by keyword: the same Budget either way,
    so that the decode metadata the library keeps for a step (and its counts, memoised on it) serves them all."""
    from kascade.ops import library

    a = library._budget(0.1, 128)
    assert a is library._budget(0.1, 128, score_dtype=None) is library._budget(0.1, 128, 32, True, None)
    assert a is not library._budget(0.1, 128, score_dtype="int8")
