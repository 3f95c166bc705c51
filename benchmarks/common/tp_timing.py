"""The tensor-parallel benchmark's measurements: prompts, teacher-forced logits, the timing of one mode (TTFT and
ITL), the exchange timed alone, and what a configuration needs (memory, time) before it runs."""

from __future__ import annotations

import statistics
import time

import torch

from .report import T0
from .tp_model import GB, ExchangeCounter, Ranks, free_memory


# -- correctness ---------------------------------------------------------------------------------------------------
def prompt(batch: int, length: int, vocab: int, seed: int, device) -> torch.Tensor:
    from kascade.bench.timing import prompt as bench_prompt

    return bench_prompt(batch, length, vocab, seed, device)


@torch.no_grad()
def forced_logits(model, ids: torch.Tensor, steps: int, feed: torch.Tensor | None = None,
                  counter: ExchangeCounter | None = None) -> tuple[torch.Tensor, list[int]]:
    """``([B, steps + 1, V] fp32 logits on the host, bytes exchanged per forward)``: a prefill of ``ids``, then
    ``steps`` decode steps fed ``feed[:, i]`` (teacher forcing) or, without ``feed``, the greedy token."""
    from transformers import DynamicCache

    from kascade.models import cache_kwargs

    cache = DynamicCache()
    kw = cache_kwargs(model, cache)
    exchanged = []

    def forward(x, **extra):
        if counter is not None:
            counter.bytes = 0
        out = model(x, use_cache=True, **extra, **kw).logits[:, -1].float().cpu()
        exchanged.append(counter.bytes if counter is not None else 0)
        return out

    rows = [forward(ids, logits_to_keep=1)]
    for i in range(steps):
        nxt = feed[:, i] if feed is not None else rows[-1].argmax(-1)
        rows.append(forward(nxt[:, None].to(ids.device)))
    return torch.stack(rows, 1), exchanged


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Greedy tokens and logits of ``got`` against ``ref`` (both ``[B, S, V]``)."""
    diff = (got - ref).abs()
    want, have = ref.argmax(-1), got.argmax(-1)
    miss = want != have
    # a near-tie: at a differing position the reference's margin between its token and the other is within twice
    # the largest logit difference there (rounding may decide it either way)
    margin = ref.gather(-1, want[..., None])[..., 0] - ref.gather(-1, have[..., None])[..., 0]
    ties = miss & (margin <= 2 * diff.amax(-1))
    top2 = ref.topk(2, -1).values
    return dict(max_logit_diff=float(diff.max()), logit_scale=float(ref.abs().max()),
                tokens_equal=not bool(miss.any()), mismatches=int(miss.sum()), near_ties=int(ties.sum()),
                passed=bool((miss == ties).all()), smallest_reference_margin=float((top2[..., 0] - top2[..., 1]).min()),
                reference_tokens=want.tolist(), tokens=have.tolist())


# -- timing ------------------------------------------------------------------------------------------------------
class Clock:
    """Seconds a call takes: CUDA events on CUDA (after a synchronize), perf_counter on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out


def capacity(length: int, args) -> int:
    """Static-cache slots of one timed configuration: the prompt, every decode step, and one spare."""
    return length + max(1, args.warmup_decode_steps) + 1 + args.decode_steps + 1


@torch.no_grad()
def measure_mode(model, ids: torch.Tensor, args, *, use_graph: bool, ranks: Ranks | None,
                 counter: ExchangeCounter | None = None) -> dict:
    """TTFT and ITL of the routing set on ``model`` (see the module docstring). ``ranks``: the tensor-parallel
    ranks (decisions taken by rank 0), or None for a one-device run."""
    from kascade.integration.graphs import GraphDecoder

    dev = ids.device
    B, L = ids.shape
    agree = ranks.agree if ranks is not None else (lambda x: x)
    clock = Clock(dev)
    wall = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    warm = max(1, args.warmup_decode_steps)
    dec = GraphDecoder(model, B, capacity(L, args), use_graph=use_graph, warmup=warm)
    r: dict = {}
    try:
        dec.prefill(ids[:, : min(L, args.warmup_length)])
        times = []
        while True:
            t, first = clock(lambda: dec.prefill(ids))
            times.append(t)
            more = len(times) < args.repeats and (
                args.repeat_budget <= 0 or sum(times) + statistics.mean(times) <= args.repeat_budget)
            if not agree(more):
                break
        r.update(ttft_s=statistics.median(times), ttft_all_s=times, first_token=first[:, 0].tolist())
        for i in range(warm):
            if i == 0 and counter is not None:
                counter.bytes = 0
                with counter.active():
                    dec.step()
                r["exchanged_bytes_first_decode_step"] = counter.bytes
            else:
                dec.step()
        r["decode"] = "graph" if use_graph else "eager"
        if use_graph:
            # capture without replaying, and replay only once every rank has a graph: a replay's collectives
            # would wait forever for a rank whose capture failed
            failed = None
            try:
                dec.capture()
            except Exception as e:  # noqa: BLE001 -- recorded; every rank then decodes eager
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                failed = f"{type(e).__name__}: {e}"[:500]
            why = [w for w in (ranks.gather(failed) if ranks is not None else [failed]) if w]
            if why:
                dec.graph, dec.use_graph = None, False
                torch.cuda.synchronize(dev)
                r.update(decode="eager", graph_error=why[0])
        dec.step()  # the first replay (or one more eager step)
        steps = [clock(dec.step)[0] for _ in range(args.decode_steps)]
        r.update(itl_s=statistics.median(steps), itl_mean_s=statistics.mean(steps), itl_all_s=steps)
    finally:
        dec = None  # the static cache and any graph: freed before the next mode allocates its own
        free_memory(dev)
    r["peak_gb"] = torch.cuda.max_memory_allocated(dev) / GB if dev.type == "cuda" else None
    r["wall_s"] = time.perf_counter() - wall
    return r


