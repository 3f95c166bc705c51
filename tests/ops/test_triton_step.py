"""The decode step's one-launch geometry and metadata kernels (kascade.ops.triton.step) against the torch forms they
replace: the mask function's left-padding check and first valid slots (kascade.integration.functions), the
device-planned step's metadata (kascade.ops.step.decode_meta_static) and its counts at a budget multiplier
(kascade.ops.step.DecodeMeta.counts / with_counts); on the test device (tests/conftest.py)."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from kascade.budget import Budget  # noqa: E402
from kascade.integration.functions import _left_padded, _left_padding_start  # noqa: E402
from kascade.budget import at_factor  # noqa: E402
from kascade.ops.step import DecodeMeta, decode_meta, decode_meta_static  # noqa: E402
from kascade.ops.triton import step as ts  # noqa: E402
from kernel_checks import DEVICE, dev  # noqa: E402


def _host_check(row: torch.Tensor, q: int) -> bool:
    try:
        _left_padding_start(row[None], q + 1)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.int32])
def test_mask_geometry_is_the_torch_check_and_argmax_on_every_small_mask(dtype):
    """Every mask of 6 slots (64 rows in one batch), every query slot (past the mask's end too), the slot given as
    an int and as a device tensor with an offset: each row's flag is the host check's, kv_start the argmax."""
    rows = torch.tensor(list(itertools.product([0, 1], repeat=6)))
    mask = dev(rows.to(dtype))
    want_start = rows.to(torch.int32).argmax(1)
    for q in range(9):
        want_ok = torch.tensor([_host_check(r.bool(), q) for r in rows])
        for given in (q, dev(torch.tensor([q + 3]))):
            start, q_dev, ok = ts.mask_geometry(mask, given, kv_offset=3 if isinstance(given, torch.Tensor) else 0)
            assert int(q_dev) == q
            assert torch.equal(ok.cpu().bool(), want_ok), q
            assert torch.equal(start.cpu(), want_start)
            # the torch form's batch flag is every row's
            assert bool(ok.all()) == bool(_left_padded(rows.bool(), torch.tensor(q)))


def test_mask_geometry_reads_long_masks_and_strided_rows():
    """Masks longer than a program's block, left padding of several lengths, a hole far in, and a mask that is a
    column slice of a wider one (generate's mask past the cache's slots): the same as the torch forms."""
    W = 2500
    g = torch.Generator().manual_seed(0)
    wide = torch.ones(5, W + 40, dtype=torch.long)
    starts = [0, 1, 1023, 1024, 2100]
    for b, s in enumerate(starts):
        wide[b, :s] = 0
    wide[4, 2300] = 0  # a hole: refused where the query sits past it
    wide[:, W:] = torch.randint(0, 2, (5, 40), generator=g)  # past the keys: never read
    mask = dev(wide)[:, :W]
    for q in (2200, 2299, 2300, W - 1, W + 10):
        start, q_dev, ok = ts.mask_geometry(mask, q)
        assert start.cpu().tolist() == starts
        assert ok.cpu().bool().tolist() == [_host_check(r.bool(), q) for r in wide[:, :W]], q
        assert int(q_dev) == q
    assert ok.cpu().bool().tolist() == [True] * 4 + [False]


@pytest.mark.parametrize("ratio,k_min", [(0.1, 128), (0.3, 1), (1 / 3, 7), (0.0, 5), (1.0, 3), (0.07, 16)])
def test_decode_meta_kernel_is_the_torch_metadata(ratio, k_min):
    """The one-launch metadata equals the torch ops' (which count with kascade.budget's float64 rule) for lengths
    around every budget boundary, with and without left padding."""
    budget = Budget(ratio=ratio, k_min=k_min)
    for q_offset in (0, 1, 9, 127, 128, 1289, 1290, 4095, 10_001, 131_071):
        for starts in (None, torch.tensor([0, 1, q_offset])):
            B = 3
            s = None if starts is None else dev(starts.clamp(max=q_offset))
            q = dev(torch.tensor(q_offset))
            want = decode_meta_static(B, s, q, 1 << 17, budget)
            got = decode_meta_static(B, s, q, 1 << 17, budget, fused=True)
            assert got.tensor.dtype == torch.int32 and got.tensor.shape == (B, 4)
            assert torch.equal(got.tensor.cpu(), want.tensor.cpu()), (q_offset, starts)
            assert (got.n, got.k) == (want.n, want.k)
    # every n of a range against the host rule
    n = torch.arange(1, 3000)
    got = torch.cat([ts.meta_tensor(None, dev(torch.tensor(int(x) - 1)), 1, ratio, k_min).cpu() for x in n[::97]])
    assert got[:, 2].tolist() == [budget.decode(int(x)) for x in n[::97]]


@pytest.mark.parametrize("ratio,k_min", [(0.1, 128), (0.3, 1), (1 / 3, 7), (0.0, 5), (1.0, 3)])
def test_counts_kernel_is_the_budget_rule_at_every_factor(ratio, k_min):
    """The one-launch counts at a budget multiplier equal kascade.budget's float64 rule (halves round up, at least
    one key, at most n) for lengths around the budget's boundaries and factors whose products land on halves; the
    rows form keeps the metadata's other columns and replaces its budget column."""
    budget = Budget(ratio=ratio, k_min=k_min)
    ns = [1, 2, 3, 5, 7, 9, 127, 128, 129, 255, 1280, 1285, 1289, 1290, 4095, 10_001, 131_071]
    for factor in (0.5, 1.0, 1.5, 2.0, 0.25, 0.3, 1 / 3, 0.001, 3.7):
        for first in range(0, len(ns), 5):
            n = ns[first:first + 5]
            meta = dev(torch.tensor([[3 * b, x, 99, 7] for b, x in enumerate(n)], dtype=torch.int32))
            want = [budget.decode_counts(x, factor) for x in n]
            assert want == at_factor(budget.decode(torch.tensor(n)), factor, torch.tensor(n)).tolist()
            got = ts.counts_tensor(meta, ratio, k_min, factor)
            assert got.dtype == torch.int32 and got.cpu().tolist() == want, (factor, n)
            rows = ts.counts_tensor(meta, ratio, k_min, factor, rows=True).cpu()
            assert rows[:, 2].tolist() == want
            assert torch.equal(rows[:, [0, 1, 3]], meta.cpu()[:, [0, 1, 3]])


