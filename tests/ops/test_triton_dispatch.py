"""backend='triton' through the public ops: dispatch to the kernels and clear refusals, on the test device (the
Triton interpreter on the CPU, or CUDA with KASCADE_TEST_DEVICE=cuda: tests/conftest.py)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kascade.budget import Budget  # noqa: E402
from kernel_checks import check_close, dev, sized  # noqa: E402
from kascade.ops import dense_attention, select, sparse_attention  # noqa: E402


def _inputs(L, N, HQ=4, H=2, D=64, dtype=torch.bfloat16, seed=0):
    """q, k, v on the test device."""
    g = torch.Generator().manual_seed(seed)
    return [dev(torch.randn(*s, generator=g).to(dtype)) for s in ((2, HQ, L, D), (2, H, N, D), (2, H, N, D))]


@pytest.mark.parametrize("L,N", [(1, sized(150)), (sized(70), sized(70)), (sized(33), sized(100))],
                         ids=["decode", "prefill", "chunked"])
def test_public_ops_dispatch_to_triton(L, N, monkeypatch):
    from kascade.ops.triton import decode, prefill

    calls = []
    mod = decode if L == 1 else prefill
    for name in ("dense_decode", "select_decode_indices", "sparse_decode") if L == 1 else \
            ("dense_prefill", "select_prefill", "sparse_prefill"):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **kw: (calls.append(_n), _o(*a, **kw))[1])
    q, k, v = _inputs(L, N)
    budget = Budget(ratio=0.2, k_min=16, tile=16)
    kv = dict(kv_start=torch.tensor([0, 9]))
    ref_sel = select(q, k, budget=budget, **kv)
    tri_sel = select(q, k, budget=budget, backend="triton", **kv)
    assert tri_sel.decode == ref_sel.decode
    for name, fn in (("dense", lambda b: dense_attention(q, k, v, backend=b, **kv)),
                     ("sparse", lambda b: sparse_attention(q, k, v, ref_sel, backend=b, **kv))):
        exact = (dense_attention(q.double(), k.double(), v.double(), **kv) if name == "dense"
                 else sparse_attention(q.double(), k.double(), v.double(), ref_sel, **kv))
        check_close(fn("triton"), exact, fn("reference"), name, floor=1e-5)
    assert len(set(calls)) == 3, calls  # the three Triton kernels ran, not the reference


def test_triton_refusals_name_the_problem():
    q, k, v = _inputs(1, 50, D=100, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dims"):
        dense_attention(q, k, v, backend="triton")
    q, k, v = _inputs(1, 50, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp16, bf16 and fp32"):
        dense_attention(q, k, v, backend="triton")
    q, k, v = _inputs(1, 50)
    with pytest.raises(ValueError, match="shared"):
        select(q, k, shared=True, backend="triton")


def test_triton_needs_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (x.cpu() for x in _inputs(1, 50))  # CPU tensors in every test mode: their refusal is under test
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        dense_attention(q, k, v, backend="triton")
    from conftest import tiny_model

    import kascade

    model = tiny_model("llama", head_dim=16)
    with pytest.raises(ValueError, match="cannot use backend='triton'.*needs CUDA tensors"):
        kascade.enable(model, backend="triton")
    with kascade.enable(model, warn_uncalibrated=False) as h:  # auto: the reference on a CPU model
        assert h.runtime.backend == "reference"


def test_one_backend_rule_for_every_caller(monkeypatch):
    """ops.resolve_backend is the rule enable, the runtime and kascade costs apply: auto picks the kernels on a CUDA
    device they serve only, triton where they cannot run is an error naming why, never a silent fallback."""
    from kascade import ops

    assert ops.resolve_backend("auto", "cpu", torch.float32, 64, 3) == "reference"
    assert ops.resolve_backend("reference", "cpu") == "reference"
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ops.resolve_backend("cuda", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ops.resolve_backend("triton", "cpu", torch.float32, 64, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernels on CPU tensors, when asked for
    assert ops.resolve_backend("triton", "cpu", torch.float32, 64, 3) == "triton"
    with pytest.raises(ValueError, match="head dims"):
        ops.resolve_backend("triton", "cpu", torch.float32, 12, 3)
    with pytest.raises(ValueError, match="GQA groups up to 16"):
        ops.resolve_backend("triton", "cpu", torch.float32, 64, 17)