@torch.no_grad()
def time_exchange(model, plan, batch: int, keys: int, iters: int, ranks: Ranks) -> dict:
    """One decode step's exchange timed alone: per anchor, an all-gather of a ``[B, H / ranks, 1, k]`` int64
    selection (random indices, the decode shape of a static cache of ``keys`` slots), ``iters`` steps back to back;
    mean seconds per step."""
    from kascade.integration.hf import attention_modules
    from kascade.ops import Selection
    from kascade.tensor_parallel import gather_heads, head_shard, selection_shape

    fp = plan.fingerprint
    shard = head_shard(attention_modules(model), fp.num_kv_heads, fp.head_dim)
    dev = next(model.parameters()).device
    sels, received = [], 0
    g = torch.Generator(device=dev).manual_seed(0)
    for a in plan.anchors:
        rows, width = selection_shape(plan.budget, keys, 1, plan.rank_factor(a) if plan.ranked else None)
        idx = torch.randint(0, keys, (batch, shard.count, rows, width), generator=g, device=dev, dtype=torch.int64)
        sels.append(Selection(idx, torch.zeros(batch, dtype=torch.long, device=dev), plan.tile, True))
        received += (shard.size - 1) * idx.numel() * idx.element_size()

    def step():
        for s in sels:
            gather_heads(s, shard)

    for _ in range(3):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ranks.barrier()  # both ranks start the timed steps together
    t, _ = Clock(dev)(lambda: [step() for _ in range(iters)])
    return dict(seconds_per_step=t / iters, bytes_received_per_step=received, iters=iters,
                effective_gbps=received / (t / iters) / 1e9 if t > 0 else None)


# -- memory and time ---------------------------------------------------------------------------------------------
def estimate_gb(cfg: dict, plan, *, weights: int, batch: int, length: int, args, device: torch.device,
                world: int = 1) -> float:
    """Estimated peak GB of one configuration on one device (a tensor-parallel rank: its share of the heads and
    of the MLP width; the model's vocabulary and hidden size whole), from ``kascade.bench.memory``."""
    from transformers import LlamaConfig

    from kascade.bench.memory import estimate_bytes
    from kascade.bench.settings import Settings

    shard = dict(cfg)
    if world > 1:
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            shard[key] = cfg[key] // world
    settings = Settings(lengths=(length,), batches=(batch,), decode_steps=args.decode_steps + 2,
                        warmup_decode_steps=max(1, args.warmup_decode_steps), decode=decode_kind(args, device),
                        device=device.type, time_budget_s=None)
    est = estimate_bytes(LlamaConfig(**shard), plan, weights=weights, batch=batch, length=length, settings=settings)
    return est["total"] / GB


def device_gb(args, device: torch.device) -> float | None:
    if args.memory_limit_gb is not None:
        return args.memory_limit_gb
    if device.type != "cuda":
        return None
    free_memory(device)
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_allocated(device)) / GB


def decode_kind(args, device: torch.device) -> str:
    if args.decode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if args.decode == "graph" and device.type != "cuda":
        raise SystemExit("--decode graph needs CUDA")
    return args.decode


def cost(batch: int, length: int) -> float:
    """Relative work of a configuration: linear in the tokens, plus attention's quadratic part (at Llama-3.1-8B
    shapes on an H200 attention is ~70% of dense prefill at 128K: the two are equal near 56K)."""
    return batch * length * (1 + length / 57344)


def predict_s(done: list[dict], batch: int, length: int, args) -> float | None:
    """A rough prediction of a configuration's wall time from the last one measured in the same setup: each mode's
    prefill scaled by :func:`cost`, repeated as --repeats and --repeat-budget allow (plus the short warm-up
    prefill), and the rest of its time (decode steps, capture) scaled by the batch."""
    if not done:
        return None
    last = done[-1]
    scale = cost(batch, length) / cost(last["batch"], last["length"])
    warm_then = min(1.0, args.warmup_length / last["length"])
    warm_now = min(1.0, args.warmup_length / length)
    total = 0.0
    for r in last["modes"].values():
        ttft = r["ttft_s"] * scale
        reps = args.repeats if args.repeat_budget <= 0 else max(1, min(args.repeats, int(args.repeat_budget // ttft)))
        rest = max(0.0, r["wall_s"] - r["ttft_s"] * (len(r["ttft_all_s"]) + warm_then))
        total += ttft * (reps + warm_now) + rest * batch / last["batch"]
    return total


def skip_reason(need_gb: float, have_gb: float | None, predicted: float | None, args) -> str | None:
    if have_gb is not None and need_gb > have_gb:
        return f"needs ~{need_gb:.1f} GB per device (estimate), {have_gb:.1f} GB there"
    if args.time_budget is not None:
        left = args.time_budget - (time.perf_counter() - T0)
        if left <= 0:
            return "--time-budget spent"
        if predicted is not None and predicted > left:
            return f"predicted ~{predicted:.0f} s, {left:.0f} s left of --time-budget"
    return None
