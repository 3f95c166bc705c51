"""Every decoder family of the installed transformers that Kascade serves, and every one it refuses, on tiny random
models. The manual's table (docs/families.md) is rendered from FAMILIES: `python tests/integration/test_families.py`
rewrites it.

Served: with every layer an anchor and a full budget, Kascade's logits equal the dense model's, and greedy
generation gives the dense tokens. Refused: ``kascade.enable`` raises, naming the reason,
before any forward.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import transformers

import kascade
from kascade import KascadePlan, ModelFingerprint

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPTJ = dict(n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=512)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# transformers class prefix -> (config overrides, None if served else the reason it is refused (a substring of the
# error), what the manual's families table says)
FAMILIES = {
    "Llama": ({}, None, ""),
    "Mistral": (dict(sliding_window=None), None, "without a sliding window (`config.sliding_window = None`)"),
    "Mixtral": (dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2), None, ""),
    "Qwen2": ({}, None, ""),
    "Qwen2Moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32), None, ""),
    "Qwen3": ({}, None, ""),
    "Qwen3Moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), None, ""),
    "Phi": ({}, None, ""),
    "Phi3": ({}, None, ""),
    "GPTNeoX": ({}, None, ""),
    "GPTJ": (GPTJ, None, ""),
    "CodeGen": (dict(GPTJ, n_ctx=512), None, ""),
    "Olmo": ({}, None, ""),
    "Olmo2": ({}, None, ""),
    "Olmoe": (dict(num_experts=4, num_experts_per_tok=2), None, ""),
    "Granite": ({}, None, ""),
    "Gemma": ({}, None, ""),
    "Cohere": ({}, None, ""),
    "StableLm": ({}, None, ""),
    "Starcoder2": ({}, None, ""),
    "Glm": ({}, None, ""),
    "Glm4": ({}, None, ""),
    "SmolLM3": ({}, None, ""),
    "Helium": (dict(head_dim=16), None, ""),
    "Persimmon": ({}, None, ""),
    "Nemotron": ({}, None, ""),
    "Ernie4_5": ({}, None, ""),
    "Arcee": ({}, None, ""),
    "Apertus": ({}, None, ""),
    "Dots1": (dict(MOE, first_k_dense_replace=4), None, ""),
    "DeepseekV2": (dict(MOE, first_k_dense_replace=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16), None, "when values and keys have one head dim"),
    "Falcon": (dict(num_kv_heads=2, new_decoder_architecture=True), None,
               "with rotary positions, from transformers 5.25 (before, its attention was outside the registry)"),
    # refused
    "FalconAlibi": (dict(num_kv_heads=2, new_decoder_architecture=True, alibi=True), "ALiBi",
                    "with ALiBi positions (the bias travels in the attention mask)"),
    "Bloom": ({}, "attention-function registry", "ALiBi, outside transformers' attention registry"),
    "Mpt": ({}, "attention-function registry", "ALiBi, outside transformers' attention registry"),
    "Gemma2": ({}, "full causal attention layers only", "sliding-window layers (and logit soft-capping)"),
    "Cohere2": ({}, "full causal attention layers only", "sliding-window layers"),
    "Olmo3": ({}, "full causal attention layers only", "sliding-window layers"),
    "Exaone4": ({}, "full causal attention layers only", "sliding-window layers"),
    "GptOss": ({}, "full causal attention layers only", "sliding-window layers and attention sinks"),
    "MistralSliding": (dict(sliding_window=4096), "sliding-window attention", "Mistral with its sliding window"),
    "DeepseekV2Mla": (dict(MOE, first_k_dense_replace=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=8), "another head dim",
                      "multi-head latent attention with a value head dim unlike the keys'"),
}
ALIASES = {"MistralSliding": "Mistral", "DeepseekV2Mla": "DeepseekV2", "FalconAlibi": "Falcon"}


def _model(name):
    prefix = ALIASES.get(name, name)
    cfg_cls, model_cls = getattr(transformers, prefix + "Config", None), getattr(transformers, prefix + "ForCausalLM", None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"{prefix} is not in transformers {transformers.__version__}")
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**BASE, **FAMILIES[name][0]})).eval()


@pytest.mark.parametrize("name", [n for n, (_, why, _) in FAMILIES.items() if why is None])
def test_served_family_equals_dense_at_full_budget(name):
    model = _model(name)
    if not type(model)._can_set_attn_implementation():  # Falcon before transformers 5.25
        pytest.skip(f"transformers {transformers.__version__} keeps {name}'s attention outside the registry")
    fp = ModelFingerprint.from_model(model)
    full = KascadePlan.all_anchors(fp, ratio=1.0, k_min=1, tile=8)
    ids = torch.randint(3, 97, (1, 64), generator=torch.Generator().manual_seed(1))  # whole tiles
    with torch.no_grad():
        dense = model(ids).logits
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
        with kascade.enable(model, full, warn_uncalibrated=False):
            got = model(ids).logits
            gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    assert torch.equal(gen, want)


@pytest.mark.parametrize("name", [n for n, (_, why, _) in FAMILIES.items() if why is not None])
def test_refused_family_names_the_reason(name):
    model = _model(name)
    with pytest.raises(ValueError, match=re.escape(FAMILIES[name][1])):
        kascade.enable(model, KascadePlan.uniform(ModelFingerprint.from_model(model), 2), warn_uncalibrated=False)
    assert model.config.get_text_config()._attn_implementation != "kascade"


def render() -> str:
    """The manual's table of families."""
    served = sorted((ALIASES.get(n, n), note) for n, (_, why, note) in FAMILIES.items() if why is None)
    refused = sorted((ALIASES.get(n, n), note) for n, (_, why, note) in FAMILIES.items() if why is not None)
    lines = ["| family (transformers) | Kascade |", "|---|---|"]
    lines += [f"| {n} | served{' ' + note if note else ''} |" for n, note in served]
    lines += [f"| {n} | refused: {note} |" for n, note in refused]
    return "\n".join(lines)


PAGE = Path(__file__).parents[2] / "docs" / "families.md"
MARK = re.compile(r"(<!-- families: generated by tests/integration/test_families.py -->\n)(.*?)(\n<!-- /families -->)",
                  re.S)


def test_the_manuals_table_is_rendered_from_the_tests():
    m = MARK.search(PAGE.read_text())
    assert m, "docs/families.md has no families table between the markers"
    assert m.group(2) == render(), "the families table is stale: run python tests/integration/test_families.py"


if __name__ == "__main__":
    text = PAGE.read_text()
    if not MARK.search(text):
        sys.exit("docs/families.md has no families markers")
    PAGE.write_text(MARK.sub(lambda m: m.group(1) + render() + m.group(3), text))
    print(render())
