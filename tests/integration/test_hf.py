"""kascade.enable on real transformers models: tiny random ones of several families, and the default model."""


import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint

pytestmark = pytest.mark.filterwarnings("ignore:Kascade is using an uncalibrated plan")


def _full_budget_plan(model):
    return KascadePlan.all_anchors(ModelFingerprint.from_model(model), ratio=1.0, k_min=1)


def _ids(n, batch=1, vocab=97, seed=0):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_small_budget_changes_the_output_and_disable_restores_it(forwards, op_calls):
    model = tiny_model("llama")
    ids = _ids(300)
    plan = KascadePlan.uniform(ModelFingerprint.from_model(model), 2, ratio=0.1, k_min=8, tile=16)
    with torch.no_grad():
        dense = model(ids).logits
        kascade.enable(model, plan)
        assert model.config._attn_implementation == "kascade"
        sparse = model(ids).logits
        assert sorted(forwards[-1].selections) == [2]  # layer 0's was dropped after its last reuse layer
        assert [n for n, *_ in op_calls] == ["dense_select", "sparse_attention", "select", "sparse_attention",
                                            "sparse_attention"]
        assert torch.equal(model(ids).logits, sparse)
        kascade.disable(model)
        after = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert not torch.allclose(sparse, dense, atol=1e-3)
    assert torch.equal(after, dense)
    assert not any(hasattr(m, "_kascade_runtime") for m in model.modules())


def test_reuse_layer_follows_head_map(op_calls):
    """A reuse layer's selection is its anchor's, head by head through the head map (handed to the sparse attention
    op with the anchor's selection, unapplied; an identity map is no map)."""
    model = tiny_model("llama", num_key_value_heads=3)
    fp = ModelFingerprint.from_model(model)
    plan = KascadePlan(fp, (0, 2), ((0, 1, 2), (2, 0, 0), (0, 1, 2), (1, 1, 2)), ratio=0.1, k_min=8, tile=16)
    with kascade.enable(model, plan), torch.no_grad():
        model(_ids(200))
    names = [n for n, *_ in op_calls]
    assert names == ["dense_select", "sparse_attention", "select", "sparse_attention", "sparse_attention"]
    sel0, sel2 = op_calls[0][3][1], op_calls[2][3]
    passed = [(args[3], kw.get("heads")) for n, args, kw, _ in op_calls if n == "sparse_attention"]  # layers 1-3
    assert all(sel is want for (sel, _), want in zip(passed, (sel0, sel2, sel2))) and passed[1][1] is None
    seen = [sel if hm is None else sel.take_heads(hm) for sel, hm in passed]
    assert (sel0.indices >= 0).sum() > 0 and not torch.equal(sel0.indices[:, 0], sel0.indices[:, 2])
    assert torch.equal(seen[0].indices, sel0.indices[:, [2, 0, 0]])
    assert seen[1] is sel2
    assert torch.equal(seen[2].indices, sel2.indices[:, [1, 1, 2]])


def test_errors_for_models_kascade_cannot_serve():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        kascade.enable(torch.nn.Linear(2, 2))
    sliding = tiny_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    with pytest.raises(ValueError, match="full causal attention"):
        kascade.enable(sliding)
    mistral = tiny_model("mistral", sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window"):
        kascade.enable(mistral)
    model = tiny_model("llama")
    model.model.layers[1].self_attn.layer_idx = 0  # two layers claim index 0: routing would be ambiguous
    with pytest.raises(ValueError, match="cannot route"):
        kascade.enable(model)
    ok = tiny_model("llama")
    with kascade.enable(ok):
        with pytest.raises(RuntimeError, match="already enabled"):
            kascade.enable(ok)
    with pytest.raises(ValueError, match="unknown backend"):
        kascade.enable(ok, backend="cuda-magic")


def test_right_padding_is_refused():
    model = tiny_model("llama")
    ids = _ids(40, batch=2)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    with kascade.enable(model), torch.no_grad(), pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=mask)


@pytest.mark.model
def test_default_model_full_budget_logits_equal_dense(default_model):
    model, tok = default_model
    ids = _ids(256, batch=2, vocab=tok.vocab_size, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :64] = 0  # the second sequence is 192 tokens, left-padded
    with torch.no_grad():
        dense = model(ids, attention_mask=mask).logits
        with kascade.enable(model, _full_budget_plan(model)):
            sparse = model(ids, attention_mask=mask).logits
        after = model(ids, attention_mask=mask).logits
    # fp32 through 30 layers with a different summation order than SDPA: logits (|x| ~ 20) agree to ~1e-4
    torch.testing.assert_close(sparse[0], dense[0], rtol=1e-4, atol=5e-4)
    torch.testing.assert_close(sparse[1, 64:], dense[1, 64:], rtol=1e-4, atol=5e-4)
    assert torch.equal(after, dense)


@pytest.mark.model
def test_default_model_generate_with_left_padding(default_model):
    model, tok = default_model
    prompts = [
        "Write one sentence about the sea.",
        "In Python, a list comprehension is a compact way to build a list. Explain, in one sentence, what the "
        "expression [x * x for x in range(5)] evaluates to and why.",
    ]
    msgs = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts]
    enc = tok(msgs, return_tensors="pt", padding=True)
    assert enc.attention_mask[0, 0] == 0  # left-padded
    # a small budget whose prefill tiles select keys (k_min 48 > tile 16: min(s, 32) each) and whose decode steps
    # keep 48 of ~90 keys, so the reuse path does real work in both
    plan = kascade.default_plan(model).with_budget(k_min=48, tile=16)
    gen = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with torch.no_grad():
        with kascade.enable(model, plan):
            out = model.generate(**enc, **gen)
            alone = [model.generate(**tok([m], return_tensors="pt"), **gen)[0] for m in msgs]
        dense = model.generate(**enc, **gen)
    L = enc.input_ids.shape[1]
    assert out.shape == (2, L + 20)
    # each padded sequence generates what it generates alone
    for b in range(2):
        assert out[b, L:].tolist() == alone[b][-20:].tolist()
    after = model.generate(**enc, **gen)
    assert torch.equal(after, dense)


def test_every_runtime_is_a_runtime_and_attach_refuses_what_is_not():
    from kascade.calibrate.stats import StatsRecorder
    from kascade.integration.hf import attach
    from kascade.integration.runtime import DenseRuntime, NoAttention, Runtime

    model = tiny_model("llama")
    for rt in (kascade.Attention(_full_budget_plan(model)), DenseRuntime(), NoAttention(), StatsRecorder(4, 2, 8, 8)):
        assert isinstance(rt, Runtime), type(rt).__name__
    with pytest.raises(TypeError, match="runtime must have begin"):
        attach(model, object())
    assert model.config._attn_implementation == "sdpa"
