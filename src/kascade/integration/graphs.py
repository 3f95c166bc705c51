"""Greedy decoding over a static KV cache, each step replayed from a CUDA graph.

Eager decoding through transformers launches every kernel of every layer from Python; at batch 1 the host, not
the GPU, then sets the pace. With a static cache (``transformers.StaticCache``: fixed-size K/V buffers and a
device-side length) one decode step has the same shapes every time, so it can be captured once and replayed.
Kascade's decode step is capturable with the Triton backend: its per-step metadata (valid keys, budget) is
computed on the device (:func:`kascade.ops.plan_step` from device tensors) and no layer reads a value back to the host.
The same decoder serves a dense model, so dense and Kascade are timed the same way.

    dec = GraphDecoder(model, batch_size=1, max_cache_len=prompt_len + 64)
    tokens = dec.generate(input_ids, max_new_tokens=64)      # [B, 64]

The first ``warmup`` generated tokens come from eager steps (they compile kernels and fill caches; a graph is
captured after them), the rest from replays; all of them are real greedy tokens.
"""

from __future__ import annotations

import warnings

import torch

from ..models import cache_kwargs
from .hf import attach
from .runtime import DenseRuntime


def enable_dense(model):
    """Route ``model``'s attention through :class:`~kascade.integration.runtime.DenseRuntime` (the dense baseline
    timed under CUDA graphs; a handle / context manager, like ``enable``)."""
    return attach(model, DenseRuntime())


class GraphDecoder:
    """Greedy generation with a static KV cache; ``use_graph=False`` runs the same steps eagerly (CPU, tests)."""

    def __init__(self, model, batch_size: int, max_cache_len: int, *, use_graph: bool | None = None,
                 warmup: int = 2):
        from transformers import StaticCache

        self.model = model
        self.device = next(model.parameters()).device
        self.use_graph = (self.device.type == "cuda") if use_graph is None else use_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, this one is on {self.device}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (a graph is captured after eager steps), got {warmup}")
        self.batch_size, self.max_cache_len, self.warmup = int(batch_size), int(max_cache_len), int(warmup)
        self.cache = StaticCache(config=model.config, max_cache_len=self.max_cache_len)
        self._cache = cache_kwargs(model, self.cache)
        self.ids = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.device)  # the step's input
        self.graph = None
        self._captured_under = None  # the attention routing the graph was captured under (_routing)
        self.last_logits = None  # the prefill's last-position logits [B, V]
        self.length = 0  # tokens in the cache
        self._eager_steps = 0

    @torch.no_grad()
    def _forward(self) -> None:
        logits = self.model(input_ids=self.ids, use_cache=True, **self._cache).logits
        self.ids.copy_(logits[:, -1].argmax(-1, keepdim=True))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reset the cache, prefill ``input_ids [B, L]`` (eager) and return the first generated token ``[B, 1]``."""
        B, L = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"this decoder was built for batch {self.batch_size}, got input_ids of batch {B}")
        if L + 1 > self.max_cache_len:
            raise ValueError(f"a prompt of {L} tokens leaves no room to decode in a cache of {self.max_cache_len}")
        self.cache.reset()
        logits = self.model(input_ids=input_ids.to(self.device), use_cache=True, logits_to_keep=1,
                            **self._cache).logits
        self.last_logits = logits[:, -1]
        self.ids.copy_(self.last_logits.argmax(-1, keepdim=True))
        self.length = L
        self._eager_steps = 0
        return self.ids.clone()

    def _routing(self):
        """What the model's attention is routed to: its implementation and Kascade's handle (None: not enabled)."""
        return self.model.config.get_text_config()._attn_implementation, getattr(self.model, "_kascade_handle", None)

    def step(self) -> torch.Tensor:
        """One decode step: feeds the last token, returns the next ``[B, 1]`` (a view, overwritten next step)."""
        if self.length == 0:
            raise RuntimeError("call prefill before step")
        if self.length + 1 > self.max_cache_len:
            raise RuntimeError(f"the static cache of {self.max_cache_len} slots is full")
        if self.graph is not None and self._routing() != self._captured_under:
            # A replay would run the kernels of the routing it was captured under, over buffers that routing may
            # have freed: capture again (after eager steps) under the routing the model has now.
            warnings.warn("the model's attention routing changed since this decoder captured its CUDA graph "
                          "(Kascade enabled, disabled or re-enabled); capturing a new graph", stacklevel=2)
            self.graph, self._captured_under, self._eager_steps = None, None, 0
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graph and self._eager_steps >= self.warmup:
            self.capture()
            self.graph.replay()
        else:
            self._forward()
            self._eager_steps += 1
        self.length += 1
        return self.ids

    def capture(self) -> None:
        """Capture the decode step's CUDA graph now, without replaying it (``step`` captures by itself after the
        warm-up steps; calling this first lets, e.g., tensor-parallel ranks all capture before any replays, since a
        replay's collectives would wait for a rank whose capture failed)."""
        if not self.use_graph:
            raise RuntimeError("this decoder runs eagerly (use_graph=False): nothing to capture")
        if self.length == 0:
            raise RuntimeError("call prefill (and a warm-up step) before capture")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward()  # recorded, not run: the cache does not advance here
        # holding the routing (Kascade's handle, hence its runtime) keeps alive what the graph reads
        self.graph, self._captured_under = graph, self._routing()

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens ``[B, max_new_tokens]`` after ``input_ids``."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        out = [self.prefill(input_ids)]
        for _ in range(max_new_tokens - 1):
            out.append(self.step().clone())
        return torch.cat(out, 1)
