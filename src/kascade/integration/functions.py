"""What transformers calls: Kascade's mask function and attention function, registered under ``"kascade"``.

Per forward pass (one prefill or one decode step) the mask function reads the key geometry from the padding mask
once, before any layer runs, into a :class:`KeyMask` (a :class:`kascade.Forward`); the attention function hands each
layer to the runtime attached to its module (:func:`kascade.integration.hf.attach`, usually a
:class:`kascade.Attention`), which plans the pass at layer 0 and fills in that object (step, plan, selections), so
that every later layer of the pass, and no other pass, sees it.
"""

from __future__ import annotations

import functools
import threading

import torch

from ..attention import Forward

ATTN_NAME = "kascade"


class KeyMask(Forward):
    """The :class:`kascade.Forward` that Kascade's mask function hands to every attention layer of one forward pass
    instead of a 4-D mask (made from the padding mask, once per pass). A Forward in every other respect: this
    subclass is only how the transformers integration makes one and passes it through transformers as a mask.

    ``generate`` with a compileable (static) cache builds the mask before the forward and passes it back in as
    ``attention_mask``; transformers then asks the mask function again, unless the mask says it is ready (4-D).
    Saying ndim 4 is that signal: the mask function receives it back and hands on its geometry.

    ``check``: a decode step's padding check still running on the device (:class:`_MaskCheck`), or None.
    """

    ndim = 4
    check = None


# Devices on which a decode step's padding check is read back late (its last layer, see _MaskCheck) instead of
# before the first: reading it at once would make the host wait for the device at the start of every step.
DEFERRED_CHECK = ("cuda",)
_pending = threading.local()  # the last deferred check not read yet (this thread's)


class _MaskCheck:
    """A decode step's left-padding check, computed on the device when the step's mask is made; its one flag is read
    after the step's last layer was launched (by the attention function), or, where that layer ran inside a compiled
    graph, when the next step's mask is made. A refused step raises then, having written its token's keys and values
    into the cache slot the next step would overwrite. Where the device is the host (a CPU) the check is immediate."""

    def __init__(self, valid: torch.Tensor, q: torch.Tensor, flag: torch.Tensor | None = None):
        # flag: what _left_padded(valid, q) says, already on the device (0-d), or per row ([B], made by the fused
        # geometry kernel)
        self.valid, self.q = valid, q
        flag = _left_padded(valid, q) if flag is None else flag
        self.event = None
        if valid.is_cuda:
            self.flag = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self.flag.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = flag

    def verify(self) -> None:
        if getattr(_pending, "check", None) is self:
            _pending.check = None
        if self.event is not None:
            self.event.synchronize()
        if not bool(self.flag.all()):
            _left_padding_start(self.valid, int(self.q) + 1)  # raises, naming the problem
            raise ValueError("Kascade needs left padding (padding only before each sequence's tokens)")


def _verify_pending() -> None:
    check = getattr(_pending, "check", None)
    if check is not None:
        check.verify()


def kascade_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, device=None, **kwargs) -> KeyMask:
    """Mask function registered in transformers' ``AttentionMaskInterface`` under ``"kascade"``. It runs once per
    forward, before any layer: everything the padding mask can get wrong is refused here, before the KV cache
    changes (a decode step on a GPU: after its last layer, :class:`_MaskCheck`)."""
    from transformers.masking_utils import causal_mask_function

    compiling = torch.compiler.is_compiling()
    if isinstance(attention_mask, KeyMask):  # made before the forward (generate with a static cache): a fresh pass
        mask = KeyMask(kv_start=attention_mask.kv_start, q_offset=attention_mask.q_offset,
                       refused=attention_mask.refused)
        if not compiling:  # (in a compiled forward the check is read when the next step's mask is made)
            mask.check = attention_mask.check
        return mask
    if mask_function is not causal_mask_function:
        # Some models build every mask kind they know (e.g. sliding-window next to full) whether or not a layer
        # uses it: refuse only if a layer does.
        return KeyMask(kv_start=None, q_offset=0, refused=(
            "Kascade supports plain causal attention only; this model asked for another mask pattern "
            f"({getattr(mask_function, '__name__', mask_function)!r}: sliding window, packed sequences or a custom mask)"))
    where = attention_mask.device if attention_mask is not None else \
        q_offset.device if isinstance(q_offset, torch.Tensor) else device
    if q_length == 1 and where is not None:
        # A decode step, planned on the device: kv_start and the query's slot stay there, and nothing is read back
        # to the host before the layers run (the step can be captured in a CUDA graph, traced by torch.compile, and
        # the host need not wait for the previous step). A static cache advances its position tensor in place
        # during the forward, hence the copy. The mask is checked as in every other pass (a hole in it would be
        # ignored, not refused), except while a CUDA graph is captured or torch.compile traces: the masks of those
        # steps come from a decoder that extends a checked prompt's mask (GraphDecoder; generate, which builds a
        # static cache's mask eagerly before its compiled forward, so that the check runs there).
        if not compiling:
            _verify_pending()
        fused = None if attention_mask is None else _fused(attention_mask, q_offset)
        if fused is not None:
            # the geometry, the query's slot and the check in one launch (on a GPU host ~20 small ops cost ~0.6 ms)
            given = attention_mask[:, kv_offset : kv_offset + kv_length]
            kv_start, q_dev, ok = fused.mask_geometry(given, q_offset, kv_offset)
            mask = KeyMask(kv_start=kv_start, q_offset=q_dev)
            mask.check = _pending.check = _MaskCheck(given, q_dev, ok)
            return mask
        if isinstance(q_offset, torch.Tensor):
            q_dev = q_offset.reshape(()).clone() - int(kv_offset)
        else:
            q_dev = torch.full((), int(q_offset) - int(kv_offset), dtype=torch.long, device=where)
        if attention_mask is None:
            return KeyMask(kv_start=None, q_offset=q_dev)
        _check_2d(attention_mask)
        valid = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
        mask = KeyMask(kv_start=valid.to(torch.int32).argmax(1), q_offset=q_dev)
        if not (compiling or (valid.is_cuda and torch.cuda.is_current_stream_capturing())):
            if valid.device.type in DEFERRED_CHECK:
                mask.check = _pending.check = _MaskCheck(valid, q_dev)
            else:
                _left_padding_start(valid, int(q_dev) + 1)
        return mask
    q_slot = int(q_offset) - int(kv_offset)
    if attention_mask is None:
        return KeyMask(kv_start=torch.zeros(batch_size, dtype=torch.long), q_offset=q_slot)
    _check_2d(attention_mask)
    kv_start = _left_padding_start(attention_mask[:, kv_offset:], q_slot + q_length)
    return KeyMask(kv_start=kv_start, q_offset=q_slot)


