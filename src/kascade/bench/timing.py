"""Timing one configuration of `kascade bench`: the prompt, an eager prefill and greedy decode steps, one mode
(:func:`measure_mode`, or :func:`measure_mode_graph` with CUDA-graph decode steps), and the three modes of a
configuration on one model (:func:`measure_config`: dense, Kascade, no attention) with their ratios."""

from __future__ import annotations

import statistics
import time

import torch

from ..integration.graphs import GraphDecoder, enable_dense
from ..integration.hf import attach, enable
from ..integration.runtime import NoAttention
from ..models import cache_kwargs
from ..plan import KascadePlan
from .settings import GB, Settings


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt(batch: int, length: int, vocab: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(3, vocab - 1), vocab, (batch, length), generator=g).to(device)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int):
    """``(cache, next token [B], last logits [B, V], seconds)``: the prompt through a fresh DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    step = chunk or ids.shape[1]
    _sync(ids.device)
    t0 = time.perf_counter()
    for i in range(0, ids.shape[1], step):
        out = model(ids[:, i : i + step], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    logits = out.logits[:, -1]
    nxt = logits.argmax(-1)
    _sync(ids.device)
    return cache, nxt, logits, time.perf_counter() - t0


@torch.no_grad()
def decode(model, cache, nxt: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """``(mean seconds per greedy decode step (eager), last token [B])``."""
    _sync(nxt.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(nxt[:, None], use_cache=True, **cache_kwargs(model, cache))
        nxt = out.logits[:, -1].argmax(-1)
    _sync(nxt.device)
    return (time.perf_counter() - t0) / steps, nxt


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def measure_mode(model, ids, settings: Settings, *, warmup: bool) -> dict:
    """One mode (the attention implementation currently set on ``model``): TTFT, ITL, peak memory."""
    dev = ids.device
    _peak_reset(dev)
    if warmup:
        cache, nxt, _, _ = prefill(model, ids, settings.prefill_chunk)
        del cache, nxt
    times = []
    for _ in range(settings.repeats):
        cache = None  # free the previous repeat's cache before the next prefill allocates its own
        cache, nxt, logits, t = prefill(model, ids, settings.prefill_chunk)
        times.append(t)
    first = nxt
    if settings.warmup_decode_steps:  # untimed: first-call costs of the decode path stay out of the ITL
        _, nxt = decode(model, cache, nxt, settings.warmup_decode_steps)
    itl, _ = decode(model, cache, nxt, settings.decode_steps)
    r = dict(ttft_s=statistics.median(times), ttft_all_s=times, itl_s=itl, peak_gb=_peak(dev),
             first_token=first.tolist(), last_logits=logits.float().cpu())
    del cache
    return r


@torch.no_grad()
def measure_mode_graph(model, ids, settings: Settings, *, warmup: bool) -> dict:
    """:func:`measure_mode` with a static cache and CUDA-graph decode steps (:class:`GraphDecoder`)."""
    dev = ids.device
    _peak_reset(dev)
    B, L = ids.shape
    dec = GraphDecoder(model, B, L + settings.warmup_decode_steps + settings.decode_steps + 2,
                       warmup=max(1, settings.warmup_decode_steps))
    if warmup:
        dec.prefill(ids)
    times = []
    for _ in range(settings.repeats):
        _sync(dev)
        t0 = time.perf_counter()
        first = dec.prefill(ids)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    logits = dec.last_logits
    for _ in range(max(1, settings.warmup_decode_steps) + 1):  # eager steps, then the capture and a first replay
        dec.step()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(settings.decode_steps):
        dec.step()
    _sync(dev)
    itl = (time.perf_counter() - t0) / settings.decode_steps
    r = dict(ttft_s=statistics.median(times), ttft_all_s=times, itl_s=itl, peak_gb=_peak(dev),
             first_token=first[:, 0].tolist(), last_logits=logits.float().cpu())
    del dec
    return r


def measure_config(model, plan: KascadePlan, *, batch: int, length: int, settings: Settings,
                   partial: dict | None = None) -> dict:
    """Dense, Kascade and no-attention measurements of one (batch, length) on ``model``. Each finished mode is
    also put in ``partial`` at once, so that a caller catching an error midway keeps it."""
    dev = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = prompt(batch, length, vocab, settings.seed, dev)
    res: dict = {} if partial is None else partial
    graph = settings.decode == "graph"
    measure = measure_mode_graph if graph else measure_mode
    if graph:
        with enable_dense(model):
            res["dense"] = measure(model, ids, settings, warmup=True)
    else:
        res["dense"] = measure(model, ids, settings, warmup=True)
    with enable(model, plan, backend=settings.backend, warn_uncalibrated=False) as h:
        res["kascade"] = measure(model, ids, settings, warmup=True)
        res["kascade"]["backend"] = getattr(h.runtime, "backend", settings.backend)
    with attach(model, NoAttention()):
        res["noattn"] = measure(model, ids, settings, warmup=False)
    return summarize(dict(res))


def summarize(res: dict) -> dict:
    """Ratios and attention shares from the recorded timings (the last-position logits are reduced to checks)."""
    out = {m: dict(r) for m, r in res.items()}
    d, k, n = out["dense"], out["kascade"], out["noattn"]
    out["ttft_speedup"] = d["ttft_s"] / k["ttft_s"]
    out["itl_speedup"] = d["itl_s"] / k["itl_s"]
    out["attn_share_prefill"] = 1.0 - n["ttft_s"] / d["ttft_s"]
    out["attn_share_decode"] = 1.0 - n["itl_s"] / d["itl_s"]
    out["peak_ratio"] = (k["peak_gb"] / d["peak_gb"]) if d["peak_gb"] else None
    dl, kl, nl = d.pop("last_logits"), k.pop("last_logits"), n.pop("last_logits")
    # checks that the modes really differ: zeros for attention must change the logits; Kascade should not much
    out["noattn_logits_max_diff"] = float((dl - nl).abs().max())
    out["kascade_logits_max_diff"] = float((dl - kl).abs().max())
    out["kascade_first_token_agreement"] = sum(a == b for a, b in zip(d["first_token"], k["first_token"])) / len(
        d["first_token"])
    return out

