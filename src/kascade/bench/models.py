"""The models `kascade bench` measures: :data:`MODELS` by name, random Llamas of given shapes built on the device,
and the plan each one runs with."""

from __future__ import annotations

import torch

from ..plan import KascadePlan, ModelFingerprint, default_plan, resolve_plan
from .settings import Settings

MODELS = ("default", "llama8b", "tiny")

# Llama-3.1-8B's shapes (random weights: nothing is downloaded).
LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA8B_ANCHORS = 5
# A tiny random Llama for tests and dry runs of the command.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
TINY_ANCHORS = 2


def random_llama(overrides: dict, *, device: str, dtype: torch.dtype, max_positions: int):
    """A randomly initialised LlamaForCausalLM built directly on ``device`` in ``dtype`` (no fp32 CPU detour: at 8B
    parameters that would take minutes and 32 GB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**overrides, max_position_embeddings=max_positions)
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    if any(p.dtype != dtype for p in model.parameters()):
        raise RuntimeError(f"random_llama: parameters were not built in {dtype}")
    return model.eval()  # no .to(dtype): it would round RoPE's fp32 inv_freq buffer as well


def _fingerprint(overrides: dict) -> ModelFingerprint:
    from transformers import LlamaConfig

    return ModelFingerprint.from_config(LlamaConfig(**overrides))


def plan_for(name: str, model, plan: KascadePlan | str | None) -> KascadePlan:
    """The user's plan (a plan, a plan file or a shipped plan's name; checked against the model), else: the shipped
    plan for ``default``, uniform otherwise."""
    if plan is not None:
        plan = resolve_plan(plan, model)
        plan.check_model(model)
        return plan
    fp = ModelFingerprint.from_model(model)
    if name == "llama8b":
        return KascadePlan.uniform(fp, LLAMA8B_ANCHORS)
    if name == "tiny":
        return KascadePlan.uniform(fp, TINY_ANCHORS)
    return default_plan(model)


def check_plan(names, plan: KascadePlan | str | None, model_path=None) -> None:
    """Fail before any work if ``plan`` cannot serve a model of ``names`` (``default``: its config, read without the
    weights, from ``model_path`` or the embedded default model)."""
    if plan is None:
        return
    for name in names:
        if name == "default":
            from ..models import model_config

            fp = ModelFingerprint.from_config(model_config(model_path))
        else:
            fp = _fingerprint(LLAMA8B if name == "llama8b" else TINY)
        diffs = resolve_plan(plan, fp).fingerprint.differences(fp)
        if diffs:
            raise ValueError(f"--plan was made for another model than {name!r}: " + "; ".join(diffs))


def load(name: str, settings: Settings, model_path=None):
    """``(model, description)`` for a model name of :data:`MODELS`."""
    longest = max(settings.lengths) + settings.decode_steps + settings.warmup_decode_steps + 1
    if name == "llama8b":
        model = random_llama(LLAMA8B, device=settings.device, dtype=settings.dtype,
                             max_positions=max(131072, longest))
        return model, "Llama-3.1-8B shapes, random weights"
    if name == "tiny":
        model = random_llama(TINY, device=settings.device, dtype=settings.dtype, max_positions=max(1024, longest))
        return model, "tiny random Llama (tests)"
    if name == "default":
        from ..models import load_model

        model, _ = load_model(model_path, device=settings.device, dtype=settings.dtype)
        desc = "SmolLM2-135M-Instruct (embedded default)" if model_path is None else str(model_path)
        return model, desc
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")