def _fused(attention_mask, q_offset):
    """:mod:`kascade.ops.triton.step` if it reads this decode step's mask (:func:`~kascade.ops.triton.step.
    mask_geometry`), else None: an eager step (not traced, not captured) whose check is deferred (a GPU), with
    Triton installed and the query's slot on the mask's device (or a host int)."""
    dev = attention_mask.device
    if dev.type not in DEFERRED_CHECK or attention_mask.dim() != 2:
        return None
    if isinstance(q_offset, torch.Tensor) and (q_offset.device != dev or q_offset.numel() != 1):
        return None
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    step = _triton_step()
    return step if step is not None and step.usable(dev) else None  # usable: not while torch.compile traces


@functools.cache
def _triton_step():
    """:mod:`kascade.ops.triton.step`, or None without Triton (the torch ops then serve)."""
    try:
        from ..ops.triton import step
    except ImportError:
        return None
    return step


def _check_2d(attention_mask: torch.Tensor) -> None:
    if attention_mask.dim() != 2:
        raise ValueError(f"Kascade takes a 2-D padding mask (attention_mask=[B, N] of 0/1), got shape "
                         f"{tuple(attention_mask.shape)}")


def _left_padded(valid: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Whether every row of ``valid [B, W]`` (bool) is padding then tokens up to slot ``q`` (a 0-d tensor; later
    slots are anything, slots past the mask's end count as tokens) with a token at or before ``q``: a 0-d bool on
    the device, made without reading anything back (what :func:`_left_padding_start` checks on the host)."""
    W = valid.shape[1]
    inside = torch.arange(1, W, device=valid.device) <= q  # slot j + 1 holds a key
    drop = (valid[:, :-1] & ~valid[:, 1:] & inside).any()  # a token, then padding
    last = valid.index_select(1, q.clamp(max=W - 1).reshape(1))[:, 0] | (q >= W)  # so a token at q: one at all
    return ~drop & last.all()


def _left_padding_start(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Each sequence's first valid slot among the first ``n`` of ``mask [B, >= 0]`` (slots past its end are valid);
    ValueError unless every row is padding then tokens (left padding) with at least one token."""
    v = mask[:, :n].to(torch.bool).cpu()
    if v.shape[1] < n:  # a mask shorter than the keys: the rest is valid
        v = torch.cat([v, v.new_ones(v.shape[0], n - v.shape[1])], 1)
    if not bool(v.any(1).all()):
        raise ValueError("a sequence in the batch has no valid tokens (its attention mask is all zeros)")
    kv_start = v.int().argmax(1).long()
    if not torch.equal(v, torch.arange(v.shape[1])[None, :] >= kv_start[:, None]):
        raise ValueError(
            "Kascade needs left padding (padding only before each sequence's tokens); set "
            "tokenizer.padding_side = 'left'"
        )
    return kv_start


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
    if kwargs.get("output_attentions"):
        raise ValueError("Kascade does not compute attention weights (its layers attend a selection of the keys); "
                         "output_attentions=True needs the model without Kascade")
    if module.training:
        raise ValueError("Kascade is for inference: this model is in training mode (call model.eval(); gradient "
                         "checkpointing and training are not supported)")
    if not isinstance(attention_mask, KeyMask):
        raise ValueError(
            f"Kascade got an attention mask it did not make ({type(attention_mask).__name__}"
            f"{' of shape ' + str(tuple(attention_mask.shape)) if isinstance(attention_mask, torch.Tensor) else ''}); "
            "pass a 2-D padding mask (attention_mask=[B, N] of 0/1) and let the model build the rest")
    layer = module.layer_idx
    out = runtime.attend(layer, query, key, value, attention_mask.at_layer(runtime, layer, query, key), scaling)
    check = attention_mask.check
    if check is not None and layer == getattr(module, "_kascade_layers", 0) - 1:
        attention_mask.check = None  # the step's last layer is launched: the host may wait for its check now
        check.verify()
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        out = _NoBackward.apply(out, query, key, value)
    return out.transpose(1, 2).contiguous(), None


class _NoBackward(torch.autograd.Function):
    """Passes the attention output through and refuses the backward pass: the selections are not differentiable
    and the Triton kernels have no backward, so gradients through Kascade would be silently wrong."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("Kascade is for inference: gradients through its sparse attention are not supported (run "
                           "the forward under torch.no_grad() or torch.inference_mode(), or disable Kascade)")


def register() -> None:
    """Register the two functions in transformers' registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kascade_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, kascade_mask)


