"""Route a transformers model's attention through Kascade, reversibly.

``enable`` registers one attention function and one mask function under the name ``"kascade"`` in transformers'
registries (at call time, never at import; :mod:`kascade.integration.functions`), switches the model's attention
implementation to it, and attaches a runtime (:class:`kascade.Attention`) to each
attention module. ``disable`` (or leaving the ``with`` block) puts the previous implementation back and detaches
everything, so the model computes exactly what it computed before. :func:`attach` is the mechanism under it: any
runtime can be attached (calibration's statistics recorder, the dense and no-attention baselines of the benchmark).
"""

from __future__ import annotations

import warnings

import torch

from .. import ops
from ..plan import KascadePlan, ModelFingerprint, resolve_plan
from .functions import ATTN_NAME, register
from .runtime import Runtime
from ..attention import Attention
from ..tensor_parallel import head_shard

BACKENDS = ("auto", "reference", "triton")


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _routing_key(model) -> str | None:
    """Where the language model's attention implementation is set: None for a language model, else the key of
    its config among the model's sub-configs (a vision-language model keeps its vision tower's attention)."""
    text = _text_config(model)
    if text is model.config:
        return None
    for key in getattr(model.config, "sub_configs", {}) or {}:
        if getattr(model.config, key, None) is text:
            return key
    raise ValueError(f"cannot find the language model's config among {type(model).__name__}'s sub-configs")


def attention_modules(model) -> list[torch.nn.Module]:
    """The language model's self-attention modules, ordered by ``layer_idx``; ValueError if they cannot be
    routed."""
    text = _text_config(model)
    mods = [m for m in model.modules() if "Attention" in type(m).__name__ and hasattr(m, "layer_idx")
            and getattr(m, "config", text) is text]
    idx = sorted(int(m.layer_idx) for m in mods)
    n = ModelFingerprint.from_model(model).num_layers
    if idx != list(range(n)):
        raise ValueError(
            f"cannot route this model's attention through Kascade: expected {n} attention modules with layer_idx "
            f"0..{n - 1}, found {len(mods)} ({type(model).__name__})"
        )
    return sorted(mods, key=lambda m: int(m.layer_idx))


def _set_implementation(model, name: str) -> None:
    key = _routing_key(model)
    model.set_attn_implementation(name if key is None else {key: name})


class KascadeHandle:
    """Returned by :func:`enable` (and :func:`attach`), with the model routed; a context manager whose exit (or
    :meth:`disable`) restores the model. Entering a handle that was disabled routes the model again, with the same
    runtime: ``with h: ...`` twice runs Kascade both times."""

    def __init__(self, model, runtime):
        self.model = model
        self.runtime = runtime
        self.plan = getattr(runtime, "plan", None)
        self.active = False
        self._previous_impl = None
        self._modules = ()

    def _route(self) -> None:
        model = self.model
        check_supported(model)
        modules = attention_modules(model)
        if not type(model)._can_set_attn_implementation():
            raise ValueError(f"{type(model).__name__} does not use transformers' attention-function registry; "
                             "Kascade cannot route its attention")
        previous = _text_config(model)._attn_implementation
        register()
        _set_implementation(model, ATTN_NAME)
        if _text_config(model)._attn_implementation != ATTN_NAME:
            _set_implementation(model, previous)
            raise ValueError(f"{type(model).__name__} refused the attention implementation {ATTN_NAME!r}")
        for m in modules:
            m._kascade_runtime = self.runtime
            m._kascade_layers = len(modules)  # the last layer of a pass completes its mask's check (functions.py)
        self._previous_impl, self._modules = previous, modules
        model._kascade_handle = self
        self.active = True

    def disable(self) -> None:
        if not self.active:
            return
        for m in self._modules:
            m.__dict__.pop("_kascade_runtime", None)
            m.__dict__.pop("_kascade_layers", None)
        _set_implementation(self.model, self._previous_impl)
        self.model.__dict__.pop("_kascade_handle", None)
        self.active = False

    def __enter__(self) -> "KascadeHandle":
        if not self.active:
            self._route()
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


