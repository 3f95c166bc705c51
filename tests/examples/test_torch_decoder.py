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
