"""kascade.enable(backend="triton") on a tiny model, on the test device: the kernels run by the Triton interpreter
on the CPU, or compiled on CUDA with KASCADE_TEST_DEVICE=cuda (tests/conftest.py; prompts then grow with the size
scale). Model and inputs reach the device through kernel_checks.dev."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import kascade  # noqa: E402
from conftest import tiny_model  # noqa: E402
from kascade import KascadePlan, ModelFingerprint  # noqa: E402
from kascade.ops.step import launch_bound  # noqa: E402
from kernel_checks import dev, sized  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Kascade is using an uncalibrated plan")


def _ids(B, P, seed):
    """Random prompts ``[B, P]`` on the test device."""
    return dev(torch.randint(3, 97, (B, P), generator=torch.Generator().manual_seed(seed)))


def _model_and_plan():
    model = dev(tiny_model("llama", num_key_value_heads=3, num_attention_heads=6, head_dim=16))
    fp = ModelFingerprint.from_model(model)
    # layer 2 follows anchor 1 through a non-identity head map; layer 3 is an anchor
    # k_min 40 > tile 16: prefill tiles after the first select min(s, 24) earlier keys (with k_min = tile they would
    # select none and the reuse layers would attend their own tiles only)
    plan = KascadePlan(fp, (0, 1, 3), ((0, 1, 2), (0, 1, 2), (2, 0, 1), (0, 1, 2)), ratio=0.1, k_min=40, tile=16)
    return model, plan


def _kernel_calls(monkeypatch):
    """Names of the Triton launchers called, in order."""
    from kascade.ops.triton import decode, prefill

    calls = []
    for mod, names in ((decode, ("dense_select_decode_indices", "select_decode_indices", "sparse_decode")),
                       (prefill, ("dense_select_prefill", "select_prefill", "sparse_prefill"))):
        for name in names:
            orig = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **kw: (calls.append(_n), _o(*a, **kw))[1])
    return calls


def test_triton_backend_matches_reference_in_prefill_and_decode(monkeypatch, forwards):
    model, plan = _model_and_plan()
    ids = _ids(2, sized(75), 1)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding in the second sequence
    with torch.no_grad():
        with kascade.enable(model, plan, backend="reference"):
            ref = model(ids, attention_mask=mask).logits
            ref_gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        calls = _kernel_calls(monkeypatch)
        forwards.clear()
        with kascade.enable(model, plan, backend="triton") as h:
            assert h.runtime.backend == "triton"
            got = model(ids, attention_mask=mask).logits
            # layer 0's dense_select_prefill calls select_prefill itself: 1 + 2 anchors
            assert calls.count("dense_select_prefill") == 1 and calls.count("select_prefill") == 3
            assert calls.count("sparse_prefill") == 3
            calls.clear()
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    real = mask.bool()
    # fp32 model: kernels and reference agree to fp32 rounding at the real positions
    torch.testing.assert_close(got[real], ref[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(gen, ref_gen)
    # the prefill of generate and 2 decode steps: one step plan each (plan / run split), with the decode metadata
    steps = [fwd.step for fwd in forwards[1:]]
    assert [s.decode for s in steps] == [False, True, True] and all(s.meta is not None for s in steps[1:])
    assert all(s.backend == "triton" and s.index_dtype == torch.int32 for s in steps)
    # generate's dynamic cache grows a key a step; the steps keep one launch bound (their launches and plans alike)
    assert steps[1].meta.n == steps[2].meta.n == (launch_bound(ids.shape[1] + 2),) * 2
    # and the anchors' selections of those passes are made in it (decode included: the radix select writes int32)
    kept = [sel for fwd in forwards[1:] for sel in fwd.selections.values()]
    assert len(kept) >= 3 and all(sel.indices.dtype == torch.int32 for sel in kept)
    assert calls.count("dense_select_decode_indices") == 2 and calls.count("select_decode_indices") == 4
    assert calls.count("sparse_decode") == 6


def test_triton_backend_refuses_what_it_cannot_run():
    model, plan = _model_and_plan()
    with pytest.raises(ValueError, match="cannot use backend='triton'.*float64"):
        kascade.enable(model.to(torch.float64), plan, backend="triton")
    odd = dev(tiny_model("llama", head_dim=12))
    with pytest.raises(ValueError, match="head dims"):
        kascade.enable(odd, backend="triton")


def test_static_cache_decode_steps_stay_on_the_device(forwards):
    """With a static cache the Triton decode step is planned from device tensors (the CUDA-graph path) and
    generates what the reference generates with a dynamic cache."""
    from kascade.integration.graphs import GraphDecoder

    model, plan = _model_and_plan()
    P = sized(70)
    ids = _ids(2, P, 2)
    with torch.no_grad(), kascade.enable(model, plan, backend="reference"):
        ref = model.generate(ids, max_new_tokens=4, do_sample=False)[:, P:]
    forwards.clear()
    with kascade.enable(model, plan, backend="triton"):
        dec = GraphDecoder(model, batch_size=2, max_cache_len=P + 10, use_graph=False)
        got = dec.generate(ids, max_new_tokens=4)
    assert torch.equal(got, ref)
    # the prefill, then 3 decode steps planned on the device only (no host geometry: graph-capturable)
    assert [fwd.step.on_device for fwd in forwards] == [False, True, True, True]
    # launch bounds: the capacity, rounded up (kascade.ops.step.launch_bound)
    assert all(fwd.step.meta.n == (launch_bound(P + 10),) * 2 for fwd in forwards[1:])


def _static_cache_logits(model, ids, feed, capacity, mask=None):
    """Last-position logits ``[B, 1 + steps, V]`` of a static-cache prefill of ``ids`` and one decode step per column
    of ``feed`` (the same tokens for every backend, so that their logits compare step by step)."""
    from transformers import StaticCache

    from kascade.models import cache_kwargs

    cache = cache_kwargs(model, StaticCache(config=model.config, max_cache_len=capacity))
    out = [model(input_ids=ids, attention_mask=mask, use_cache=True, **cache).logits[:, -1]]
    for t in range(feed.shape[1]):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out.append(model(input_ids=feed[:, t : t + 1], attention_mask=mask, use_cache=True, **cache).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("length_aware", [False, True])
def test_static_cache_decode_logits_match_the_reference_step_by_step(length_aware):
    """Every decode step over a static cache (the Triton step planned on the device; a length-aware plan reads its
    geometry back to pick its sub-plan) gives the reference's logits, not just its greedy tokens: a step attending
    one key short, or a length-aware plan losing its host geometry, changed 4 greedy tokens of a random model in no
    test."""
    model, plan = _model_and_plan()
    if length_aware:  # prompts up to sized(60) + 6 keys take the short sub-plan: the (0, 2) anchors
        fp = ModelFingerprint.from_model(model)
        short = KascadePlan(fp, (0, 2), ((0, 1, 2), (1, 2, 0), (0, 1, 2), (2, 2, 1)), ratio=0.1, k_min=40, tile=16)
        plan = dataclasses.replace(plan, by_length=((sized(60) + 6, short),))
    P = sized(60)
    ids = _ids(2, P, 7)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    feed = _ids(2, 5, 8)
    with torch.no_grad():
        with kascade.enable(model, plan, backend="reference"):
            ref = _static_cache_logits(model, ids, feed, P + 8, mask)
        with kascade.enable(model, plan, backend="triton") as h:
            assert h.runtime.host_geometry == length_aware
            got = _static_cache_logits(model, ids, feed, P + 8, mask)
        if length_aware:  # the short sub-plan really served: the long plan alone gives other logits
            with kascade.enable(model, dataclasses.replace(plan, by_length=()), backend="reference"):
                long_only = _static_cache_logits(model, ids, feed, P + 8, mask)
            assert not torch.allclose(long_only[:, 1:], ref[:, 1:], atol=1e-3)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_dense_runtime_is_the_dense_model():
    """The graph-mode dense baseline computes what the model computes with its own attention."""
    from kascade.integration.graphs import GraphDecoder, enable_dense

    model, _ = _model_and_plan()
    P = sized(40)
    ids = _ids(1, P, 3)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref = model.generate(ids, max_new_tokens=3, do_sample=False)[:, P:]
        with enable_dense(model):
            logits = model(ids).logits
            got = GraphDecoder(model, batch_size=1, max_cache_len=P + 8, use_graph=False).generate(ids, 3)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(got, ref)


def test_per_layer_budget_plan_runs_on_the_kernels_like_the_reference(monkeypatch):
    """A plan with per-layer budgets (ranked reuse) on the Triton path: anchors keep ranked selections, layers take
    prefixes of them; prefill, dynamic-cache decode and static-cache decode match the reference."""
    from kascade.integration.graphs import GraphDecoder

    model = dev(tiny_model("llama", num_key_value_heads=3, num_attention_heads=6, head_dim=16, num_hidden_layers=5))
    fp = ModelFingerprint.from_model(model)
    I = (0, 1, 2)
    # k_min 40 > tile: prefill rows keep min(s, 24) selected keys before scaling (with k_min = tile they keep none)
    plan = KascadePlan(fp, (0, 1, 3), (I, I, (2, 0, 1), I, (1, 1, 0)), ratio=0.1, k_min=40, tile=16)
    plan = plan.with_reuse(factor=(1.0, 1.0, 1.6, 1.0, 0.5))
    assert plan.ranked and plan.rank_factor(1) == 1.6
    P = sized(90)
    ids = _ids(2, P, 4)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    with torch.no_grad():
        with kascade.enable(model, plan, backend="reference"):
            ref = model(ids, attention_mask=mask).logits
            ref_gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        rank_factors = []
        from kascade.ops.triton import prefill

        orig = prefill.select_prefill
        monkeypatch.setattr(prefill, "select_prefill", lambda *a, **kw: (rank_factors.append(kw.get("rank_factor")),
                                                                          orig(*a, **kw))[1])
        with kascade.enable(model, plan, backend="triton") as h:
            assert not h.runtime.host_geometry  # static-cache decode steps stay on the device
            got = model(ids, attention_mask=mask).logits
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
            static = GraphDecoder(model, batch_size=2, max_cache_len=P + 6, use_graph=False).generate(
                ids[1:].expand(2, -1), 3)
        with kascade.enable(model, plan, backend="reference"):
            ref_static = model.generate(ids[1:].expand(2, -1), max_new_tokens=3, do_sample=False)[:, P:]
        # with account=True the prefix views are counted: the same keys as the reference attends
        counted = {}
        for backend in ("reference", "triton"):
            with kascade.enable(model, plan, backend=backend, account=True) as h:
                out = model(ids, attention_mask=mask).logits
            counted[backend] = dict(h.runtime.attended)
        torch.testing.assert_close(out[real := mask.bool()], ref[real], rtol=1e-4, atol=1e-4)
        assert counted["triton"] == counted["reference"] and counted["triton"][4][0] < counted["triton"][3][0] < counted["triton"][2][0]
    # rank factor per anchor: layer 0 serves no reuse layer, anchor 1 serves layer 2 (x1.6), anchor 3 layer 4 (x0.5)
    assert rank_factors[:3] == [1.0, 1.6, 1.0]
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(gen, ref_gen) and torch.equal(static, ref_static)


@pytest.mark.skipif(dev(torch.zeros(())).device.type != "cuda", reason="CUDA graphs: KASCADE_TEST_DEVICE=cuda only")
def test_captured_graph_is_not_replayed_after_kascade_is_disabled():
    """Issue 18, item 14 on the GPU: a decoder that captured a real CUDA graph under ``kascade.enable`` and is used
    after the block ends re-captures (with a warning) instead of replaying kernels over the released Kascade
    buffers; its tokens then equal those of a new decoder on the model's own attention, and the CUDA context stays
    usable."""
    from kascade.integration.graphs import GraphDecoder

    model, plan = _model_and_plan()
    P = sized(60)
    ids = _ids(1, P, 5)
    with torch.no_grad():
        with kascade.enable(model, plan, backend="triton"):
            dec = GraphDecoder(model, batch_size=1, max_cache_len=P + 12, use_graph=True)
            dec.generate(ids, 4)
            assert dec.graph is not None  # a real graph was captured under Kascade
        with pytest.warns(UserWarning, match="capturing a new graph"):
            after = dec.generate(ids, 4)
        dense = GraphDecoder(model, batch_size=1, max_cache_len=P + 12, use_graph=True).generate(ids, 4)
        torch.cuda.synchronize()  # a device-side assert would surface here
    assert torch.equal(after, dense)
