"""Kascade in a plain-JAX decoder: a minimal Llama-style model (RMSNorm, RoPE, GQA, SwiGLU; random weights) whose
attention runs the Kascade JAX ops (:mod:`kascade.jax`) layer by layer, with a plan's anchors and head map.

    python examples/jax_decoder.py [--layers 4] [--ratio 0.25] [--steps 8] [--dense]

A left-padded batch of two random prompts is prefilled into a static KV cache (``[B, H, capacity, D]`` per layer,
``kv_start`` marks each sequence's first slot), then decoded greedily, one token per step. Attention is one
:class:`kascade.jax.Attention` for the model and one :class:`kascade.jax.Forward` per forward pass; per layer it does
what the plan says (:mod:`kascade.reuse`, the paper's rule):

- layer 0 is dense and, being an anchor, also selects the top-k keys of every KV head;
- every other anchor selects its own keys and attends to them;
- a reuse layer attends to the keys of its anchor (the nearest at or below it), KV head ``h`` taking the anchor's
  head ``head_map[layer][h]``.

The plan here is made up (anchors every other layer, reversed head maps): a real one comes from calibrating the
model (``kascade calibrate``); the decoder only reads ``anchors``, ``head_map`` and the budget.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import kascade.jax as kj
from kascade.plan import KascadePlan, ModelFingerprint


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    dim: int = 128
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 256


def init_params(cfg: Config, seed: int = 0) -> dict:
    """Random weights, scaled by fan-in so that attention is not flat."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * shape[0] ** -0.5)

    HQ, H, D = cfg.q_heads, cfg.kv_heads, cfg.head_dim
    layers = [dict(attn_norm=jnp.ones(cfg.dim), wq=w(cfg.dim, HQ * D), wk=w(cfg.dim, H * D), wv=w(cfg.dim, H * D),
                   wo=w(HQ * D, cfg.dim), mlp_norm=jnp.ones(cfg.dim), w_gate=w(cfg.dim, cfg.hidden),
                   w_up=w(cfg.dim, cfg.hidden), w_down=w(cfg.hidden, cfg.dim))
              for _ in range(cfg.layers)]
    embed = jnp.asarray(rng.standard_normal((cfg.vocab, cfg.dim), np.float32))
    return dict(embed=embed, layers=layers, norm=jnp.ones(cfg.dim), lm_head=w(cfg.dim, cfg.vocab))


def make_plan(cfg: Config, *, ratio: float, k_min: int, tile: int) -> KascadePlan:
    """Anchors at every other layer; reuse layers follow their anchor's heads in reverse order."""
    fp = ModelFingerprint("llama", cfg.layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim)
    anchors = tuple(range(0, cfg.layers, 2))
    ident, rev = tuple(range(cfg.kv_heads)), tuple(reversed(range(cfg.kv_heads)))
    head_map = tuple(ident if layer in anchors else rev for layer in range(cfg.layers))
    return KascadePlan(fp, anchors, head_map, ratio=ratio, k_min=k_min, tile=tile, source="example")


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------
def rms_norm(x, w, eps: float = 1e-5):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta: float = 10000.0):
    """Rotary embedding of ``x [B, heads, L, D]`` at positions ``pos [B, L]`` (Llama's rotate-half layout)."""
    D = x.shape[-1]
    inv = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    ang = pos[:, None, :, None].astype(jnp.float32) * inv  # [B, 1, L, D/2]
    cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


@jax.jit
def _embed(table, tokens, kv_start, q_offset):
    """Token embeddings and RoPE positions, counted from each sequence's first token: ``([B, L, dim], [B, L])``."""
    return table[tokens], q_offset + jnp.arange(tokens.shape[1])[None, :] - kv_start[:, None]


@jax.jit
def _qkv(p, x, pos, cache_k, cache_v, slot):
    """Projections and RoPE of one layer; the new keys and values written into the cache at ``slot``."""
    B, L, _ = x.shape
    D = cache_k.shape[-1]
    h = rms_norm(x, p["attn_norm"])
    q = rope((h @ p["wq"]).reshape(B, L, -1, D).transpose(0, 2, 1, 3), pos)
    k = rope((h @ p["wk"]).reshape(B, L, -1, D).transpose(0, 2, 1, 3), pos)
    v = (h @ p["wv"]).reshape(B, L, -1, D).transpose(0, 2, 1, 3)
    at = (0, 0, slot, 0)
    return q, jax.lax.dynamic_update_slice(cache_k, k, at), jax.lax.dynamic_update_slice(cache_v, v, at)


@jax.jit
def _out_mlp(p, x, o):
    """Output projection and the SwiGLU MLP, each on the residual stream."""
    B, HQ, L, D = o.shape
    x = x + o.transpose(0, 2, 1, 3).reshape(B, L, HQ * D) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


@jax.jit
def _logits(params, x):
    return rms_norm(x, params["norm"]) @ params["lm_head"]


