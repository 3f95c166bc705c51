"""Route a transformers model's attention through Kascade, reversibly.

``enable`` registers one attention function and one mask function under the name ``"kascade"`` in transformers'
registries (at call time, never at import), switches the model's attention implementation to it, and attaches a
:class:`KascadeRuntime` to each attention module. ``disable`` (or leaving the ``with`` block) puts the previous
implementation back and detaches everything, so the model computes exactly what it computed before.

Per forward pass (one prefill or one decode step) the mask function reads the key geometry from the padding mask
(:class:`KeyMask`), and the runtime (:mod:`kascade.integration.runtime`) plans the step at layer 0 and keeps the
forward's state on that mask object, so that every later layer, and no other forward, sees it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import ops
from ..plan import KascadePlan, ModelFingerprint, default_plan, shipped_plan
from .runtime import KascadeRuntime

ATTN_NAME = "kascade"
BACKENDS = ("auto", "reference", "triton")


@dataclass(eq=False)
class KeyMask:
    """What Kascade's mask function hands to every attention layer of one forward instead of a 4-D mask.

    kv_start: ``[B]`` int64 on the host, each sequence's first valid key slot (left padding before it); in a decode
              step over a static cache a ``[B]`` tensor on the device, or None (no padding).
    q_offset: key slot of the first query of this call; in a decode step over a static cache a 0-d tensor on the
              device (so the step needs no host synchronisation and can be captured in a CUDA graph).
    state:    the forward's state, made by the runtime at layer 0 and read by every later layer (one per forward:
              concurrent forwards on one model each have their own mask object).
    """

    kv_start: torch.Tensor | None
    q_offset: int | torch.Tensor
    state: object = None
    begun: bool = False


def kascade_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs) -> KeyMask:
    """Mask function registered in transformers' ``AttentionMaskInterface`` under ``"kascade"``. It runs once per
    forward, before any layer: everything the padding mask can get wrong is refused here, before the KV cache
    changes."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not causal_mask_function:
        raise ValueError(
            "Kascade supports plain causal attention only; this model asked for another mask pattern "
            f"({getattr(mask_function, '__name__', mask_function)!r}: sliding window, packed sequences or a custom mask)"
        )
    if isinstance(q_offset, torch.Tensor) and q_length == 1:
        # Static cache, decode step: stay on the device. The cache advances this very tensor in place during the
        # forward, hence the copy; the padding check happened when the prompt was prefilled.
        kv_start = None
        if attention_mask is not None:
            valid = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
            kv_start = valid.to(torch.int32).argmax(1)
        return KeyMask(kv_start=kv_start, q_offset=q_offset.reshape(()).clone() - int(kv_offset))
    q_slot = int(q_offset) - int(kv_offset)
    if attention_mask is None:
        return KeyMask(kv_start=torch.zeros(batch_size, dtype=torch.long), q_offset=q_slot)
    if attention_mask.dim() != 2:
        raise ValueError(f"Kascade takes a 2-D padding mask (attention_mask=[B, N] of 0/1), got shape "
                         f"{tuple(attention_mask.shape)}")
    v = attention_mask[:, kv_offset : kv_offset + q_slot + q_length].to(torch.bool).cpu()
    if v.shape[1] < q_slot + q_length:  # a mask shorter than the keys: the rest is valid
        v = torch.cat([v, v.new_ones(v.shape[0], q_slot + q_length - v.shape[1])], 1)
    if not bool(v.any(1).all()):
        raise ValueError("a sequence in the batch has no valid tokens (its attention mask is all zeros)")
    kv_start = v.int().argmax(1).long()
    if not torch.equal(v, torch.arange(v.shape[1])[None, :] >= kv_start[:, None]):
        raise ValueError(
            "Kascade needs left padding (padding only before each sequence's tokens); set "
            "tokenizer.padding_side = 'left'"
        )
    return KeyMask(kv_start=kv_start, q_offset=q_slot)


def forward_state(runtime, layer: int, q, k, mask):
    """The forward's state for ``layer``: made by ``runtime.begin`` at layer 0 and kept on the forward's mask."""
    if not isinstance(mask, KeyMask):
        raise ValueError(
            f"Kascade got an attention mask it did not make ({type(mask).__name__}"
            f"{' of shape ' + str(tuple(mask.shape)) if isinstance(mask, torch.Tensor) else ''}); pass a 2-D padding "
            "mask (attention_mask=[B, N] of 0/1) and let the model build the rest"
        )
    if layer == 0:
        mask.state, mask.begun = runtime.begin(q, k, mask.kv_start, mask.q_offset), True
    elif not mask.begun:
        raise RuntimeError(f"Kascade: layer {layer} ran before layer 0 in this forward pass")
    return mask.state


def kascade_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered in transformers' ``AttentionInterface`` under ``"kascade"``."""
    runtime = getattr(module, "_kascade_runtime", None)
    if runtime is None:
        raise RuntimeError(
            "this model's attention implementation is 'kascade' but Kascade is not enabled on it; "
            "use kascade.enable(model) (or set another attn_implementation)"
        )
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"Kascade does not support attention with {name}={kwargs[name]!r}")
    if dropout and module.training:
        raise ValueError("Kascade is an inference method: attention dropout in training mode is not supported")
    layer = module.layer_idx
    out = runtime.attend(layer, query, key, value, forward_state(runtime, layer, query, key, attention_mask), scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kascade_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, kascade_mask)


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's self-attention modules, ordered by ``layer_idx``; ValueError if they cannot be routed."""
    mods = [m for m in model.modules() if "Attention" in type(m).__name__ and hasattr(m, "layer_idx")]
    idx = sorted(int(m.layer_idx) for m in mods)
    n = ModelFingerprint.from_model(model).num_layers
    if idx != list(range(n)):
        raise ValueError(
            f"cannot route this model's attention through Kascade: expected {n} attention modules with layer_idx "
            f"0..{n - 1}, found {len(mods)} ({type(model).__name__})"
        )
    return sorted(mods, key=lambda m: int(m.layer_idx))


