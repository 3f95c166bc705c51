"""kascade.jax.Attention: a JAX model's layers through a plan, against the PyTorch runtime (kascade.Attention) on the
same inputs: the reference backend eagerly and under jit, the Triton backend through DLPack (Triton's interpreter
on the CPU, compiled with KASCADE_TEST_DEVICE=cuda)."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # not "jax": see test_jax_reference.py
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import kascade  # noqa: E402
import kascade.jax as kj  # noqa: E402
from jax_device import ON_GPU, kernel_device  # noqa: E402
from kascade import KascadePlan, ModelFingerprint  # noqa: E402



def _plan(HQ, H, D, layers=5, **budget):
    """Anchors 0, 2; layers 1, 3, 4 reuse, through head maps that are not the identity (where H > 1)."""
    fp = ModelFingerprint("llama", layers, HQ, H, D)
    rev = tuple(reversed(range(H)))
    rot = tuple((h + 1) % H for h in range(H))
    maps = (tuple(range(H)), rev, tuple(range(H)), rot, rev)[:layers]
    return KascadePlan(fp, (0, 2), maps, **budget)


# (B, HQ, H, D, N, L, q_offset, kv_start): prefill with left padding, a chunk into a cache with room after it,
# a decode step into a static cache; G = 3 and 2; N not a multiple of the tiles.
GEOMETRIES = [
    (2, 6, 2, 16, 45, 45, None, [0, 11]),
    (2, 4, 2, 16, 80, 30, 35, [0, 20]),
    (3, 6, 3, 16, 64, 1, 50, [0, 9, 30]),
]


def _layers(geo, seed, dtype=np.float32):
    """Random q, k, v per layer (NumPy), the same for both frameworks."""
    B, HQ, H, D, N, L = geo[:6]
    rng = np.random.default_rng(seed)
    return [tuple(rng.standard_normal(s).astype(dtype) for s in ((B, HQ, L, D), (B, H, N, D), (B, H, N, D)))
            for _ in range(5)]


def _torch_outputs(plan, layers, starts, q_offset, backend, device="cpu"):
    attn = kascade.Attention(plan, backend=backend)
    fwd = kascade.Forward(kv_start=torch.tensor(starts, dtype=torch.long), q_offset=q_offset)
    return [attn(i, *(torch.tensor(x, device=device) for x in qkv), fwd).cpu().numpy()
            for i, qkv in enumerate(layers)]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=["prefill", "chunk", "decode"])
def test_reference_matches_the_torch_runtime_eagerly_and_under_jit(geo):
    B, HQ, H, D, N, L, q_offset, starts = geo
    plan = _plan(HQ, H, D, ratio=0.3, k_min=4, tile=8)
    layers = _layers(geo, seed=N + L)
    want = _torch_outputs(plan, layers, starts, q_offset, "reference")
    attn = kj.Attention(plan)
    fwd = kj.Forward(kv_start=np.array(starts), q_offset=q_offset)
    got = [attn(i, *(jnp.asarray(x) for x in qkv), fwd) for i, qkv in enumerate(layers)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == jnp.float32 and g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-6, err_msg=f"layer {i}")
    # The reuse layers attend fewer keys than dense, so the plan is doing something: layer 1 differs from dense.
    dense = kj.dense_attention(*(jnp.asarray(x) for x in layers[1]), kv_start=np.array(starts), q_offset=q_offset)
    assert np.abs(np.asarray(dense) - np.asarray(got[1])).max() > 1e-3

    # The whole layer loop under jit, kv_start traced: the same outputs.
    @jax.jit
    def run(all_qkv, kv_start):
        f = kj.Forward(kv_start=kv_start, q_offset=q_offset)
        return [attn(i, *qkv, f) for i, qkv in enumerate(all_qkv)]

    jitted = run([tuple(jnp.asarray(x) for x in qkv) for qkv in layers], jnp.asarray(starts, jnp.int32))
    for i, (g, w) in enumerate(zip(jitted, want)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-6, err_msg=f"layer {i} under jit")


@pytest.mark.parametrize("ranked", [False, True], ids=["paper-rule", "per-layer-budgets"])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=["prefill", "chunk", "decode"])
def test_triton_is_the_torch_runtime_through_dlpack(geo, ranked):
    """Same kernels, same plan, same step plan: the outputs equal the torch runtime's bit for bit; every reuse rule
    the torch runtime serves is served (here per-layer budgets)."""
    pytest.importorskip("triton")
    device = kernel_device()
    B, HQ, H, D, N, L, q_offset, starts = geo
    plan = _plan(HQ, H, D, ratio=0.3, k_min=4, tile=16)
    if ranked:
        plan = plan.with_reuse(factor=(1.0, 1.25, 1.0, 0.75, 1.5))
    layers = _layers(geo, seed=N + L + 1)
    tdev = "cuda" if ON_GPU else "cpu"
    want = _torch_outputs(plan, layers, starts, q_offset, "triton", tdev)
    attn = kj.Attention(plan, backend="triton")
    fwd = kj.Forward(kv_start=np.array(starts), q_offset=q_offset)
    got = [attn(i, *(jax.device_put(jnp.asarray(x), device) for x in qkv), fwd) for i, qkv in enumerate(layers)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, jax.Array) and g.devices() == {device}
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"layer {i}")
    if not ranked:  # and they are Kascade's outputs: the reference runtime's within the fp32 tolerance
        ref = _torch_outputs(plan, layers, starts, q_offset, "reference")
        for i, (g, w) in enumerate(zip(got, ref)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5, err_msg=f"layer {i}")


def test_refusals():
    plan = _plan(4, 2, 8, ratio=0.5, k_min=2, tile=4)
    q, k, v = (jnp.asarray(x) for x in _layers((1, 4, 2, 8, 12, 12), 0)[0])
    with pytest.raises(TypeError, match="plan must be a kascade.KascadePlan"):
        kj.Attention("default")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        kj.Attention(plan, backend="cuda")
    with pytest.raises(ValueError, match="serves the paper's reuse rule.*use backend='triton'"):
        kj.Attention(plan.with_reuse(factor=(1.0, 0.5, 1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match="prefills its last 32 queries densely.*use backend='triton'"):
        kj.Attention(plan.with_budget(dense_tail=32))
    attn = kj.Attention(plan)
    with pytest.raises(TypeError, match="fwd must be a kascade.jax.Forward"):
        attn(0, q, k, v, kascade.Forward())
    with pytest.raises(ValueError, match=r"layer must be an integer in 0..4"):
        attn(5, q, k, v, kj.Forward())
    with pytest.raises(RuntimeError, match="layer 1 ran before layer 0"):
        attn(1, q, k, v, kj.Forward())
    with pytest.raises(ValueError, match="made for 4 query / 2 KV heads of dim 8"):
        attn(0, q[:, :2], k[:, :1], v[:, :1], kj.Forward())
    with pytest.raises(ValueError, match="leaves a sequence without keys"):  # the geometry, checked at layer 0
        attn(0, q, k, v, kj.Forward(kv_start=np.array([20])))
    fwd = kj.Forward()
    attn(0, q, k, v, fwd)
    with pytest.raises(ValueError, match="layer 1: .* differ from layer 0's"):
        attn(1, q, k[:, :, :8], v[:, :, :8], fwd)


def test_triton_refuses_a_traced_layer_after_layer_0():
    """Layer 0 checks the arrays; a later layer called under a JAX trace is refused by name, not by DLPack."""
    pytest.importorskip("triton")
    device = kernel_device()
    plan = _plan(4, 2, 16, ratio=0.5, k_min=4, tile=16)
    q, k, v = (jax.device_put(jnp.asarray(x), device) for x in _layers((1, 4, 2, 16, 40, 1, 39, [0]), 3)[0])
    attn, fwd = kj.Attention(plan, backend="triton"), kj.Forward(q_offset=39)
    attn(0, q, k, v, fwd)
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        jax.jit(lambda q: attn(1, q, k, v, fwd))(q)
