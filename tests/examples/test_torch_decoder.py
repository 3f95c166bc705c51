"""examples/torch_decoder.py: a plain-PyTorch decoder on Kascade's functional API computes what the transformers
integration computes with the same plan."""

import importlib.util
from pathlib import Path

import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint

pytestmark = pytest.mark.filterwarnings("ignore:Kascade is using an uncalibrated plan")
_spec = importlib.util.spec_from_file_location("torch_decoder", Path(__file__).parents[2] / "examples" / "torch_decoder.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_the_example_decoder_equals_the_transformers_path():
    model = tiny_model("llama", num_key_value_heads=3, num_attention_heads=6, head_dim=16, hidden_size=96)
    fp = ModelFingerprint.from_model(model)
    plan = KascadePlan(fp, (0, 2), ((0, 1, 2), (2, 0, 1), (0, 1, 2), (1, 1, 0)), ratio=0.1, k_min=16, tile=16)
    ids = torch.randint(3, 97, (2, 150), generator=torch.Generator().manual_seed(0))
    dec = example.Decoder(model, plan, backend="reference")
    got = dec.forward(ids, [])
    with torch.no_grad(), kascade.enable(model, plan, backend="reference"):
        want = model(ids).logits
        want_gen = model.generate(ids, max_new_tokens=5, do_sample=False)[:, 150:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(dec.generate(ids, 5), want_gen)
    with torch.no_grad():
        dense = model(ids).logits
    assert (got - dense).abs().max() > 1e-3  # the plan is sparse: this is not dense attention


def test_a_forward_refuses_layers_out_of_order_and_bad_geometry():
    model = tiny_model("llama")
    attn = kascade.Attention(KascadePlan.uniform(ModelFingerprint.from_model(model), 2, k_min=8, tile=8),
                             backend="reference")
    q, k = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8)
    with pytest.raises(RuntimeError, match="ran before layer 0"):
        attn(1, q, k, k, kascade.Forward())
    with pytest.raises(ValueError, match="outside the 10 key slots"):
        attn(0, q, k, k, kascade.Forward(q_offset=5))
    with pytest.raises(ValueError, match="unknown backend"):
        kascade.Attention(attn.plan, backend="cuda")
    out = attn(0, q, k, k, kascade.Forward())
    assert out.shape == q.shape


def test_the_layer_index_and_layer_0s_shapes_are_checked_against_the_plan():
    """The functional API checks what the transformers integration checks when it is enabled: tensors of another
    head count or head dim were accepted (and, with an identity head map, computed), bad layer indices failed inside
    the runtime with misleading errors."""
    model = tiny_model("llama")  # 6 query / 2 KV heads of dim 8, 4 layers
    attn = kascade.Attention(KascadePlan.uniform(ModelFingerprint.from_model(model), 2, k_min=8, tile=8),
                             backend="reference")
    q, k = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8)
    for bad_q, bad_k in ((torch.randn(1, 12, 10, 8), torch.randn(1, 4, 10, 8)),   # another head count
                         (torch.randn(1, 6, 10, 16), torch.randn(1, 2, 10, 16)),  # another head dim
                         (torch.randn(1, 4, 10, 8), k)):                          # another group size
        with pytest.raises(ValueError, match="the plan was made for 6 query / 2 KV heads of dim 8"):
            attn(0, bad_q, bad_k, bad_k, kascade.Forward())
    attn(0, q, k, k, fwd := kascade.Forward())
    for layer in (4, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match=r"layer must be an integer in 0\.\.3"):
            attn(layer, q, k, k, fwd)
    assert attn(torch.tensor(1).item(), q, k, k, fwd).shape == q.shape
    with pytest.raises(TypeError, match="kascade.Forward"):
        attn(0, q, k, k, None)


def test_an_enabled_model_can_be_deep_copied():
    """copy.deepcopy of an enabled model (its runtime holds a lock) failed with "cannot pickle '_thread.lock'"; the
    copy computes what the original does."""
    import copy

    model = tiny_model("llama")
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), kascade.enable(model, KascadePlan.uniform(ModelFingerprint.from_model(model), 2, k_min=8,
                                                                    tile=8)):
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, model(ids).logits)


def test_one_forward_holds_the_pass_from_its_geometry_to_the_anchors_selections():
    """Layer 0 fills in the pass's Forward (its step plan and the plan serving it); the anchors' selections live on
    it until no later layer reads them; a second pass on the same Forward starts afresh."""
    model = tiny_model("llama")  # 4 layers
    plan = KascadePlan.uniform(ModelFingerprint.from_model(model), 2, k_min=8, tile=8)  # anchors 0, 2
    attn = kascade.Attention(plan, backend="reference")
    q, k = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8)
    fwd = kascade.Forward()
    assert fwd.step is None and fwd.plan is None and fwd.selections == {} and not fwd.begun
    attn(0, q, k, k, fwd)
    assert isinstance(fwd.step, kascade.ops.Step) and fwd.plan is plan and set(fwd.selections) == {0}
    assert fwd.step.queries == 10 and fwd.step.meta is None  # a prefill: no decode metadata
    attn(1, q, k, k, fwd)
    attn(2, q, k, k, fwd)
    assert set(fwd.selections) == {2}  # anchor 0's last reader was layer 1
    step = fwd.step
    attn(0, q, k, k, fwd)
    assert fwd.step is not step and set(fwd.selections) == {0}
    with pytest.raises(TypeError, match="'Forward', not 'ForwardState'"):
        from kascade.attention import ForwardState  # noqa: F401