def check_supported(model) -> None:
    """Raise TypeError / ValueError (naming the problem) if Kascade cannot serve ``model`` exactly."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model, "_kascade_handle", None) is not None:
        raise RuntimeError("Kascade is already enabled on this model; disable it first")
    routed = next((m for m in model.modules() if getattr(m, "_kascade_runtime", None) is not None), None)
    if routed is not None:
        raise RuntimeError("Kascade is already enabled on a model this one contains or is part of (its attention "
                           f"module {type(routed).__name__} is routed); disable it there first")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("this model's weights are on the meta device (not loaded: an empty model, or offloading that "
                         "left them there); load the weights before enabling Kascade")
    cfg = _text_config(model)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"Kascade supports full causal attention layers only; this model has {sorted(set(layer_types))}")
    v_dim = getattr(cfg, "v_head_dim", None)
    qk_dim = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None)
    if v_dim is not None and v_dim != qk_dim:
        raise ValueError(f"this model's values have another head dim ({v_dim}) than its queries and keys ({qk_dim}), as "
                         "in multi-head latent attention; Kascade's ops take one head dim")
    if getattr(cfg, "alibi", False) is True:
        raise ValueError("this model adds ALiBi position biases through the attention mask, which Kascade's attention "
                         "does not apply")
    if not layer_types and getattr(cfg, "sliding_window", None) is not None:
        raise ValueError(f"this model uses sliding-window attention (sliding_window={cfg.sliding_window}), which Kascade "
                         "does not support; set model.config.sliding_window = None if your prompts fit in the window")


def resolve_backend(model, backend: str = "auto", plan: KascadePlan | None = None) -> str:
    """The backend ``enable`` will use for ``model`` (its parameters' device and dtype, its heads) and ``plan``'s
    budget: the rule of :func:`kascade.ops.resolve_backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    fp = ModelFingerprint.from_model(model)
    p = next(model.parameters())
    try:
        return ops.resolve_backend(backend, p.device, p.dtype, fp.head_dim, fp.num_q_heads // fp.num_kv_heads,
                                   None if plan is None else plan.budget)
    except ValueError as e:
        raise ValueError(f"Kascade cannot use backend='triton' for this model: {e}") from None


def enable(model, plan: KascadePlan | str | None = None, *, backend: str = "auto", exchange: bool = False,
           selector=None, account: bool = False, warn_uncalibrated: bool = True) -> KascadeHandle:
    """Route every attention layer of ``model`` through Kascade with ``plan``.

    ``plan=None`` takes the calibrated plan shipped for this model's shape if there is one, else the uncalibrated
    uniform plan (with a warning); a string names a shipped variant (``kascade.plan.SHIPPED_VARIANTS``: "default",
    "searched", "faithful" = the paper's method, ...) or is the path of a plan file (``kascade calibrate``'s
    plan.json; :func:`kascade.plan.resolve_plan`). ``backend``: "auto" (default: the Triton kernels on CUDA when
    they support the model's dtype and shapes, else the PyTorch reference), "triton" (an error where it cannot run) or
    "reference"; ``handle.runtime.backend`` says which one runs. Use as ``with kascade.enable(model): ...`` or keep
    the handle and call ``kascade.disable(model)``. ``selector`` and ``account``: see
    :class:`kascade.Attention`.

    Decoding that feeds several tokens per forward (speculative decoding: ``generate(prompt_lookup_num_tokens=...)``
    or an assistant model) runs those forwards as a prefill chunk, with tile-pooled selections: its tokens can differ
    from one-token-at-a-time Kascade decoding with the same plan (both are Kascade; a full budget makes both dense).

    On a tensor-parallel model (transformers' ``tp_plan``) every rank runs its own heads; the plan must then be
    shard-local for the model's size (:meth:`KascadePlan.for_tensor_parallel`), or ``exchange=True`` all-gathers
    the anchors' selections so that any plan runs (:mod:`kascade.tensor_parallel`).
    """
    check_supported(model)
    plan = resolve_plan(plan, model)
    backend = resolve_backend(model, backend, plan)
    plan.check_model(model)
    fp = plan.fingerprint
    shard = head_shard(attention_modules(model), fp.num_kv_heads, fp.head_dim)
    if exchange and shard is None:
        raise ValueError("exchange=True exchanges selections between tensor-parallel ranks; this model is not "
                         "tensor-parallel")
    if shard is not None and not exchange:
        for p in (plan, *(sub for _, sub in plan.by_length)):
            cross = p.crossing_links(shard.size)
            if cross:
                made = f"shard-local for tensor_parallel={p.tensor_parallel}" if p.tensor_parallel else \
                    "for a model on one device"
                raise ValueError(f"this plan ({made}) links heads across the ranks of this model's tensor_parallel="
                                 f"{shard.size} ({len(cross)} links, e.g. layer {cross[0][0]} head {cross[0][1]} -> "
                                 f"anchor {cross[0][2]} head {cross[0][3]}): use plan.for_tensor_parallel("
                                 f"{shard.size}) (or `kascade calibrate --tensor-parallel {shard.size}`), or "
                                 "enable(..., exchange=True)")
    if backend == "triton" and plan.score_dtype is not None:
        warnings.warn(f"{plan.score_dtype.upper()} scoring (score_dtype={plan.score_dtype!r}) on the Triton backend: "
                      "in decode each anchor quantises its layer's whole key cache on every step (no quantised copy "
                      "of it is kept yet), which reads more than exact scoring does (docs/design/kernels.md)",
                      stacklevel=2)
    if not plan.calibrated and warn_uncalibrated:
        warnings.warn(f"Kascade is using an uncalibrated plan ({plan.source}); accuracy will be lower than with a "
                      "calibrated one (see `kascade calibrate`)", stacklevel=2)
    return attach(model, Attention(plan, backend, selector=selector, account=account, shard=shard,
                                   exchange=exchange))


def attach(model, runtime: Runtime) -> KascadeHandle:
    """Route ``model``'s attention to ``runtime`` (a :class:`~kascade.integration.runtime.Runtime`: the mechanism
    under :func:`enable`; calibration attaches its statistics recorder the same way)."""
    if not isinstance(runtime, Runtime):
        raise TypeError(f"runtime must have begin(fwd, q, k) and attend(layer, q, k, v, fwd, scale), "
                        f"got {type(runtime).__name__}")
    handle = KascadeHandle(model, runtime)
    handle._route()
    return handle


def disable(model) -> None:
    """Undo :func:`enable` on ``model`` (no-op if Kascade is not enabled)."""
    handle = getattr(model, "_kascade_handle", None)
    if handle is not None:
        handle.disable()
