"""Route a transformers model's attention through Kascade, reversibly.

``enable`` registers one attention function and one mask function under the name ``"kascade"`` in transformers'
registries (at call time, never at import), switches the model's attention implementation to it, and attaches a
:class:`KascadeRuntime` to each attention module. ``disable`` (or leaving the ``with`` block) puts the previous
implementation back and detaches everything, so the model computes exactly what it computed before.

Per forward pass (one prefill or one decode step) the runtime keeps a :class:`ForwardState`: the key geometry
derived from the padding mask and the selections made by the anchor layers, keyed by layer. Layer 0 runs first in
every forward and starts a new state; reuse layers read their anchor's selection from it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .. import ops, reuse
from ..ops import Selection
from ..plan import KascadePlan, ModelFingerprint, default_plan, shipped_plan

ATTN_NAME = "kascade"
BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class KeyMask:
    """What Kascade's mask function hands to its attention function instead of a 4-D mask.

    valid:    ``[B, N]`` bool, key slots that are not padding (None: no padding).
    q_offset: key slot of the first query of this call; in a decode step over a static cache, a 0-d tensor on
              the device (so the step needs no host synchronisation and can be captured in a CUDA graph).
    """

    valid: torch.Tensor | None
    q_offset: int | torch.Tensor


def kascade_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs) -> KeyMask:
    """Mask function registered in transformers' ``AttentionMaskInterface`` under ``"kascade"``."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not causal_mask_function:
        raise ValueError(
            "Kascade supports plain causal attention only; this model asked for another mask pattern "
            f"({getattr(mask_function, '__name__', mask_function)!r}: sliding window, packed sequences or a custom mask)"
        )
    if isinstance(q_offset, torch.Tensor) and q_length == 1:
        # Static cache, decode step: stay on the device. The cache advances this very tensor in place during the
        # forward, hence the copy; the padding check happened when the prompt was prefilled.
        valid = None
        if attention_mask is not None:
            valid = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
            if valid.shape[1] < kv_length:
                valid = torch.cat([valid, valid.new_ones(valid.shape[0], kv_length - valid.shape[1])], 1)
        return KeyMask(valid=valid, q_offset=q_offset.reshape(()).clone() - int(kv_offset))
    q_slot = int(q_offset) - int(kv_offset)
    valid = None
    if attention_mask is not None:
        valid = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
        if valid.shape[1] < kv_length:  # unused cache slots beyond the mask: ignored by the ops anyway
            pad = valid.new_ones(valid.shape[0], kv_length - valid.shape[1])
            valid = torch.cat([valid, pad], 1)
        if bool(valid[:, : q_slot + q_length].all()):
            valid = None
    return KeyMask(valid=valid, q_offset=q_slot)


def _geometry(mask, B: int, L: int, N: int) -> tuple[torch.Tensor, int]:
    """``(kv_start [B], q_offset)`` from whatever the model passed as the attention mask."""
    if mask is None:
        return torch.zeros(B, dtype=torch.long), N - L
    if not isinstance(mask, KeyMask):
        raise ValueError(
            f"Kascade got an attention mask it did not make ({type(mask).__name__}"
            f"{' of shape ' + str(tuple(mask.shape)) if isinstance(mask, torch.Tensor) else ''}); pass a 2-D padding "
            "mask (attention_mask=[B, N] of 0/1) and let the model build the rest"
        )
    q_offset = mask.q_offset
    if mask.valid is None:
        return torch.zeros(B, dtype=torch.long), q_offset
    v = mask.valid[:, : q_offset + L].cpu()
    if not bool(v.any(1).all()):
        raise ValueError("a sequence in the batch has no valid tokens (its attention mask is all zeros)")
    kv_start = v.int().argmax(1).long()
    if not torch.equal(v, torch.arange(v.shape[1])[None, :] >= kv_start[:, None]):
        raise ValueError(
            "Kascade needs left padding (padding only before each sequence's tokens); set "
            "tokenizer.padding_side = 'left'"
        )
    return kv_start, q_offset


@dataclass
class ForwardState:
    """Per forward pass (the *plan* of a plan / run split): key geometry, the Triton decode metadata built once
    for every layer of the step, and the selections of the anchor layers so far."""

    kv_start: torch.Tensor | None  # [B] on the host (None in a static-cache Triton decode step)
    q_offset: int | None
    meta: object = None  # kascade.ops.triton.decode.DecodeMeta in a Triton decode step
    selections: dict[int, Selection] = field(default_factory=dict)
    counts: dict = field(default_factory=dict)  # prefill, ranked plans: (scale, rows) -> (device counts, width)


