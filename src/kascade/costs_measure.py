"""Measure a cost table on this machine, in the format of the shipped one (:mod:`kascade.costs`).

    measure("my-gpu.json", shape_named("llama-3.1-8b"), modes=("decode",), lengths=(131072,))   # `kascade costs`
    costs.plan_speedup(plan, "decode", table=costs.load_table("my-gpu.json"), length=131072, batch=32)

For every mode, shape, batch and length it times, with the public ops (:mod:`kascade.ops`, one
:func:`~kascade.ops.plan_step` per configuration, as the runtime composes them in :mod:`kascade.attention`):

- ``dense``: the faster of torch's SDPA and ``dense_attention`` (``dense_ours``: ``dense_attention`` alone);
- ``layer0``: the faster of ``dense_select`` and SDPA followed by ``select``;
- ``select``: ``select`` (scoring + top-k); ``anchor``: ``select`` then ``sparse_attention``; ``reuse``:
  ``sparse_attention`` on a selection made beforehand.

Random bf16 inputs on CUDA, timed by ``triton.testing.do_bench`` (median; ops that take over 15 ms: the median of
three CUDA-event timed calls); eager calls, no CUDA graphs. On the CPU: fp32 inputs and the median wall time of a few
calls, for tests only (the table says where it was measured). A configuration that does not fit the free memory
is skipped, and the reason recorded beside the rows. The table is written after every configuration, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import costs, ops
from .budget import Budget
from .plan import ModelFingerprint

DEFAULT_LENGTHS = (8192, 32768, 131072)


def _log(*a):
    print(*a, flush=True)
UNIT = "us"


@dataclass(frozen=True)
class Shape:
    """An attention shape: ``HQ`` query heads, ``H`` KV heads, head dim ``D``."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        # the fingerprint's checks: positive integers, HQ a multiple of H
        ModelFingerprint("shape", 1, self.num_q_heads, self.num_kv_heads, self.head_dim)

    def heads(self) -> dict:
        return dict(num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)


def shape_of(fp: ModelFingerprint) -> Shape:
    """The model's attention shape, named as the shipped shape with the same heads if there is one."""
    s = Shape(f"hq{fp.num_q_heads}-h{fp.num_kv_heads}-d{fp.head_dim}", fp.num_q_heads, fp.num_kv_heads, fp.head_dim)
    same = [n for n, h in costs.shapes().items() if h == s.heads()]
    return Shape(same[0], **s.heads()) if same else s


def shape_named(name: str) -> Shape:
    """A shipped shape's name (``llama-3.1-8b``) or ``HQ,H,D`` (``32,8,128``)."""
    if name in costs.shapes():
        return Shape(name, **costs.shapes()[name])
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*", name)
    if not m:
        raise ValueError(f"shape {name!r}: give one of {', '.join(costs.shapes())} or HQ,H,D (e.g. 32,8,128)")
    return shape_of(ModelFingerprint("shape", 1, *map(int, m.groups())))


def model_shape(path) -> Shape:
    """The attention shape of a local transformers model folder (its config.json; no weights are read)."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"--model {path}: no config.json there (a local transformers model folder is needed; for "
                         "a .gguf file give --shape HQ,H,D)")
    from transformers import AutoConfig

    return shape_of(ModelFingerprint.from_config(AutoConfig.from_pretrained(p, local_files_only=True)))


def check_out(path) -> Path:
    """The output file, checked (and its folder made) before anything is measured: ValueError saying why not."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"--out {path} is a folder; give a file name, e.g. {Path(path) / 'costs.json'}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot make its folder ({e.strerror or e})") from None
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"--out {path}: not writable")
    return p


