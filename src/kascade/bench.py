"""`kascade bench`: end-to-end time to first token and inter-token latency, dense vs Kascade, in one run.

For each model, batch size ``B`` and prompt length ``L`` (a *configuration*), on the same weights and the same
random prompt (token ids drawn from a seeded generator):

- **dense**: eager decoding: the model's own attention implementation (transformers' SDPA unless the model says
  otherwise); graph decoding: :class:`~kascade.integration.graphs.DenseRuntime` (PyTorch SDPA with cuDNN attention
  first in priority for the prefill, Kascade's dense split-K Triton kernel for decode steps);
- **kascade**: ``kascade.enable(model, plan, backend=...)``;
- **no-attn**: a temporary attention implementation that returns zeros of the right shape, so that
  ``1 - t_noattn / t_dense`` is the share of the dense time spent in attention (prefill and decode).

``decode="graph"`` (the default on CUDA): the prompt is prefilled into a ``StaticCache`` and every decode step is
one CUDA-graph replay (:class:`~kascade.integration.graphs.GraphDecoder`), how serving engines decode;
``decode="eager"``: a ``DynamicCache`` and one Python-driven forward per step (at batch 1 the host then sets the
pace). TTFT = the prompt through the model (``logits_to_keep=1``; eager mode: optionally in chunks of
``prefill_chunk`` tokens) plus the argmax, synchronised before and after, median of ``repeats`` after one warm-up
prefill (dense and Kascade; the no-attention mode reuses dense's warmed-up kernels).
ITL = mean time of ``decode_steps`` greedy steps after the last timed prefill and ``warmup_decode_steps`` untimed
ones (graph mode: the eager steps before the capture, then the capture itself).
Peak memory = ``torch.cuda.max_memory_allocated`` per mode (weights included), reset before each mode.

Before a configuration runs, its memory (weights + KV cache + prefill activations + Kascade's selections) is
estimated and the configuration is skipped with the reason when it cannot fit; so is one predicted to overrun the
time budget. Out-of-memory errors are caught per configuration and recorded. Results are rewritten after every
configuration (``bench.json``, ``bench.md``, ``bench.png``), so a run cut short keeps what it finished.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .integration.graphs import GraphDecoder, enable_dense
from .integration.hf import enable
from .plan import KascadePlan, ModelFingerprint, default_plan

NOATTN_NAME = "kascade_bench_noattn"
MODELS = ("default", "llama8b", "tiny")
GB = 1024**3

# Llama-3.1-8B's shapes (random weights: nothing is downloaded).
LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA8B_ANCHORS = 5
# A tiny random Llama for tests and dry runs of the command.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
TINY_ANCHORS = 2


@dataclass(frozen=True)
class Settings:
    """What every configuration is measured with (see ``kascade bench --help``)."""

    lengths: tuple[int, ...] = (32768, 65536, 131072)
    batches: tuple[int, ...] = (1, 8)
    repeats: int = 1
    decode_steps: int = 16
    warmup_decode_steps: int | None = None  # None: 2 in graph mode, 16 eager (kernels specialise on N % 16)
    prefill_chunk: int = 0  # 0: the whole prompt in one forward
    backend: str = "auto"
    decode: str | None = None  # "graph" | "eager"; None: graph on CUDA (without prefill_chunk), else eager
    seed: int = 0
    device: str = "cpu"
    memory_limit_gb: float | None = None  # None: the device's free memory (no check on CPU)
    time_budget_s: float | None = 480.0

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))
        object.__setattr__(self, "batches", tuple(int(x) for x in self.batches))
        for name in ("lengths", "batches"):
            vals = getattr(self, name)
            if not vals or any(v < 1 for v in vals):
                raise ValueError(f"{name} must be positive integers, got {list(vals)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.decode is None:
            cuda = torch.device(self.device).type == "cuda"
            object.__setattr__(self, "decode", "graph" if cuda and not self.prefill_chunk else "eager")
        if self.decode not in ("graph", "eager"):
            raise ValueError(f"decode must be 'graph' or 'eager', got {self.decode!r}")
        if self.decode == "graph" and torch.device(self.device).type != "cuda":
            raise ValueError("decode='graph' (CUDA graphs) needs a CUDA device; use decode='eager'")
        if self.decode == "graph" and self.prefill_chunk:
            raise ValueError("--prefill-chunk needs --decode eager (graph decoding prefills into a static cache)")
        if self.warmup_decode_steps is None:
            object.__setattr__(self, "warmup_decode_steps", 2 if self.decode == "graph" else 16)
        if self.warmup_decode_steps < 0 or self.prefill_chunk < 0:
            raise ValueError("warmup_decode_steps and prefill_chunk must be >= 0")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ValueError(f"memory_limit_gb must be positive, got {self.memory_limit_gb}")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.device == "cpu" else torch.bfloat16


# -- models ------------------------------------------------------------------------------------------------------
def random_llama(overrides: dict, *, device: str, dtype: torch.dtype, max_positions: int):
    """A randomly initialised LlamaForCausalLM built directly on ``device`` in ``dtype`` (no fp32 CPU detour: at 8B
    parameters that would take minutes and 32 GB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**overrides, max_position_embeddings=max_positions)
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    if any(p.dtype != dtype for p in model.parameters()):
        raise RuntimeError(f"random_llama: parameters were not built in {dtype}")
    return model.eval()  # no .to(dtype): it would round RoPE's fp32 inv_freq buffer as well


