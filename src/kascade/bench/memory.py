"""Whether a configuration of `kascade bench` can run: its peak memory (:func:`estimate_bytes`, an upper bound for
each of the three modes), the memory available (:func:`available_bytes`), its predicted wall time
(:func:`predict_seconds`), and the reason to skip it (:func:`skip_reason`)."""

from __future__ import annotations

import gc
import math

import torch

from ..ops.reference import _CHUNK_ELEMS
from ..plan import KascadePlan, ModelFingerprint
from .settings import GB, Settings


# What the Triton prefill selection may add (``select_prefill``'s ``max_chunk_bytes``: its score buffer and the
# top-k temporaries; :mod:`kascade.ops.triton.prefill` is not imported for it, since that imports triton).
TRITON_SELECT_SCRATCH = 64 << 20


def estimate_bytes(config, plan: KascadePlan, *, weights: int, batch: int, length: int, settings: Settings,
                   backend: str | None = None) -> dict:
    """An upper bound on the peak memory of one configuration, in bytes, term by term.

    The three modes run one after the other and each frees what it made, so the bound (``counted``) is what they
    all hold (``weights``, the KV cache, its growth, one prefill chunk's activations, the logits) plus the largest
    of what one mode adds on top (``dense``, ``kascade``, ``noattn``). ``total`` adds a margin for the allocator's
    rounding and fragmentation and the libraries' workspaces: ``1.15 * counted + 0.5 GB``. ``backend``: the one
    Kascade runs on ("reference" | "triton"; None: "reference" when settings say so or off CUDA, else "triton").
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    fp = ModelFingerprint.from_config(cfg)
    nbytes = torch.finfo(settings.dtype).bits // 8
    B, L, H, HQ, D = batch, length, fp.num_kv_heads, fp.num_q_heads, fp.head_dim
    graph = settings.decode == "graph"
    if backend is None:
        cuda = torch.device(settings.device).type == "cuda"
        backend = "reference" if settings.backend == "reference" or not cuda else "triton"
    # the prompt and every decode step; GraphDecoder's static cache has two slots more
    # (generate: at least 2 warm-up steps, and one step more than asked for, its deferred stop check's)
    warm = max(settings.warmup_decode_steps, 2) if settings.generate else settings.warmup_decode_steps
    slots = L + warm + settings.decode_steps + (2 if graph or settings.generate else 0)
    layer_kv = B * slots * 2 * H * D * nbytes
    kv = fp.num_layers * layer_kv
    # a DynamicCache (eager decoding, eager generate) grows by torch.cat: for a moment a layer's longer K and V sit
    # next to the previous ones
    growth = 0 if graph and "eager" not in settings.generate else layer_kv
    chunk = min(settings.prefill_chunk or L, L)
    hidden, inter = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    q_dim, kv_dim = HQ * D, H * D
    # the attention phase: residual, norm, q / k / v, RoPE's temporaries, the attention output and its transposed
    # copy (any mode's: SDPA's, Kascade's or the zeros of the no-attention mode); the MLP: act, up, product in flight
    phases = max(3 * inter + 3 * hidden, 6 * hidden + 3 * q_dim + 4 * kv_dim)
    per_token = nbytes * phases + 4 * 2 * hidden  # + RMSNorm's fp32 upcast
    act = B * chunk * per_token
    logits = B * cfg.vocab_size * 4 * 2  # the last position only (logits_to_keep=1; a decode step has one)

    # dense: a chunk after the first attends through an explicit mask: transformers builds a boolean [B, 1, chunk, N]
    # one (N <= L keys), SDPA turns it into an additive one in the model's dtype, which the memory-efficient kernel
    # pads to a multiple of 16 keys (a second copy where N is not one), and with a mask transformers repeats K and V
    # to the query heads (repeat_kv). Graph mode: DenseRuntime's cuDNN prefill repeats K and V the same way.
    repeat_kv = 2 * B * HQ * L * D * nbytes if HQ != H else 0
    if not graph and chunk < L:
        copies = 2 if chunk % 16 or L % 16 else 1
        dense = B * chunk * L + copies * B * chunk * (-(-L // 16) * 16) * nbytes + repeat_kv
    else:
        dense = repeat_kv if graph else 0

    # Kascade: the selections held at once ([B, H, rows, k] each: the anchors later layers still read, and on the
    # reference a reuse layer's copy through its head map; the Triton kernels read the map in place), int32 from the
    # Triton kernels plus their scratch (the LSE and the scoring buffer); the reference's are int64 with two more
    # copies while an anchor selects (per sequence, then stacked: at most twice what is held), plus its fp32 math
    # (_reference_scratch)
    sel = max(_selection_elems(p, B, L, chunk, remapped=backend != "triton")
              for p in (plan, *(p for _, p in plan.by_length)))
    if backend == "triton":
        kascade = 4 * sel + 4 * B * HQ * chunk + TRITON_SELECT_SCRATCH
    else:
        kascade = 8 * sel * 3 + _reference_scratch(fp, plan, B, L, chunk, nbytes)
    noattn = 0  # zeros where the attention output would be (counted in the activations)
    counted = weights + kv + growth + act + logits + max(dense, kascade, noattn)
    return dict(total=1.15 * counted + 0.5 * GB, counted=counted, weights=weights, kv_cache=kv, cache_growth=growth,
                activations=act, logits=logits, dense=dense, kascade=kascade, noattn=noattn)


def _selection_elems(plan: KascadePlan, batch: int, length: int, chunk: int, remapped: bool = True) -> int:
    """Entries of the selections Kascade's runtime holds at once in a prefill chunk of ``plan`` (before a layer runs
    it drops the selections no later layer reads): the most anchors still read at any layer, plus (``remapped``) a
    reuse layer's copy through its head map, each ``[B, H, rows, width]`` with ``width`` the budget ``k(L)`` as deep as
    ranked anchors keep it."""
    live = max(sum(1 for a in plan.anchors if a <= layer <= plan.last_reader(a)) for layer in range(plan.num_layers))
    rank_factor = max(plan.rank_factor(a) for a in plan.anchors) if plan.ranked else 1.0
    rows = -(-chunk // plan.tile) + 1  # a chunk that starts inside a tile has one row more
    width = math.ceil(plan.budget.k(length) * rank_factor)
    return (live + remapped) * batch * plan.fingerprint.num_kv_heads * rows * width


def _reference_scratch(fp: ModelFingerprint, plan: KascadePlan, batch: int, length: int, chunk: int,
                       nbytes: int) -> int:
    """fp32 bytes the reference backend (:mod:`kascade.ops.reference`) allocates in a layer on top of the model's
    own tensors: up to four score temporaries at once, bounded by ``_CHUNK_ELEMS`` (scores, their softmax, a
    sliced copy for the product with V, the pooled rows), the gathered K and V rows of a chunk of tiles, one
    sequence's q, k, v upcast (none in fp32), and the fp32 outputs of the batch and of one sequence."""
    HQ, H, D, T = fp.num_q_heads, fp.num_kv_heads, fp.head_dim, plan.tile
    scores = min(_CHUNK_ELEMS, HQ * (chunk + T) * (length + T))
    gathered = 2 * H * D * min(_CHUNK_ELEMS // (HQ * T), (-(-chunk // T) + 1) * plan.budget.k(length))
    upcast = (HQ * chunk + 2 * H * length) * D if nbytes != 4 else 0
    outputs = (batch + 1) * HQ * chunk * D
    return 4 * (4 * scores + gathered + upcast + outputs)


def available_bytes(model, settings: Settings) -> float | None:
    """Memory this configuration may use (weights included), or None when unknown (CPU without a limit)."""
    if settings.memory_limit_gb is not None:
        return settings.memory_limit_gb * GB
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_allocated(dev)


def predict_seconds(done: list[dict], batch: int, length: int, settings: Settings | None = None) -> float | None:
    """A configuration's wall time, estimated from the last one measured on the same model (meant to err high).

    The timed work of that configuration (every mode's prefills and decode steps, from its own measurements) is
    scaled: a prefill's attention share (measured: 1 - no-attention / dense) quadratically in the length and the rest
    linearly, a decode step linearly; all of it linearly in the batch. The rest of its wall time (compilation, graph
    capture, allocation: the first configuration of a run pays most of it) is counted once, unscaled. Without the
    measurements (or ``settings``) the bound is the wall time scaled by ``max(r, r**2)`` and the batch."""
    if not done:
        return None
    p = done[-1]
    r, rb = length / p["length"], batch / p["batch"]
    modes = ("dense", "kascade", "noattn")
    if settings is None or not all(isinstance(p.get(m), dict) and "ttft_s" in p[m] and "itl_s" in p[m]
                                   for m in modes):
        return p["wall_s"] * rb * max(r, r * r)
    prefills = {"dense": settings.repeats + 1, "kascade": settings.repeats + 1, "noattn": settings.repeats}
    steps = settings.decode_steps + settings.warmup_decode_steps + 2
    a = min(1.0, max(0.0, p.get("attn_share_prefill", 1.0)))
    grow = max(r, (1 - a) * r + a * r * r)  # a shorter prefill shrinks at most linearly
    t_prefill = sum(prefills[m] * p[m]["ttft_s"] for m in modes)
    t_decode = sum(steps * p[m]["itl_s"] for m in modes)
    t_generate = p.get("generate_wall_s", 0.0)  # its prefills, compilations and steps: scaled as a prefill is
    fixed = max(0.0, p["wall_s"] - t_prefill - t_decode - t_generate)
    return fixed + rb * ((t_prefill + t_generate) * grow + t_decode * max(r, 1.0))  # a shorter decode step: not
    # predicted cheaper


def skip_reason(need: float, avail: float | None, predicted: float | None, left: float | None,
                settings: Settings) -> str | None:
    """Why a configuration needing ``need`` bytes and predicted to take ``predicted`` seconds is not run (``avail``
    bytes free, ``left`` seconds of the time budget left; None: unknown), or None to run it."""
    if avail is not None and need > avail:
        hint = "" if settings.prefill_chunk else " (try --prefill-chunk)"
        return f"needs ~{need / GB:.1f} GB, {avail / GB:.1f} GB free{hint}"
    if left is not None and predicted is not None and predicted > left:
        return f"predicted ~{predicted:.0f} s, {max(left, 0):.0f} s left of --time-budget"
    return None