# ------------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------------
def cuda_us(fn, long_repeats: int = 3) -> float:
    """Median microseconds of ``fn`` on the GPU after a warm-up: ``triton.testing.do_bench`` for ops under 15 ms,
    else the median of ``long_repeats`` CUDA-event timed calls (do_bench would run a long op ~10 times). The
    benchmarks time with it too."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    if one < 15:
        return do_bench(fn, warmup=5 * one + 1, rep=max(20 * one, 10.0), return_mode="median") * 1e3
    ts = []
    for _ in range(long_repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts) * 1e3


def wall_us(fn, repeats: int = 5) -> float:
    """Median wall-clock microseconds of ``repeats`` calls of ``fn`` after a warm-up (CPU timings)."""
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: try, and skip on an out-of-memory error


def needed_bytes(mode: str, shape: Shape, batch: int, length: int, *, budget: Budget, elem: int,
                 backend: str) -> int:
    """A rough upper estimate of one configuration's memory: inputs, output, selection, score buffers."""
    HQ, H, D = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    L = 1 if mode == "decode" else length
    k = int(budget.decode_counts(length))
    rows = 1 if mode == "decode" else -(-length // budget.tile)
    tensors = batch * (2 * HQ * L + 2 * H * length) * D * elem  # q, out, k, v
    if mode == "prefill":
        tensors += 2 * batch * HQ * length * D * elem  # k, v with the heads repeated, for SDPA
    selection = 3 * batch * H * rows * k * 8  # indices and top-k temporaries
    scores = 3 * batch * HQ * L * length * 4 if backend == "reference" else 2 * batch * HQ * length * 4
    return tensors + selection + scores


# ------------------------------------------------------------------------------------------------------------------
# One configuration
# ------------------------------------------------------------------------------------------------------------------
def measure_one(mode: str, shape: Shape, batch: int, length: int, *, budget: Budget, device: torch.device,
                backend: str) -> dict:
    """One row of the table: times in microseconds (module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = cuda_us if device.type == "cuda" else wall_us
    g = torch.Generator(device=device).manual_seed(length)
    L = 1 if mode == "decode" else length
    q = torch.randn(batch, shape.num_q_heads, L, shape.head_dim, generator=g, device=device, dtype=dtype)
    k = torch.randn(batch, shape.num_kv_heads, length, shape.head_dim, generator=g, device=device, dtype=dtype)
    v = torch.randn_like(k)
    step = ops.plan_step(q, k, budget=budget, backend=backend)
    if mode == "decode":  # one query sees every key

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:  # heads repeated, as the prefill benchmark does: SDPA's fused causal kernels then serve every GQA shape
        G = shape.num_q_heads // shape.num_kv_heads
        ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)

        def sdpa():
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

    def anchor():
        return ops.sparse_attention(q, k, v, ops.select(q, k, step=step), step=step)

    t = {"dense_ours": timer(lambda: ops.dense_attention(q, k, v, step=step))}
    try:
        t["sdpa"] = timer(sdpa)
    except (RuntimeError, TypeError):  # no SDPA kernel (or memory) for these inputs: our dense kernel is the baseline
        t["sdpa"] = float("inf")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t["dense"] = min(t["sdpa"], t["dense_ours"])
    t["select"] = timer(lambda: ops.select(q, k, step=step))
    t["layer0"] = timer(lambda: ops.dense_select(q, k, v, step=step))
    if t["sdpa"] < float("inf"):
        t["layer0"] = min(t["layer0"], timer(lambda: (sdpa(), ops.select(q, k, step=step))))
    t["anchor"] = timer(anchor)
    sel = ops.select(q, k, step=step)
    t["reuse"] = timer(lambda: ops.sparse_attention(q, k, v, sel, step=step))
    # timed apart, noise can put the selection above the anchor that includes it (tiny CPU cases)
    t["select"] = min(t["select"], t["anchor"])
    row = dict(shape=shape.name, batch=batch, length=length)
    row.update({f: round(t[f], 3) for f in costs.ROW_FIELDS})
    return row


# ------------------------------------------------------------------------------------------------------------------
# A table
# ------------------------------------------------------------------------------------------------------------------
def device_entry(device: torch.device, backend: str) -> tuple[str, str]:
    """``(key, description)`` of the GPU entry: the device's name as a key (``nvidia-h200``, or ``cpu``) and where,
    with what and how the times were measured."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        try:
            import triton

            tv = f", triton {triton.__version__}"
        except ImportError:
            tv = ""
        what = (f"{name} ({props.multi_processor_count} SMs), torch {torch.__version__}{tv}, CUDA "
                f"{torch.version.cuda}, bf16, backend {backend}")
    else:
        name = "cpu"
        what = (f"CPU ({platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}, fp32, backend "
                f"{backend}: CPU times, for testing only, not a GPU's")
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "gpu", what




def measure(out, shape: Shape, *, modes=costs.MODES, batches=None, lengths=DEFAULT_LENGTHS, ratio: float = 0.1,
            k_min: int = 128, tile: int = 32, device="cuda", backend: str = "auto", log=_log) -> dict:
    """Measure every (mode, batch, length) of ``shape`` and write the table to ``out`` after each one; returns the
    table. ``batches`` default: per mode, :data:`kascade.costs.DEFAULT_BATCH` (decode 32, prefill 1)."""
    out = check_out(out)
    for m in modes:
        costs._check_mode(m)
    budget = Budget(ratio=ratio, k_min=k_min, tile=tile)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = ops.resolve_backend(backend, device, torch.bfloat16, shape.head_dim, shape.num_q_heads // shape.num_kv_heads)
    key, what = device_entry(device, backend)
    day = datetime.date.today().isoformat()
    timing = ("triton.testing.do_bench median, eager calls" if device.type == "cuda"
              else "median wall time of 5 calls after one warm-up")
    entry = {"gpu": what, "device": device.type, "ratio": ratio, "shapes": {shape.name: shape.heads()}}
    for m in modes:
        entry[m] = {"source": f"kascade costs, {day} ({timing}; {budget}): dense = the faster of torch SDPA and "
                    "dense_attention, dense_ours = dense_attention, layer0 = the faster of dense_select and SDPA + "
                    "select, select = select (scoring + top-k), anchor = select + sparse_attention, reuse = "
                    "sparse_attention", "unit": UNIT, "rows": [], "skipped": []}
    table = {"format": costs.FORMAT, key: entry}
    configs = [(m, b, n) for m in modes for b in (batches or [costs.DEFAULT_BATCH[m]]) for n in lengths]
    log(f"measuring {len(configs)} configuration(s) of {shape.name} {shape.heads()} on {what}; writing {out}")
    elem = 2 if device.type == "cuda" else 4
    for i, (m, b, n) in enumerate(configs, 1):
        head = f"[{i}/{len(configs)}] {m} B={b} N={n}:"
        need = needed_bytes(m, shape, b, n, budget=budget, elem=elem, backend=backend)
        free = _free_bytes(device)
        reason = None
        if need > 0.9 * free:
            reason = f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        else:
            try:
                row = measure_one(m, shape, b, n, budget=budget, device=device, backend=backend)
            except (torch.OutOfMemoryError, MemoryError) as e:
                reason = f"out of memory ({str(e).splitlines()[0][:160] if str(e) else 'no details'})"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if reason is None:
            entry[m]["rows"].append(row)
            d = row["dense"]
            log(f"{head} dense {d:.1f} {UNIT} (ours {row['dense_ours']:.1f}); relative to dense: layer 0 "
                f"{row['layer0'] / d:.2f}, select {row['select'] / d:.2f}, anchor {row['anchor'] / d:.2f}, reuse "
                f"{row['reuse'] / d:.2f}")
        else:
            entry[m]["skipped"].append(dict(shape=shape.name, batch=b, length=n, reason=reason))
            log(f"{head} skipped: {reason}")
        write(table, out)
    return table


def write(table: dict, out) -> None:
    """Write ``table`` to ``out`` whole or not at all (a temporary file, then a rename)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, out)
