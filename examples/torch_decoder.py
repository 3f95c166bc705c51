"""A Llama-style decoder in plain PyTorch whose attention is Kascade's, through the functional API.

    python examples/torch_decoder.py [--tokens 2048] [--new 16]

It copies the weights of the embedded default model (SmolLM2-135M-Instruct, a Llama) into ~60 lines of model code,
then prefills a long prompt and decodes greedily with its own KV cache. Every layer's attention is one call:

    attn = kascade.Attention(plan)                     # once
    fwd = kascade.Forward(q_offset=cache_len)          # per forward pass (prefill or decode step)
    out = attn(layer, q, k, v, fwd)                    # per layer: q [B, HQ, L, D], k, v [B, H, N, D]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kascade


class Decoder:
    """Llama's forward pass (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) on a transformers Llama's weights."""

    def __init__(self, hf_model, plan: kascade.KascadePlan, backend: str = "auto"):
        cfg = hf_model.config
        self.w = {k: v.detach() for k, v in hf_model.state_dict().items()}
        self.layers, self.eps = cfg.num_hidden_layers, cfg.rms_norm_eps
        self.hq, self.h = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d)
        self.attn = kascade.Attention(plan, backend)

    def _norm(self, x, name):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.w[name]

    def _rope(self, x, pos):
        ang = pos[:, None].float() * self.inv_freq[None, :]  # [L, D/2]
        cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: list) -> torch.Tensor:
        """Logits ``[B, L, V]`` of ``ids [B, L]`` after the ``cache`` (per layer ``[k, v]``, extended in place)."""
        B, L = ids.shape
        past = cache[0][0].shape[2] if cache else 0
        pos = torch.arange(past, past + L)
        fwd = kascade.Forward(q_offset=past)  # the new queries sit after the cached keys
        x = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(B, L, self.hq, self.d).transpose(1, 2)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).view(B, L, self.h, self.d).transpose(1, 2)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).view(B, L, self.h, self.d).transpose(1, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            if len(cache) == i:
                cache.append([k, v])
            else:
                cache[i] = [torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)]
            o = self.attn(i, q, cache[i][0], cache[i][1], fwd)  # Kascade: [B, HQ, L, D]
            x = x + o.transpose(1, 2).reshape(B, L, -1) @ self.w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate = F.silu(h @ self.w[p + "mlp.gate_proj.weight"].T) * (h @ self.w[p + "mlp.up_proj.weight"].T)
            x = x + gate @ self.w[p + "mlp.down_proj.weight"].T
        x = self._norm(x, "model.norm.weight")
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return x @ head.T

    def generate(self, ids: torch.Tensor, new: int) -> torch.Tensor:
        """Greedy tokens ``[B, new]`` after the prompt ``ids [B, L]``."""
        cache, out = [], []
        logits = self.forward(ids, cache)
        for _ in range(new):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            logits = self.forward(nxt, cache)
        return torch.cat(out, 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--new", type=int, default=16, help="tokens to generate (default 16)")
    args = p.parse_args(argv)
    model, tok = kascade.load_default_model()
    from kascade import text

    prompt = text.windows(tok, "eval", args.tokens, 1)[0][None]
    dec = Decoder(model, kascade.default_plan(model))
    got = dec.generate(prompt, args.new)
    print(f"Kascade ({len(dec.attn.plan.anchors)} anchors of {dec.layers} layers): "
          + repr(tok.decode(got[0], skip_special_tokens=True)))


if __name__ == "__main__":
    main()
