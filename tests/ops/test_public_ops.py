"""The public ops' checks: every bad argument is refused with a message naming it, before any work; a step plan
serves every layer of a forward and is checked against each call's shapes."""

import pytest
import torch

from kascade.budget import Budget
from kascade.ops import Selection, dense_attention, dense_select, plan_step, select, sparse_attention

BUDGET = Budget(ratio=0.5, k_min=4, tile=8)  # k(40) = 20: tiles at 8, 16, 24, 32 keep 4, 8, 12, 12 keys


def _qkv(B=2, HQ=4, H=2, L=40, N=40, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, L, D, generator=g, dtype=dtype), torch.randn(B, H, N, D, generator=g, dtype=dtype),
            torch.randn(B, H, N, D, generator=g, dtype=dtype))


@pytest.mark.parametrize("call,needle", [
    (lambda q, k, v: dense_attention(q[0], k, v), "must be 4-D"),
    (lambda q, k, v: dense_attention(q, k, v[:, :, :5]), "same shape"),
    (lambda q, k, v: dense_attention(q[:, :3], k, v), "multiple of KV heads"),
    (lambda q, k, v: dense_attention(q.long(), k, v), "floating-point"),
    (lambda q, k, v: dense_attention(q, k, v, q_offset=5), "outside the 40 key slots"),
    (lambda q, k, v: dense_attention(q, k, v, kv_start=[0, 40]), "without keys"),
    (lambda q, k, v: dense_attention(q, k, v, kv_start=[0]), r"shape \[B\]=\[2\]"),
    (lambda q, k, v: dense_attention(q, k, v, kv_start=torch.tensor([0.0, 1.0])), "integers"),
    (lambda q, k, v: dense_attention(q, k, v, backend="cuda"), "unknown backend"),
    (lambda q, k, v: select(q, k, budget=0.1), "kascade.Budget"),
    (lambda q, k, v: select(q, k, rank_factor=0), "rank_factor must be a positive number"),
    (lambda q, k, v: sparse_attention(q, k, v, "rows"), "kascade.ops.Selection"),
    (lambda q, k, v: dense_attention(q, k.half(), v.half()), "one dtype"),
    (lambda q, k, v: dense_attention(q, k, v.double()), "one dtype"),
    (lambda q, k, v: select(q, k.double()), "one dtype"),
    (lambda q, k, v: dense_attention(q, k, v, scale=float("nan")), "finite real number"),
    (lambda q, k, v: select(q, k, scale=float("inf")), "finite real number"),
    (lambda q, k, v: dense_attention(q, k, v, scale="0.25"), "finite real number"),
    (lambda q, k, v: dense_attention(q, k[:, :, :0], v[:, :, :0]), "no keys"),
    (lambda q, k, v: dense_attention(q[:, :0], k, v), r"no query heads \(HQ == 0\)"),  # was a ZeroDivisionError
    (lambda q, k, v: select(q[:, :0], k), r"no query heads \(HQ == 0\)"),
    (lambda q, k, v: dense_attention(q[..., :0], k[..., :0], v[..., :0]), "empty head dim"),
    (lambda q, k, v: dense_attention(q[:, :, :1], k, v, q_offset=2.0), "must be an integer"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_are_refused(call, needle):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=needle):
        call(q, k, v)


def test_numpy_and_tensor_scalars_are_taken_like_python_numbers():
    np = pytest.importorskip("numpy")
    q, k, v = _qkv()
    want = dense_attention(q[:, :, :1], k, v, q_offset=3, scale=0.3)
    assert torch.equal(dense_attention(q[:, :, :1], k, v, q_offset=np.int64(3), scale=np.float32(0.3)), want)
    assert torch.equal(dense_attention(q[:, :, :1], k, v, q_offset=3, scale=torch.tensor(0.3)), want)


def test_a_step_refuses_k_or_v_of_another_dtype():
    q, k, v = _qkv()
    step = plan_step(q, k, budget=BUDGET)
    with pytest.raises(TypeError, match="one dtype"):
        dense_attention(q, k, v.half(), step=step)


def test_one_step_serves_every_layer_and_is_checked_against_each_call():
    q, k, v = _qkv(L=40, N=40)
    step = plan_step(q, k, budget=BUDGET, kv_start=[0, 7])
    out, sel = dense_select(q, k, v, step=step)
    assert torch.equal(out, dense_attention(q, k, v, kv_start=[0, 7]))
    assert torch.equal(sel.indices, select(q, k, budget=BUDGET, kv_start=[0, 7]).indices)
    assert torch.equal(sparse_attention(q, k, v, sel, step=step), sparse_attention(q, k, v, sel, kv_start=[0, 7]))
    with pytest.raises(ValueError, match="come from the step"):
        dense_attention(q, k, v, step=step, kv_start=[0, 7])
    with pytest.raises(ValueError, match="do not match the step"):
        dense_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], step=step)
    with pytest.raises(ValueError, match="was planned for"):
        dense_attention(q.double(), k.double(), v.double(), step=step)
    with pytest.raises(TypeError, match="plan_step"):
        dense_attention(q, k, v, step={"kv_start": [0, 7]})