class KascadeHandle:
    """Returned by :func:`enable`; a context manager whose exit (or :meth:`disable`) restores the model."""

    def __init__(self, model, runtime: KascadeRuntime, previous_impl: str, modules):
        self.model = model
        self.runtime = runtime
        self.plan = getattr(runtime, "plan", None)
        self._previous_impl = previous_impl
        self._modules = modules
        self.active = True

    def disable(self) -> None:
        if not self.active:
            return
        for m in self._modules:
            del m._kascade_runtime
        self.model.set_attn_implementation(self._previous_impl)
        del self.model._kascade_handle
        self.active = False

    def __enter__(self) -> "KascadeHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


def check_supported(model) -> None:
    """Raise TypeError / ValueError (naming the problem) if Kascade cannot serve ``model`` exactly."""
    if getattr(model, "_kascade_handle", None) is not None:
        raise RuntimeError("Kascade is already enabled on this model; disable it first")
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"Kascade supports full causal attention layers only; this model has {sorted(set(layer_types))}")
    if not layer_types and getattr(cfg, "sliding_window", None) is not None:
        raise ValueError(f"this model uses sliding-window attention (sliding_window={cfg.sliding_window}), which Kascade "
                         "does not support; set model.config.sliding_window = None if your prompts fit in the window")


def resolve_backend(model, backend: str = "auto") -> str:
    """The backend ``enable`` will use: ``"auto"`` is "triton" when the model sits on a CUDA device in a dtype and
    shape the kernels serve (and triton is installed), else "reference". ``"triton"`` where it cannot run raises
    ValueError with the reason; it is never replaced silently."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "reference":
        return backend
    fp = ModelFingerprint.from_model(model)
    p = next(model.parameters())
    why = ops.triton_unavailable_reason(p.device, p.dtype, fp.head_dim, fp.num_q_heads // fp.num_kv_heads)
    if backend == "triton":
        if why:
            raise ValueError(f"Kascade cannot use backend='triton' for this model: {why}")
        return "triton"
    return "triton" if why is None and p.device.type == "cuda" else "reference"


def enable(model, plan: KascadePlan | str | None = None, *, backend: str = "auto", selector=None,
           account: bool = False, warn_uncalibrated: bool = True) -> KascadeHandle:
    """Route every attention layer of ``model`` through Kascade with ``plan``.

    ``plan=None`` takes the calibrated plan shipped for this model's shape if there is one, else the uncalibrated
    uniform plan (with a warning); a string names a shipped variant (``kascade.plan.SHIPPED_VARIANTS``: "default",
    "searched", "faithful" = the paper's method). ``backend``: "auto" (default: the Triton kernels on CUDA when
    they support the model's dtype and shapes, else the PyTorch reference), "triton" (an error where it cannot run) or
    "reference"; ``handle.runtime.backend`` says which one runs. Use as ``with kascade.enable(model): ...`` or keep
    the handle and call ``kascade.disable(model)``. ``selector`` and ``account``: see :class:`KascadeRuntime`.
    """
    check_supported(model)
    backend = resolve_backend(model, backend)
    if plan is None:
        plan = default_plan(model)
    elif isinstance(plan, str):
        plan = shipped_plan(model, plan)
    if not isinstance(plan, KascadePlan):
        raise TypeError(f"plan must be a KascadePlan or the name of a shipped variant, got {type(plan).__name__}")
    plan.check_model(model)
    if not plan.calibrated and warn_uncalibrated:
        warnings.warn(f"Kascade is using an uncalibrated plan ({plan.source}); accuracy will be lower than with a "
                      "calibrated one (see `kascade calibrate`)", stacklevel=2)
    return attach(model, KascadeRuntime(plan, backend, selector=selector, account=account))


def attach(model, runtime) -> KascadeHandle:
    """Route ``model``'s attention to ``runtime`` (the mechanism under :func:`enable`; calibration attaches its
    statistics recorder the same way): per forward, ``state = runtime.begin(q, k, kv_start, q_offset)`` at layer 0,
    then ``runtime.attend(layer, q, k, v, state, scale)`` for every layer, ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]``
    -> ``[B, HQ, L, D]``."""
    check_supported(model)
    modules = attention_modules(model)
    if not type(model)._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__} does not use transformers' attention-function registry; "
                         "Kascade cannot route its attention")
    previous = model.config._attn_implementation
    _register()
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(previous)
        raise ValueError(f"{type(model).__name__} refused the attention implementation {ATTN_NAME!r}")
    for m in modules:
        m._kascade_runtime = runtime
    handle = KascadeHandle(model, runtime, previous, modules)
    model._kascade_handle = handle
    return handle


def disable(model) -> None:
    """Undo :func:`enable` on ``model`` (no-op if Kascade is not enabled)."""
    handle = getattr(model, "_kascade_handle", None)
    if handle is not None:
        handle.disable()