def _fingerprint(overrides: dict) -> ModelFingerprint:
    from transformers import LlamaConfig

    return ModelFingerprint.from_config(LlamaConfig(**overrides))


def plan_for(name: str, model, plan: KascadePlan | None) -> KascadePlan:
    """The user's plan (checked against the model), else: the shipped plan for ``default``, uniform otherwise."""
    if plan is not None:
        plan.check_model(model)
        return plan
    fp = ModelFingerprint.from_model(model)
    if name == "llama8b":
        return KascadePlan.uniform(fp, LLAMA8B_ANCHORS)
    if name == "tiny":
        return KascadePlan.uniform(fp, TINY_ANCHORS)
    return default_plan(model)


def check_plan(names, plan: KascadePlan | None) -> None:
    """Fail before any work if ``plan`` cannot serve a random model (``default`` is checked once it is loaded)."""
    if plan is None:
        return
    for name in names:
        if name in ("llama8b", "tiny"):
            diffs = plan.fingerprint.differences(_fingerprint(LLAMA8B if name == "llama8b" else TINY))
            if diffs:
                raise ValueError(f"--plan was made for another model than {name!r}: " + "; ".join(diffs))


def load(name: str, settings: Settings, model_path=None):
    """``(model, description)`` for a model name of :data:`MODELS`."""
    longest = max(settings.lengths) + settings.decode_steps + settings.warmup_decode_steps + 1
    if name == "llama8b":
        model = random_llama(LLAMA8B, device=settings.device, dtype=settings.dtype,
                             max_positions=max(131072, longest))
        return model, "Llama-3.1-8B shapes, random weights"
    if name == "tiny":
        model = random_llama(TINY, device=settings.device, dtype=settings.dtype, max_positions=max(1024, longest))
        return model, "tiny random Llama (tests)"
    if name == "default":
        from .models import load_model

        model, _ = load_model(model_path, device=settings.device, dtype=settings.dtype)
        desc = "SmolLM2-135M-Instruct (embedded default)" if model_path is None else str(model_path)
        return model, desc
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