def test_selections_that_do_not_fit_the_call_are_refused():
    q, k, v = _qkv(L=40, N=40)
    sel = select(q, k, budget=BUDGET)
    assert (sel.indices >= 0).sum() > 0
    # made for another chunk: the last 24 queries of the same 40 keys span other tiles
    q2 = q[:, :, 16:]
    with pytest.raises(ValueError, match="rows start at tiles|rows; this call"):
        sparse_attention(q2, k, v, sel)
    assert sel.indices.shape[-1] == 12 and bool((sel.indices[:, :, 3] >= 0).all())
    bad = sel.indices.clone()
    bad[0, 0, 3, -1] = 30  # tile 3 starts at position 24: key 30 is in its own tile (the future of some queries)
    with pytest.raises(ValueError, match="not a key that row may attend"):
        sparse_attention(q, k, v, Selection(bad, sel.row_start, 8, False))
    dup = sel.indices.clone()
    dup[0, 0, 4, :2] = dup[0, 0, 4, 0]
    with pytest.raises(ValueError, match="same key twice"):
        sparse_attention(q, k, v, Selection(dup, sel.row_start, 8, False))
    gap = sel.indices.clone()
    gap[0, 0, 4, :3] = torch.tensor([-1, 2, 5])  # -1 before keys: the Triton kernel would read past it
    with pytest.raises(ValueError, match="-1 padding only at the end"):
        sparse_attention(q, k, v, Selection(gap, sel.row_start, 8, False))
    with pytest.raises(ValueError, match="cannot serve"):
        sparse_attention(q[:, :, -1:], k, v, sel)  # a prefill selection for a decode step
    with pytest.raises(ValueError, match=r"\[B=2, H=2"):
        sparse_attention(q, k, v, Selection(sel.indices[:, :1], sel.row_start, 8, False))
    with pytest.raises(TypeError, match="int32 or int64"):
        sparse_attention(q, k, v, Selection(sel.indices.float(), sel.row_start, 8, False))


def test_a_head_map_reads_the_selection_through_it_and_bad_ones_are_refused():
    """sparse_attention(heads=map): KV head h attends the selection's head map[h] (as take_heads gives it), for
    prefill and decode, whatever the selection's head count; a map of the wrong type, shape or values is refused."""
    q, k, v = _qkv(L=40, N=40)
    sel = select(q, k, budget=BUDGET)
    hm = torch.tensor([1, 1])
    got = sparse_attention(q, k, v, sel, heads=hm)
    assert torch.equal(got, sparse_attention(q, k, v, sel.take_heads(hm)))
    assert not torch.equal(got, sparse_attention(q, k, v, sel)), "the map changed nothing"
    wide = Selection(torch.cat([sel.indices, sel.indices.flip(1)], 1), sel.row_start, 8, False)  # 4 heads
    assert torch.equal(sparse_attention(q, k, v, wide, heads=torch.tensor([3, 0])),
                       sparse_attention(q, k, v, sel.take_heads(torch.tensor([0, 0]))))
    qd = q[:, :, -1:]
    sd = select(qd, k, budget=BUDGET)
    assert torch.equal(sparse_attention(qd, k, v, sd, heads=hm), sparse_attention(qd, k, v, sd.take_heads(hm)))
    for bad, needle in ((torch.tensor([1, 1], dtype=torch.int32), "int64 tensor of shape"),
                        (torch.tensor([0, 1, 1]), r"shape \[H\]=\[2\]"), ([0, 1], "int64 tensor"),
                        (torch.tensor([0, 2]), "names a head the selection does not have"),
                        (torch.tensor([-1, 0]), "names a head")):
        with pytest.raises(ValueError, match=needle):
            sparse_attention(q, k, v, sel, heads=bad)


def test_a_decode_selection_may_name_every_valid_key_and_no_other():
    q, k, v = _qkv(L=1, N=30)
    sel = select(q, k, budget=BUDGET, kv_start=[0, 10])
    sparse_attention(q, k, v, sel, kv_start=[0, 10])
    bad = sel.indices.clone()
    assert int(bad[1, 0, 0, 0]) >= 10
    bad[1, 0, 0, 0] = 3  # before sequence 1's first valid key
    with pytest.raises(ValueError, match="not a key that row may attend"):
        sparse_attention(q, k, v, Selection(bad, sel.row_start, 8, True), kv_start=[0, 10])


@pytest.mark.parametrize("call", [
    lambda q, k, v: select(q, k, budget=BUDGET, depth=1.5),
    lambda q, k, v: dense_select(q, k, v, budget=BUDGET, depth=1.5),
    lambda q, k, v: __import__("kascade.ops.reference", fromlist=["select"]).select(
        q, k, budget=BUDGET, scale=0.25, kv_start=torch.zeros(2, dtype=torch.long), q_offset=0, depth=1.5),
    lambda q, k, v: __import__("kascade.tensor_parallel", fromlist=["x"]).selection_shape(BUDGET, 40, 1, depth=1.5),
], ids=["select", "dense_select", "reference.select", "selection_shape"])
def test_a_ranked_selection_by_its_former_keyword_is_a_type_error_naming_rank_factor(call):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="'rank_factor', not 'depth'"):
        call(q, k, v)