def forward(params, tokens, cache, *, kv_start, q_offset: int, attn: kj.Attention | None):
    """``tokens [B, L]`` at cache slots ``q_offset ..``: ``(logits [B, L, vocab], cache)``; ``attn`` None: dense.

    The layers' dense parts are jitted with ``q_offset`` as a value (one program for prefill, one for decode); the
    attention ops, whose ``q_offset`` is static, are called eagerly (each runs as one compiled program per shape
    and budget). A jit of the whole forward works too, but compiles anew at every decode step."""
    x, pos = _embed(params["embed"], tokens, kv_start, q_offset)
    fwd = kj.Forward(kv_start=kv_start, q_offset=q_offset)  # this pass: anchors' selections live here, layer to layer
    new_cache = []
    for layer, p in enumerate(params["layers"]):
        q, ck, cv = _qkv(p, x, pos, *cache[layer], q_offset)
        new_cache.append((ck, cv))
        if attn is None:
            o = kj.dense_attention(q, ck, cv, kv_start=kv_start, q_offset=q_offset)
        else:
            o = attn(layer, q, ck, cv, fwd)
        x = _out_mlp(p, x, o)
    return _logits(params, x), new_cache


def generate(params, cfg: Config, prompts: list[list[int]], steps: int, plan: KascadePlan | None) -> dict:
    """Greedy decoding of left-padded ``prompts``. Returns the new tokens ``[B, steps]``, the logits of every real
    position (prefill ``[B, P, vocab]``, zeros at padding; decode ``[B, steps, vocab]``), as NumPy arrays."""
    attn = None if plan is None else kj.Attention(plan)  # once per model
    B, P = len(prompts), max(map(len, prompts))
    starts = np.array([P - len(p) for p in prompts], np.int32)
    kv_start = jnp.asarray(starts)
    tokens = jnp.asarray([[0] * (P - len(p)) + list(p) for p in prompts], jnp.int32)
    shape = (B, cfg.kv_heads, P + steps, cfg.head_dim)
    cache = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.layers)]
    logits, cache = forward(params, tokens, cache, kv_start=kv_start, q_offset=0, attn=attn)
    logits = np.asarray(logits)
    real = np.arange(P)[None, :] >= starts[:, None]
    out = dict(prefill_logits=np.where(real[..., None], logits, 0))
    new, step_logits = [], []
    for step in range(steps):
        nxt = logits[:, -1].argmax(-1)
        new.append(nxt)
        logits, cache = forward(params, jnp.asarray(nxt[:, None], jnp.int32), cache, kv_start=kv_start,
                                q_offset=P + step, attn=attn)
        logits = np.asarray(logits)
        step_logits.append(logits[:, 0])
    out["tokens"], out["decode_logits"] = np.stack(new, 1), np.stack(step_logits, 1)
    return out


def main(*, layers: int = 4, dim: int = 128, q_heads: int = 8, kv_heads: int = 2, head_dim: int = 16,
         prompt_lengths=(96, 70), steps: int = 8, ratio: float = 0.25, k_min: int = 8, tile: int = 8,
         dense: bool = False, seed: int = 0, verbose: bool = True) -> dict:
    """Build the model and its plan, run prefill and ``steps`` greedy decode steps; print and return the result
    (:func:`generate`'s, plus the ``plan``: None when ``dense``)."""
    cfg = Config(dim=dim, layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, hidden=2 * dim)
    params = init_params(cfg, seed)
    plan = None if dense else make_plan(cfg, ratio=ratio, k_min=k_min, tile=tile)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, cfg.vocab, n).tolist() for n in prompt_lengths]
    out = generate(params, cfg, prompts, steps, plan)
    out["plan"] = plan
    if verbose:
        what = "dense attention" if plan is None else f"Kascade, anchors {list(plan.anchors)}, {plan.budget}"
        print(f"{cfg.layers} layers, {cfg.q_heads} query / {cfg.kv_heads} KV heads; {what}")
        for b, row in enumerate(out["tokens"].tolist()):
            line = f"sequence {b} (prompt {len(prompts[b])} tokens): {row}"
            if plan is not None:
                n = len(prompts[b]) + steps  # keys of the last decode step
                line += f"  (last step: layers 1.. attend {int(plan.budget.decode(n))} of its {n} keys per KV head)"
            print(line)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.25, help="fraction of the keys kept (Budget.ratio)")
    ap.add_argument("--k-min", type=int, default=8, help="floor on the keys kept (Budget.k_min)")
    ap.add_argument("--tile", type=int, default=8, help="prefill query tile (Budget.tile)")
    ap.add_argument("--dense", action="store_true", help="dense attention in every layer (the baseline)")
    a = ap.parse_args()
    main(layers=a.layers, steps=a.steps, ratio=a.ratio, k_min=a.k_min, tile=a.tile, dense=a.dense)
