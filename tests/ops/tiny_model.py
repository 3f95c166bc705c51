"""The tiny random Llama the ops tests run a model with (4 layers, 6 query heads over 2 KV heads)."""

import pytest
import torch


def tiny_llama(head_dim: int = 8):
    """A seeded random 4-layer Llama in eval mode; ``head_dim=16`` (or more) for one the Triton kernels serve."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()