# -- the no-op attention -----------------------------------------------------------------------------------------
def _noattn_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Zeros in the layout attention functions return: ``[B, L, HQ, D]``."""
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None


def _noattn_mask(*args, **kwargs):
    return None  # no mask is needed, and building a 4-D one at 128K would dominate the timing


class NoAttention:
    """``with NoAttention(model):`` attention outputs are zeros; the previous implementation is restored after."""

    def __init__(self, model):
        self.model = model
        self.previous = None

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NOATTN_NAME, _noattn_forward)
        AttentionMaskInterface.register(NOATTN_NAME, _noattn_mask)
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(NOATTN_NAME)
        if self.model.config._attn_implementation != NOATTN_NAME:
            self.model.set_attn_implementation(self.previous)
            raise ValueError(f"{type(self.model).__name__} refused the no-op attention implementation")
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.previous)


# -- timing ------------------------------------------------------------------------------------------------------
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
        out = model(ids[:, i : i + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
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
        out = model(nxt[:, None], past_key_values=cache, use_cache=True)
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
    with NoAttention(model):
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


# -- memory and time predictions ---------------------------------------------------------------------------------
def estimate_bytes(config, plan: KascadePlan, *, weights: int, batch: int, length: int, settings: Settings) -> dict:
    """Rough peak memory of one configuration: ``weights`` bytes + KV cache + one prefill chunk's activations (the
    larger of the attention and the MLP phase) + Kascade's selection of that chunk (``[B, H, tiles, k]``, one anchor's
    at a time, twice for a remapped copy). Logits are kept for the last position only."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    fp = ModelFingerprint.from_config(cfg)
    nbytes = torch.finfo(settings.dtype).bits // 8
    n_total = length + settings.decode_steps + settings.warmup_decode_steps
    kv = batch * n_total * fp.num_layers * 2 * fp.num_kv_heads * fp.head_dim * nbytes
    chunk = min(settings.prefill_chunk or length, length)
    hidden, inter = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    q_dim, kv_dim = fp.num_q_heads * fp.head_dim, fp.num_kv_heads * fp.head_dim
    phases = max(3 * inter + 3 * hidden, 6 * hidden + 3 * q_dim + 4 * kv_dim)  # MLP: act, up, product in flight
    per_token = nbytes * phases + 4 * 2 * hidden  # + RMSNorm's fp32 upcast
    act = batch * chunk * per_token
    logits = batch * cfg.vocab_size * 4 * 2
    tiles = math.ceil(chunk / plan.tile)
    # the runtime holds one anchor's selection at a time (int32 from the Triton kernels, int64 from the
    # reference); counted twice for the remapped copy a reuse layer makes through a non-identity head map
    isize = 4 if settings.backend != "reference" else 8
    sel = batch * fp.num_kv_heads * tiles * plan.budget.k(length) * isize * 2
    # later chunks of a chunked prefill: transformers' SDPA path builds a boolean [B, 1, chunk, N] mask for dense
    mask = batch * chunk * n_total if chunk < length else 0
    total = 1.15 * (weights + kv + act + logits + sel + mask) + 0.5 * GB
    return dict(total=total, weights=weights, kv_cache=kv, activations=act, selections=sel, dense_chunk_mask=mask)


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


def predict_seconds(done: list[dict], batch: int, length: int) -> float | None:
    """An upper bound on a configuration's wall time from the last one measured on the same model: time per token
    grows at most linearly in the length (attention) and at least not at all, and linearly in the batch."""
    if not done:
        return None
    p = done[-1]
    r = length / p["length"]
    return p["wall_s"] * (batch / p["batch"]) * max(r, r * r)


