"""Timing one configuration of `kascade bench`: the prompt, an eager prefill and greedy decode steps, one mode
(:func:`measure_mode`, or :func:`measure_mode_graph` with CUDA-graph decode steps), the same through transformers'
``generate``, eager or compiled (:func:`measure_generate`), and the modes of a configuration on one model
(:func:`measure_config`: dense, Kascade, no attention) with their ratios."""

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


class StepClock:
    """A stopping criterion of ``generate`` that never stops it and stamps the time at each token it produces: a CUDA
    event recorded on the current stream (no wait for the device), or the host's clock on a CPU (where the host is
    the device). :meth:`begin` stamps the start; ``seconds(i, j)``: from the ``i``-th stamp to the ``j``-th (-1: the
    start; 0: the first token, right after the prefill)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stamps: list = []
        self.origin = None

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def begin(self) -> None:
        self.origin = self._now()

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(self._now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def seconds(self, i: int, j: int) -> float:
        a, b = (self.origin if i == -1 else self.stamps[i]), self.stamps[j]
        if self.cuda:
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


GENERATE_MODES = ("eager", "compiled")


def _generate_kwargs(mode: str, settings: Settings, device) -> dict:
    """``generate``'s arguments of a decode mode: eager (its default cache, a DynamicCache; chunked prefill with the
    settings' chunk), or compiled (a static cache and transformers' compile config: fullgraph, ``mode=
    "reduce-overhead"`` on CUDA, i.e. a CUDA graph per step)."""
    if mode == "eager":
        kw = dict(disable_compile=True)
        if settings.prefill_chunk:
            kw["prefill_chunk_size"] = settings.prefill_chunk
        return kw
    from transformers import CompileConfig

    cuda = torch.device(device).type == "cuda"
    cc = CompileConfig(fullgraph=True, backend=settings.compile_backend, mode="reduce-overhead" if cuda else None)
    cc._compile_all_devices = True  # transformers compiles by itself on GPUs only
    return dict(cache_implementation="static", compile_config=cc)


def _fresh_compile(model) -> None:
    """Forget what an earlier ``generate`` left on the model: its compiled forward (a fresh one compiles this
    configuration's shapes as static ones) and its static cache's length (which would otherwise size this one's)."""
    import torch._dynamo

    for name in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
        model.__dict__.pop(name, None)
    torch._dynamo.reset()


@torch.no_grad()
def measure_generate(model, ids, settings: Settings, mode: str) -> dict:
    """The attention implementation currently set on ``model``, through ``generate`` in decode ``mode`` ("eager" or
    "compiled"), from per-token stamps (:class:`StepClock`) of ``repeats`` runs after one untimed run of the same
    length (which compiles and captures): TTFT from the start to the first token (the prefill and its sampling;
    median), ITL the mean step over ``decode_steps`` steps after ``warmup_decode_steps`` (at least 2) untimed ones
    (the last run). On a GPU the stamps are CUDA events: the device's time between them, so the host's time shows
    where the host sets the pace and the device's where the device does."""
    dev = ids.device
    _peak_reset(dev)
    _fresh_compile(model)
    warm = max(2, settings.warmup_decode_steps)
    n = 1 + warm + settings.decode_steps
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=n,
              min_new_tokens=n, **_generate_kwargs(mode, settings, dev))
    model.generate(ids, **kw)  # compiles, captures, warms every path
    ttft = []
    for _ in range(settings.repeats):
        clock = StepClock(dev)
        _sync(dev)
        clock.begin()
        out = model.generate(ids, stopping_criteria=[clock], **kw)
        ttft.append(clock.seconds(-1, 0))
    itl = clock.seconds(warm, warm + settings.decode_steps) / settings.decode_steps
    r = dict(ttft_s=statistics.median(ttft), ttft_all_s=ttft, itl_s=itl, peak_gb=_peak(dev),
             first_token=out[:, ids.shape[1]].tolist())
    _fresh_compile(model)
    return r


def measure_generate_modes(model, plan: KascadePlan, ids, settings: Settings) -> dict:
    """Dense and Kascade through ``generate`` in every decode mode of ``settings.generate``: ``{mode: {"dense":
    ..., "kascade": ..., "ttft_speedup", "itl_speedup", "first_token_agreement"}}``."""
    out = {}
    for mode in settings.generate:
        r = {"dense": measure_generate(model, ids, settings, mode)}
        with enable(model, plan, backend=settings.backend, warn_uncalibrated=False) as h:
            r["kascade"] = measure_generate(model, ids, settings, mode)
            r["kascade"]["backend"] = getattr(h.runtime, "backend", settings.backend)
        d, k = r["dense"], r["kascade"]
        r.update(ttft_speedup=d["ttft_s"] / k["ttft_s"], itl_speedup=d["itl_s"] / k["itl_s"],
                 first_token_agreement=sum(a == b for a, b in zip(d["first_token"], k["first_token"]))
                 / len(d["first_token"]))
        out[mode] = r
    return out


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
    out = summarize(dict(res))
    if settings.generate:
        t0 = time.perf_counter()
        out["generate"] = measure_generate_modes(model, plan, ids, settings)
        out["generate_wall_s"] = time.perf_counter() - t0
    return out


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