class KascadeRuntime:
    """Computes every layer's attention for one enabled model according to its plan.

    ``backend``: "reference" (the PyTorch specification, through the validated public ops) or "triton" (the
    kernels of :mod:`kascade.ops.triton`, called with metadata built once per forward; see :func:`resolve_backend`).
    ``selector`` (default :func:`kascade.ops.select`) is what an anchor layer calls to choose its keys; the
    evaluation baselines (StreamingLLM, Quest, ...) swap it and keep everything else, so every strategy runs
    through the same sparse attention (their selections are validated by the public op on every use). With
    ``account=True`` the runtime sums, per layer, the keys actually attended and the keys dense attention would
    attend (``self.attended``: layer -> [attended, dense]).
    """

    def __init__(self, plan: KascadePlan, backend: str = "reference", selector=None, account: bool = False):
        if backend not in ("reference", "triton"):
            raise ValueError(f"KascadeRuntime takes backend 'reference' or 'triton' (resolve 'auto' with "
                             f"resolve_backend), got {backend!r}")
        variants = (plan, *(p for _, p in plan.by_length))
        if selector is not None and any(p.ranked for p in variants):
            raise ValueError("a plan with ranked reuse (sources / layer_scale / recent) selects with its own ranking "
                             "selector; pass selector=None")
        self.plan = plan
        self.budget = plan.budget
        self.backend = backend
        # Plans with per-layer budgets only (layer_scale: anchors rank their keys, reuse layers take a prefix)
        # run on the Triton kernels directly (ranked selections). Other variant plans (sources, sinks + recent,
        # length-aware sub-plans) need host geometry each forward: they take the validated public ops (Triton
        # kernels still run under them with backend="triton").
        self.ranked_fast = (backend == "triton" and selector is None and plan.ranked and plan.sources is None
                            and plan.recent == 0 and not plan.by_length)
        self.custom_selector = (selector is not None and selector is not ops.select) or \
            (any(p.ranked for p in variants) and not self.ranked_fast) or bool(plan.by_length)
        self.selector = selector or ops.select
        self.account = account
        self.attended: dict[int, list[int]] = {}
        self.state: ForwardState | None = None
        self._head_maps: dict[tuple[int, int, torch.device], torch.Tensor | None] = {}  # (id(plan), layer, device)
        self._kernels = None
        # Selections no later layer reads are dropped (a prefill selection is [B, H, tiles, k]: at 128K tokens
        # and 8 KV heads, 1.7 GB in int32): after layer l, keep only the anchors that layers > l follow. (Variant
        # plans, whose reuse layers may read any earlier anchor or switch sub-plans by length, keep them all.)
        self._last_use = None
        if not plan.by_length and plan.sources is None:
            n = plan.num_layers
            self._last_use = {a: max(l for l in range(n) if plan.anchor_of(l) == a) for a in plan.anchors}
        self.keep_selections = False  # True: keep every anchor's selection of the last forward (inspection, tests)

    # -- per forward -------------------------------------------------------------------------------------------
    def _begin(self, q, k, mask) -> ForwardState:
        B, HQ, L, D = q.shape
        N = k.shape[2]
        if self.backend == "triton":
            why = ops.triton_unavailable_reason(q.device, q.dtype, D, HQ // k.shape[1])
            if why:
                raise ValueError(f"Kascade was enabled with backend='triton' but cannot run it here: {why}")
            if self._kernels is None:
                from ..ops.triton import decode, prefill

                self._kernels = (decode, prefill)
        if isinstance(mask, KeyMask) and isinstance(mask.q_offset, torch.Tensor):  # static cache, decode step
            if self._fast() and not self.account:
                kv_start = None if mask.valid is None else mask.valid.to(torch.int32).argmax(1)
                meta = self._kernels[0].decode_meta_static(B, kv_start, mask.q_offset, N, self.budget)
                return ForwardState(kv_start=None, q_offset=None, meta=meta)
            mask = KeyMask(valid=mask.valid, q_offset=int(mask.q_offset))  # host values (a synchronisation)
        kv_start, q_offset = _geometry(mask, B, L, N)
        meta = None
        if self.backend == "triton" and L == 1:
            meta = self._kernels[0].decode_meta(B, device=q.device, kv_start=kv_start, q_offset=q_offset,
                                                budget=self.budget)
        return ForwardState(kv_start=kv_start, q_offset=q_offset, meta=meta)

    def attend(self, layer: int, q, k, v, mask, scale) -> torch.Tensor:
        """``q [B, HQ, L, D]``, ``k, v [B, H, N, D]`` -> ``[B, HQ, L, D]``."""
        L = q.shape[2]
        if layer == 0:
            self.state = self._begin(q, k, mask)
        st = self.state
        if st is None:
            raise RuntimeError(f"Kascade: layer {layer} ran before layer 0 in this forward pass")
        plan = self.plan.for_length(k.shape[2] - int(st.kv_start.min())) if self.plan.by_length else self.plan
        if plan.ranked and not self.ranked_fast:
            return self._attend_ranked(plan, layer, q, k, v, scale, st)
        if self._last_use is not None and not self.keep_selections:
            for a in [a for a in st.selections if self._last_use[a] < layer]:
                del st.selections[a]  # before this layer allocates its own
        if self.ranked_fast:
            return self._attend_ranked_fast(plan, layer, q, k, v, scale, st)
        if plan.is_anchor(layer):
            if layer == 0:
                out, sel = self._first(q, k, v, scale, st)
                st.selections[0] = sel
                if self.account:
                    self._count(layer, None, L, st)
                return out
            sel = self._select(q, k, scale, st)
            st.selections[layer] = sel
        else:
            anchor = plan.anchor_of(layer)
            if anchor not in st.selections:
                raise RuntimeError(f"Kascade: reuse layer {layer} found no selection from anchor {anchor}")
            sel = self._remap(st.selections[anchor], layer, plan)
        if self.account:
            self._count(layer, sel, L, st)
        return self._sparse(q, k, v, sel, scale, st)

    # -- the three operations, per backend ---------------------------------------------------------------------
    def _kw(self, scale, st):
        return dict(scale=scale, kv_start=st.kv_start, q_offset=st.q_offset, backend=self.backend)

    def _fast(self) -> bool:
        """Call the kernels directly (metadata from the forward state, no per-layer checks or host syncs)."""
        return self.backend == "triton" and not self.custom_selector

    def _first(self, q, k, v, scale, st):
        """Layer 0: the dense output and layer 0's selection."""
        if self._fast():
            decode, prefill = self._kernels
            if st.meta is not None:
                return decode.dense_select_decode(q, k, v, budget=self.budget, scale=scale, meta=st.meta)
            return prefill.dense_select_prefill(q, k, v, budget=self.budget, scale=scale, kv_start=st.kv_start,
                                                q_offset=st.q_offset, index_dtype=torch.int32)
        kw = self._kw(scale, st)
        sel = self.selector(q, k, budget=self.budget, **kw)
        return ops.dense_attention(q, k, v, **kw), sel

    def _select(self, q, k, scale, st) -> Selection:
        if self._fast():
            decode, prefill = self._kernels
            if st.meta is not None:
                return decode.select_decode(q, k, budget=self.budget, scale=scale, meta=st.meta)
            return prefill.select_prefill(q, k, budget=self.budget, scale=scale, kv_start=st.kv_start,
                                          q_offset=st.q_offset, index_dtype=torch.int32)
        return self.selector(q, k, budget=self.budget, **self._kw(scale, st))

    def _sparse(self, q, k, v, sel, scale, st):
        if self._fast():
            decode, prefill = self._kernels
            if st.meta is not None:
                return decode.sparse_decode(q, k, v, sel.indices, scale=scale)
            return prefill.sparse_prefill(q, k, v, sel, scale=scale, kv_start=st.kv_start, q_offset=st.q_offset)
        return ops.sparse_attention(q, k, v, sel, **self._kw(scale, st))

    def _attend_ranked(self, plan, layer, q, k, v, scale, st):
        """A ranked plan (issue 8's variants, :mod:`kascade.reuse`): anchors keep their ranking, deep enough for
        the layers they serve; reuse layers build standard Selections from it."""
        kw = self._kw(scale, st)
        L = q.shape[2]
        if plan.is_anchor(layer):
            sel = reuse.ranked_select(q, k, budget=self.budget, depth=plan.rank_depth(layer),
                                      own=plan.scale_of(layer), **kw)
            st.selections[layer] = sel
            if layer == 0:
                if self.account:
                    self._count(layer, None, L, st)
                return ops.dense_attention(q, k, v, **kw)
        else:
            sel = reuse.reuse_selection(plan, layer, st.selections, budget=self.budget, kv_start=st.kv_start,
                                        q_offset=st.q_offset, L=L)
        if self.account:
            self._count(layer, sel, L, st)
        return ops.sparse_attention(q, k, v, sel, **kw)

    def _attend_ranked_fast(self, plan, layer, q, k, v, scale, st):
        """A per-layer-budget plan on the Triton kernels: anchors keep a ranked selection (descending pooled
        probability, as deep as the largest budget they serve); every layer attends a prefix of its anchor's
        ranking, ``round(scale * c)`` keys per row (:func:`kascade.reuse.row_counts`' rule). The sparse kernel
        cuts each row itself: it gets per-row counts (prefill, computed once per forward and scale) or
        per-sequence counts (decode, once per step and scale; :meth:`_prefix_counts`), so no layer copies or masks
        its indices. With ``account`` the prefix is materialised so that the attended keys can be counted."""
        decode, prefill = self._kernels
        L = q.shape[2]
        if plan.is_anchor(layer):
            depth = plan.rank_depth(layer)
            if st.meta is not None:
                kw = dict(budget=self.budget, scale=scale, meta=st.meta, depth=depth)
                out, order = decode.dense_select_decode(q, k, v, **kw) if layer == 0 else \
                    (None, decode.select_decode(q, k, **kw))
            else:
                kw = dict(budget=self.budget, scale=scale, kv_start=st.kv_start, q_offset=st.q_offset,
                          index_dtype=torch.int32, depth=depth)
                out, order = prefill.dense_select_prefill(q, k, v, **kw) if layer == 0 else \
                    (None, prefill.select_prefill(q, k, **kw))
            st.selections[layer] = order
            if layer == 0:
                if self.account:
                    self._count(layer, None, L, st)
                return out
        else:
            order = st.selections[plan.anchor_of(layer)]
        cnt, K = self._prefix_counts(order, plan.scale_of(layer), st, L)
        sel = Selection(order.indices[..., :K], order.row_start, order.tile, order.decode)
        sel = sel if plan.is_anchor(layer) else self._remap(sel, layer, plan)
        if self.account:  # materialise the prefix so that the attended keys can be counted
            rows = cnt[:, None] if st.meta is not None else cnt  # [B, R]
            keep = torch.arange(K, device=cnt.device) < rows[:, None, :, None]
            sel = Selection(torch.where(keep, sel.indices, -1), sel.row_start, sel.tile, sel.decode)
            self._count(layer, sel, L, st)
            return self._sparse(q, k, v, sel, scale, st)
        if st.meta is not None:  # the sparse kernels attend each row's prefix themselves
            return decode.sparse_decode(q, k, v, sel.indices, scale=scale, counts=cnt)
        return prefill.sparse_prefill(q, k, v, sel, scale=scale, kv_start=st.kv_start, q_offset=st.q_offset,
                                      counts=cnt)

    def _prefix_counts(self, order: Selection, scale: float, st, L: int) -> tuple[torch.Tensor, int]:
        """How many keys of each ranked row a layer at budget multiplier ``scale`` attends, ``round(scale * c)``
        (``c`` the row's faithful budget, capped by its candidates): int32 device counts, ``[B]`` in decode (from
        the step's device metadata: graph-capturable) or ``[B, R]`` in prefill (host rule, copied once), memoised
        per step / forward and scale; and the width ``K`` of the index rows they need."""
        width = order.indices.shape[-1]
        if st.meta is not None:
            return self._kernels[0].ranked_counts(st.meta, scale), min(width, int(scale * st.meta.k_max + 0.5) + 1)
        key = (scale, order.indices.shape[2])
        if key not in st.counts:
            c = reuse.prefill_counts(self.budget, scale, kv_start=st.kv_start, q_offset=st.q_offset, L=L,
                                     rows=order.indices.shape[2])  # [B, R] on the host
            st.counts[key] = (c.to(torch.int32).to(order.indices.device), int(c.max()) if c.numel() else 0)
        cnt, most = st.counts[key]
        return cnt, min(width, most)

    def _remap(self, sel: Selection, layer: int, plan: KascadePlan | None = None) -> Selection:
        """The anchor's selection through this layer's head map (a device tensor cached per layer and plan;
        identity maps reuse the anchor's indices as they are)."""
        plan = plan or self.plan
        key = (id(plan), layer, sel.indices.device)
        if key not in self._head_maps:
            row = plan.head_map[layer]
            self._head_maps[key] = None if list(row) == list(range(len(row))) else \
                torch.tensor(row, dtype=torch.long).to(sel.indices.device)
        hm = self._head_maps[key]
        return sel if hm is None else sel.take_heads(hm)

    def _count(self, layer, sel, L, st):
        att, dense = ops.attended_keys(sel, kv_start=st.kv_start, q_offset=st.q_offset, L=L,
                                       num_kv_heads=self.plan.fingerprint.num_kv_heads)
        tot = self.attended.setdefault(layer, [0, 0])
        tot[0] += att
        tot[1] += dense


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
    out = runtime.attend(module.layer_idx, query, key, value, attention_mask, scaling)
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
    """Route ``model``'s attention to ``runtime.attend(layer, q, k, v, mask, scale)`` (the mechanism under
    :func:`enable`; calibration attaches its statistics recorder the same way)."""
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