def test_fused_decode_metadata_counts_in_one_launch(monkeypatch):
    """DecodeMeta.counts / with_counts of a fused step (an eager Triton step on a GPU) take the counts kernel, once
    per factor (memoised), with the torch ops' values; the budget column of with_counts' metadata too."""
    budget = Budget(ratio=0.1, k_min=16)
    calls = []
    real = ts.counts_tensor
    monkeypatch.setattr(ts, "counts_tensor", lambda *a, **k: calls.append(a) or real(*a, **k))
    for make in (lambda f: decode_meta(3, device=DEVICE, kv_start=[0, 5, 900], q_offset=1000, budget=budget, fused=f),
                 lambda f: decode_meta_static(3, dev(torch.tensor([0, 5, 900])), dev(torch.tensor(1000)), 1024,
                                              budget, fused=f)):
        plain, fused = make(False), make(True)
        assert fused.fused and not plain.fused
        for factor in (0.5, 1.5, 2.0):
            n0 = len(calls)
            assert torch.equal(fused.counts(budget, factor).cpu(), plain.counts(budget, factor).cpu())
            assert torch.equal(fused.with_counts(budget, factor).tensor.cpu(),
                               plain.with_counts(budget, factor).tensor.cpu())
            fused.counts(budget, factor), fused.with_counts(budget, factor)  # memoised: no launch
            assert len(calls) == n0 + 2
            assert fused.with_counts(budget, factor).fused
    assert isinstance(plain, DecodeMeta)


def test_a_triton_decode_step_is_planned_in_one_launch(monkeypatch):
    """plan_step on the Triton backend plans a device-planned decode step with the fused kernel (eagerly); the
    reference backend keeps the torch ops."""
    from kascade import ops

    calls = []
    real = ts.meta_tensor
    monkeypatch.setattr(ts, "meta_tensor", lambda *a, **k: calls.append(a) or real(*a, **k))
    q = dev(torch.randn(2, 4, 1, 16))
    k = dev(torch.randn(2, 2, 300, 16))
    pos = dev(torch.tensor(250))
    fused = ops.plan_step(q, k, kv_start=dev(torch.tensor([0, 7])), q_offset=pos, backend="triton")
    assert len(calls) == 1
    ref = ops.plan_step(q, k, kv_start=dev(torch.tensor([0, 7])), q_offset=pos, backend="reference")
    assert len(calls) == 1
    assert torch.equal(fused.meta.tensor.cpu(), ref.meta.tensor.cpu())


def test_a_deferred_decode_masks_geometry_is_one_fused_launch(monkeypatch):
    """Where a decode step's check is deferred (a GPU; made so here), the mask function reads the padding mask with
    the fused kernel once: the same first valid slots and query slot as the torch ops, and a hole in the mask is
    still refused when the check is read."""
    from transformers.masking_utils import causal_mask_function

    from kascade.integration import functions

    monkeypatch.setattr(functions, "DEFERRED_CHECK", ("cuda", "cpu", DEVICE.type))
    calls = []
    real = ts.mask_geometry
    monkeypatch.setattr(ts, "mask_geometry", lambda *a, **k: calls.append(a) or real(*a, **k))
    left = torch.ones(2, 50, dtype=torch.long)
    left[1, :7] = 0
    pos = dev(torch.tensor([49]))
    m = functions.kascade_mask(batch_size=2, q_length=1, kv_length=50, q_offset=pos, kv_offset=0,
                               mask_function=causal_mask_function, attention_mask=dev(left))
    assert len(calls) == 1
    assert m.kv_start.cpu().tolist() == [0, 7] and int(m.q_offset) == 49
    m.check.verify()  # left padding: accepted
    hole = left.clone()
    hole[0, 20] = 0
    m = functions.kascade_mask(batch_size=2, q_length=1, kv_length=50, q_offset=pos, kv_offset=0,
                               mask_function=causal_mask_function, attention_mask=dev(hole))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="left padding"):
        m.check.verify()
