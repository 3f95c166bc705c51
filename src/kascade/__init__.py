"""Kascade: training-free sparse attention for long-context inference (arXiv 2512.16391).

Public API::

    import kascade
    model, tok = kascade.load_default_model()
    with kascade.enable(model):          # the shipped calibrated plan for this model, or a uniform default
        out = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=32)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .attention import Attention, Forward
    from .budget import Budget
    from .integration.hf import disable, enable
    from .models import default_model_path, load_model
    from .plan import KascadePlan, ModelFingerprint, default_plan

# The public names, imported when first used: `import kascade` (and the `kascade` command, which must answer Ctrl-C
# from its first moment) does not wait for torch and transformers until something needs them.
_PUBLIC = {"Attention": "attention", "Forward": "attention", "Budget": "budget", "disable": "integration.hf",
           "enable": "integration.hf", "default_model_path": "models", "load_model": "models",
           "KascadePlan": "plan", "ModelFingerprint": "plan", "default_plan": "plan"}


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    elif not name.startswith("__"):
        try:  # a submodule: kascade.ops, kascade.text, ...
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})


__version__ = "0.1.0"


def load_default_model(*, device="cpu", dtype=None):
    """``(model, tokenizer)`` for the embedded default model, SmolLM2-135M-Instruct (GGUF, de-quantised)."""
    import torch

    from .models import load_model

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
