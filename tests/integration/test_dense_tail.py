"""Budget.dense_tail: in a pass of more than one query, its last ``dense_tail`` queries attend every key in every
layer (a prompt's question and turn marks); the other queries and every decode step are as without it."""

import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint
from kascade.ops import reference

pytestmark = pytest.mark.filterwarnings("ignore:Kascade is using an uncalibrated plan")


def _plan(fp, **budget):
    return KascadePlan.uniform(fp, 2, **{**dict(ratio=0.1, k_min=8, tile=16), **budget})


def _qkv(B, HQ, H, L, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, L, D, generator=g), torch.randn(B, H, N, D, generator=g),
            torch.randn(B, H, N, D, generator=g))


@pytest.mark.parametrize("tail", [1, 20, 100])
def test_the_tail_queries_attend_densely_and_the_others_as_without_it(tail):
    """Every layer of a prefill chunk after cached keys, left-padded: the last ``tail`` queries' outputs are dense
    attention's, the others' those of the same plan without the tail; a tail longer than the chunk is all of it."""
    B, HQ, H, L, N, D, layers = 2, 6, 3, 70, 200, 16, 5
    fp = ModelFingerprint("llama", layers, HQ, H, D)
    kv_start, q_offset = torch.tensor([0, 37]), N - L
    t = min(tail, L)
    for layer in range(layers):
        q, k, v = _qkv(B, HQ, H, L, N, D, seed=layer)
        outs = {}
        for name, plan in (("plain", _plan(fp)), ("tail", _plan(fp, dense_tail=tail))):
            attn, fwd = kascade.Attention(plan), kascade.Forward(kv_start=kv_start, q_offset=q_offset)
            for i in range(layer + 1):  # the layers before it make the selections it reuses
                out = attn(i, *(_qkv(B, HQ, H, L, N, D, seed=i)), fwd)
            outs[name] = out
        dense = reference.dense_attention(q, k, v, scale=D**-0.5, kv_start=kv_start, q_offset=q_offset)
        torch.testing.assert_close(outs["tail"][:, :, L - t:], dense[:, :, L - t:])
        torch.testing.assert_close(outs["tail"][:, :, :L - t], outs["plain"][:, :, :L - t])
        if layer and t < L:  # the plain plan is sparse there: the tail makes a difference
            assert not torch.allclose(outs["plain"][:, :, L - t:], dense[:, :, L - t:])


def test_a_decode_step_is_unchanged_and_the_tail_is_counted_dense():
    """One query: no tail (the step is the plain plan's). Accounting counts the tail's queries as dense."""
    B, HQ, H, N, D, layers = 1, 4, 2, 300, 16, 4
    fp = ModelFingerprint("llama", layers, HQ, H, D)
    q, k, v = _qkv(B, HQ, H, 1, N, D, seed=3)
    got = {}
    for tail in (0, 32):
        attn, fwd = kascade.Attention(_plan(fp, dense_tail=tail)), kascade.Forward()
        got[tail] = [attn(i, q, k, v, fwd) for i in range(layers)]
        assert fwd.tail is None
    for a, b in zip(got[0], got[32]):
        assert torch.equal(a, b)
    L = 64
    q, k, v = _qkv(B, HQ, H, L, L, D, seed=4)
    counted = {}
    for tail in (0, 16, L):
        attn = kascade.Attention(_plan(fp, dense_tail=tail), account=True)
        fwd = kascade.Forward()
        for i in range(layers):
            attn(i, q, k, v, fwd)
        counted[tail] = attn.attended
    dense = L * (L + 1) // 2 * H
    for layer in range(1, layers):
        assert counted[L][layer] == [dense, dense]  # the whole pass in the tail: every key
        assert counted[0][layer][0] < counted[16][layer][0] < dense and counted[16][layer][1] == dense


def test_a_tail_as_long_as_the_prompt_prefills_densely_through_generate():
    """Through transformers: with the whole prompt in the tail the prefill is dense, so the first generated token's
    logits are dense's; the decode steps after it are the plan's (they differ from dense)."""
    model = tiny_model("llama", num_hidden_layers=4)
    fp = ModelFingerprint.from_model(model)
    ids = torch.randint(3, 97, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits[:, -1]
        with kascade.enable(model, _plan(fp, dense_tail=150), backend="reference"):
            got = model(ids).logits[:, -1]
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
        with kascade.enable(model, _plan(fp), backend="reference"):
            sparse = model(ids).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(sparse, want, rtol=1e-4, atol=1e-4)
    assert out.shape == (1, 154)
