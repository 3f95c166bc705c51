"""Kascade: training-free sparse attention for long-context inference (arXiv 2512.16391).

Public API::

    import kascade
    model, tok = kascade.load_default_model()
    with kascade.enable(model):          # the shipped calibrated plan for this model, or a uniform default
        out = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=32)
"""

from .attention import Attention, Forward
from .budget import Budget
from .integration.hf import disable, enable
from .models import default_model_path, load_model
from .plan import KascadePlan, ModelFingerprint, default_plan

__version__ = "0.1.0"


def load_default_model(*, device="cpu", dtype=None):
    """``(model, tokenizer)`` for the embedded default model, SmolLM2-135M-Instruct (GGUF, de-quantised)."""
    import torch

    return load_model(None, device=device, dtype=dtype or torch.float32)


__all__ = [
    "Attention",
    "Budget",
    "Forward",
    "KascadePlan",
    "ModelFingerprint",
    "default_model_path",
    "default_plan",
    "disable",
    "enable",
    "load_default_model",
    "load_model",
]