# -- environment and outputs -------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import transformers

    try:  # the installed version, without paying for importing triton (it is optional on CPU)
        triton_v = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_v = None
    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    gpu_mem = torch.cuda.get_device_properties(dev).total_memory / GB if dev.type == "cuda" else None
    return dict(machine=f"{platform.node()} ({platform.machine()}, {platform.system()})",
                device=gpu or f"CPU ({platform.processor() or platform.machine()})", gpu=gpu, gpu_memory_gb=gpu_mem,
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton_v,
                transformers=transformers.__version__, python=platform.python_version())


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def table(results: dict) -> str:
    env = results["environment"]
    s = results["settings"]
    lines = [
        (f"device {env['device']}; torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
         f"backend {s['backend']}; decode {s.get('decode') or 'eager'}; repeats {s['repeats']} (median, after one "
         f"warm-up), {s['decode_steps']} decode steps; prefill chunk {s['prefill_chunk'] or 'none'}"),
        "",
        ("| model | B | L | TTFT dense s | TTFT kascade s | speedup | ITL dense ms | ITL kascade ms | speedup "
         "| attn share prefill / decode | peak GB dense | peak GB kascade | ratio | wall s |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["configs"]:
        head = f"| {r['model']} | {r['batch']} | {r['length']} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r['status']}: {r.get('reason', '')} |" + " |" * 10)
            continue
        d, k = r["dense"], r["kascade"]
        lines.append(
            f"{head} {d['ttft_s']:.3f} | {k['ttft_s']:.3f} | {r['ttft_speedup']:.2f}x | {1e3 * d['itl_s']:.2f} | "
            f"{1e3 * k['itl_s']:.2f} | {r['itl_speedup']:.2f}x | {r['attn_share_prefill']:.2f} / "
            f"{r['attn_share_decode']:.2f} | {_f(d['peak_gb'], '.1f')} | {_f(k['peak_gb'], '.1f')} | "
            f"{_f(r['peak_ratio'], '.2f')} | {r['wall_s']:.1f} |")
    lines.append("")
    lines += [f"- {m}: {info['description']}; plan: {info['plan']}" + (f". {info['note']}" if info.get("note") else "")
              for m, info in results["models"].items()]
    lines.append("- speedup = dense / kascade (same run); attention share = 1 - t(no-op attention) / t(dense).")
    if s.get("decode") == "graph":
        lines.append("- decode: static cache, one CUDA-graph replay per step, for all three modes; dense = PyTorch "
                     "SDPA (cuDNN first) in prefill and Kascade's dense split-K Triton kernel in decode.")
    if s["prefill_chunk"]:
        lines.append(f"- prefill in chunks of {s['prefill_chunk']} tokens: for the chunks after the first, dense runs "
                     "transformers' SDPA with an explicit [B, 1, chunk, N] mask (not the causal flash path).")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return None
    ok = [r for r in results["configs"] if r.get("status") == "ok"]
    models = list(dict.fromkeys(r["model"] for r in results["configs"]))
    fig, axes = plt.subplots(max(1, len(models)), 2, figsize=(11, 3.6 * max(1, len(models))), squeeze=False)
    for row, m in zip(axes, models):
        for ax, key, scale, unit in ((row[0], "ttft_s", 1.0, "TTFT (s)"), (row[1], "itl_s", 1e3, "ITL (ms)")):
            for i, b in enumerate(sorted({r["batch"] for r in ok if r["model"] == m})):
                rs = sorted((r for r in ok if r["model"] == m and r["batch"] == b), key=lambda r: r["length"])
                xs = [r["length"] for r in rs]
                for mode, style in (("dense", "-o"), ("kascade", "--s")):
                    ax.plot(xs, [scale * r[mode][key] for r in rs], style, color=f"C{i}", label=f"{mode} B={b}")
            ax.set_xscale("log", base=2)
            lengths = sorted({r["length"] for r in ok if r["model"] == m})
            ax.set_xticks(lengths, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in lengths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(unit)
            ax.set_title(f"{m}: {unit.split()[0]}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    fig.suptitle(f"dense vs Kascade on {results['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict, out: Path, *, with_plot: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "bench.json", out / "bench.md"]
    files[0].write_text(json.dumps(results, indent=1) + "\n")
    files[1].write_text(table(results) + "\n")
    png = plot(results, out / "bench.png") if with_plot else None
    return files + ([png] if png else [])


# -- the run -----------------------------------------------------------------------------------------------------
@dataclass
class _Clock:
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self, settings: Settings) -> float | None:
        return None if settings.time_budget_s is None else settings.time_budget_s - self.elapsed()


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _skip_reason(need: float, avail: float | None, predicted: float | None, left: float | None,
                 settings: Settings) -> str | None:
    if avail is not None and need > avail:
        hint = "" if settings.prefill_chunk else " (try --prefill-chunk)"
        return f"needs ~{need / GB:.1f} GB, {avail / GB:.1f} GB free{hint}"
    if left is not None and predicted is not None and predicted > left:
        return f"predicted ~{predicted:.0f} s, {max(left, 0):.0f} s left of --time-budget"
    return None


def _line(rec: dict) -> str:
    head = f"{rec['model']} B={rec['batch']} L={rec['length']}: {rec['status']}"
    if rec["status"] == "skipped":
        return f"{head} ({rec['reason']})"
    head += f", {rec['wall_s']:.1f} s wall"
    if rec["status"] != "ok":
        return f"{head} ({rec['reason']})"
    d, k = rec["dense"], rec["kascade"]
    return (f"{head}; TTFT {d['ttft_s']:.3f} / {k['ttft_s']:.3f} s, ITL {1e3 * d['itl_s']:.2f} / "
            f"{1e3 * k['itl_s']:.2f} ms (dense / kascade)")


def run(models, settings: Settings, out, *, model_path=None, plan: KascadePlan | None = None, argv=None) -> dict:
    """Measure every (model, batch, length); write the outputs after each configuration; return the results."""
    from tqdm.auto import tqdm

    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    check_plan(models, plan)
    out = Path(out)
    clock = _Clock()
    results = dict(environment=environment(settings.device), settings=asdict(settings),
                   command=" ".join(argv) if argv else None, models={}, configs=[])
    configs = [(m, b, n) for m in models for b in sorted(settings.batches) for n in sorted(settings.lengths)]
    bar = tqdm(total=len(configs), desc="bench", unit="config")
    for name in models:
        left = clock.left(settings)
        if left is not None and left <= 0:  # not even worth loading the model
            for batch in sorted(settings.batches):
                for length in sorted(settings.lengths):
                    rec = dict(model=name, batch=batch, length=length, status="skipped",
                               reason="--time-budget spent before this model was loaded")
                    bar.write(_line(rec))
                    results["configs"].append(rec)
                    bar.update(1)
            write(results, out, with_plot=False)
            continue
        bar.set_postfix_str(f"loading {name}")
        t0 = time.perf_counter()
        model, desc = load(name, settings, model_path)
        mplan = plan_for(name, model, plan)
        with enable(model, mplan, backend=settings.backend, warn_uncalibrated=False):
            pass  # fail on a bad backend or plan now, before any timing
        info = dict(description=desc, load_s=time.perf_counter() - t0, fingerprint=asdict(ModelFingerprint.from_model(model)),
                    plan=f"{len(mplan.anchors)} anchors {list(mplan.anchors)} of {mplan.num_layers}, ratio {mplan.ratio}, "
                    f"k_min {mplan.k_min}, tile {mplan.tile}" + ("" if mplan.calibrated else " (uncalibrated)"),
                    plan_source=mplan.source, params=sum(p.numel() for p in model.parameters()))
        trained = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if name != "default":
            info["note"] = "random weights: speed only"
        elif trained and max(settings.lengths) > trained:
            info["note"] = f"trained context {trained} tokens: lengths beyond it measure speed only"
        results["models"][name] = info
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        done: list[dict] = []
        for batch in sorted(settings.batches):
            for length in sorted(settings.lengths):
                bar.set_postfix_str(f"{name} B={batch} L={length}")
                rec = dict(model=name, batch=batch, length=length)
                est = estimate_bytes(model.config, mplan, weights=weights, batch=batch, length=length,
                                     settings=settings)
                rec["estimate_gb"] = {k: v / GB for k, v in est.items()}
                rec["predicted_s"] = predict_seconds(done, batch, length)
                reason = _skip_reason(est["total"], available_bytes(model, settings), rec["predicted_s"],
                                      clock.left(settings), settings)
                if reason:
                    rec.update(status="skipped", reason=reason)
                else:
                    t0 = time.perf_counter()
                    partial: dict = {}
                    try:
                        rec.update(measure_config(model, mplan, batch=batch, length=length, settings=settings,
                                                  partial=partial))
                        rec["status"] = "ok"
                        done.append(rec)
                    except torch.OutOfMemoryError as e:
                        rec.update(status="oom", reason=f"out of memory after modes {list(partial) or 'none'}: "
                                   + str(e).splitlines()[0][:160],
                                   partial={m: {k: v for k, v in r.items() if k != "last_logits"}
                                            for m, r in partial.items()})
                    del partial
                    rec["wall_s"] = time.perf_counter() - t0
                    _free(settings.device)
                bar.write(_line(rec))
                results["configs"].append(rec)
                results["elapsed_s"] = clock.elapsed()
                # the plot takes a second or two: redrawn only after configurations that took much longer
                write(results, out, with_plot=rec.get("wall_s", 0.0) > 10.0)
                bar.update(1)
        del model
        _free(settings.device)
    bar.close()
    results["elapsed_s"] = clock.elapsed()
    results["files"] = [str(f) for f in write(results, out)]
    return results


def main_args(args) -> int:
    """The `kascade bench` subcommand (called by :mod:`kascade.cli`)."""
    settings = Settings(lengths=args.lengths, batches=args.batches, repeats=args.repeats,
                        decode_steps=args.decode_steps, prefill_chunk=args.prefill_chunk, backend=args.backend,
                        decode=args.decode,
                        seed=args.seed, device=args.device, memory_limit_gb=args.memory_limit,
                        time_budget_s=args.time_budget or None)
    plan = KascadePlan.load(args.plan) if args.plan else None
    r = run(args.models, settings, args.out, model_path=args.model, plan=plan, argv=sys.argv)
    print()
    print(table(r))
    print(f"total {r['elapsed_s']:.0f} s; wrote " + ", ".join(r["files"]))
    return 0
