"""`kascade bench`: end-to-end time to first token and inter-token latency, dense vs Kascade (:mod:`kascade.bench`)."""

from __future__ import annotations

import argparse

from .settings import build
from .types import batch_by_length, csv_of, integer, model_args, number, plan_arg, positive


def settings(args):
    """The bench's :class:`~kascade.bench.Settings` from the options. Where a flag and a field differ: ``pairs`` is
    --configs, ``decode`` and ``generate`` come from --decode-modes and --decode together, ``memory_limit_gb`` is
    --memory-limit, ``time_budget_s`` is --time-budget (0: None, no limit); ``warmup_decode_steps`` has no option
    (its default depends on how decode steps run). Every other field is the option of its name."""
    from .. import bench
    from ..bench.runner import decode_modes

    decode, generate = decode_modes(args.decode_modes, args.decode)
    mapped = {"pairs": args.configs, "decode": decode, "generate": generate, "memory_limit_gb": args.memory_limit,
              "time_budget_s": args.time_budget or None}
    return build(bench.Settings, args, mapped, unset=("warmup_decode_steps",))


def run(args) -> int:
    from .. import bench

    return bench.main_args(args, settings(args))


def add(sub) -> None:
    from ..plan import SHIPPED_VARIANTS
    from ..bench import MODELS, Settings
    from ..bench.settings import DECODE_MODES

    dflt = Settings()
    b = sub.add_parser(
        "bench",
        help="end-to-end time to first token and inter-token latency, dense vs Kascade",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Measures, for every model x batch size x prompt length (a configuration), in one run and on the same weights and
random prompt (seeded token ids):
  TTFT   time to first token: the prompt through model(..., use_cache=True, logits_to_keep=1) into a fresh
         cache, plus the argmax; synchronised before and after; median of --repeats after one warm-up
  ITL    inter-token latency: mean time per greedy decode step over --decode-steps steps after the prefill and
         untimed warm-up steps. --decode graph (default on CUDA): a static cache and one CUDA-graph replay per
         step, how serving engines decode; --decode eager: a DynamicCache and a Python-driven forward per step
  through generate (--decode-modes eager,compiled): TTFT and ITL of transformers' model.generate, what users
         call, for dense and Kascade: eager (its DynamicCache) and compiled (cache_implementation="static" and its
         compile config: torch.compile, fullgraph, mode="reduce-overhead": a CUDA graph per step), from
         per-token stamps (CUDA events): TTFT from generate's start to its first token, ITL the mean step after
         warm-up steps; in a table of their own, each row naming its mode
  peak   torch.cuda.max_memory_allocated (weights included), reset before each mode
  attention share   1 - t(no-op attention) / t(dense), prefill and decode: the same forward with a temporary
         attention implementation that returns zeros (the model's own implementation is restored afterwards)
for dense (eager: the model's own attention, SDPA; graph: SDPA with cuDNN first for the prefill and a dense
split-K Triton kernel for decode, since SDPA over a static cache attends its whole capacity) and Kascade (kascade.enable(model, plan, backend=--backend)), with
speedups dense / Kascade. Before each configuration its memory (weights + KV cache + prefill activations + Kascade's
selections) is estimated; one that cannot fit, or is predicted to overrun --time-budget, is skipped with the reason;
out-of-memory errors are caught per configuration and recorded.

Models (--models):
  default  --model (a .gguf file or a local model folder), else the embedded SmolLM2-135M-Instruct; plan: --plan,
           else the shipped calibrated plan for its shape (else uniform). SmolLM2 is trained for 8K tokens: longer
           lengths measure speed only.
  llama8b  Llama-3.1-8B shapes (hidden 4096, 32 layers, 32 query / 8 KV heads, head_dim 128, vocab 128256) with
           random weights built on --device, nothing downloaded; plan: uniform 5 anchors of 32 layers.
  tiny     a tiny random Llama (4 layers, hidden 64) for tests and dry runs; plan: uniform 2 anchors.

Writes bench.json (machine, versions, settings, every measurement and skip reason), bench.md (the table) and
bench.png (TTFT and ITL against context length) into --out after every configuration, and prints the table.""",
    )
    b.add_argument("--models", type=csv_of("model", MODELS), default=["default", "llama8b"],
                   help=f"comma-separated models, or 'all' (default: default,llama8b); from: {', '.join(MODELS)}")
    b.add_argument("--lengths", type=positive("length"), nargs="+", default=list(dflt.lengths),
                   help=f"prompt lengths in tokens (default: {' '.join(map(str, dflt.lengths))})")
    b.add_argument("--batches", type=positive("batch size"), nargs="+", default=list(dflt.batches),
                   help=f"batch sizes (default: {' '.join(map(str, dflt.batches))})")
    b.add_argument("--configs", type=batch_by_length, nargs="+", default=None, metavar="BxL",
                   help="(batch, length) configurations to run instead of every --batches x --lengths, e.g. "
                   "1x32768 1x131072 2x32768")
    b.add_argument("--repeats", type=positive(), default=dflt.repeats,
                   help=f"timed prefills per mode after one warm-up; TTFT is their median (default: {dflt.repeats})")
    b.add_argument("--decode-steps", type=positive(), default=dflt.decode_steps,
                   help=f"greedy decode steps averaged into ITL (default: {dflt.decode_steps})")
    b.add_argument("--decode", choices=("graph", "eager"), default=None,
                   help="how decode steps run: graph (static cache + CUDA graph replay; the default on CUDA) or eager "
                   "(DynamicCache, one Python-driven forward per step; the default elsewhere)")
    b.add_argument("--decode-modes", type=csv_of("decode mode", DECODE_MODES), default=None,
                   help="comma-separated, or 'all': eager (generate, eagerly), compiled (generate with a static cache "
                   "and torch.compile), graph (GraphDecoder's CUDA-graph replays, for the main columns; without it "
                   "they come from the eager Python loop); e.g. eager,compiled,graph. Instead of --decode")
    b.add_argument("--compile-backend", default=dflt.compile_backend, metavar="NAME",
                   help=f"torch.compile backend of the compiled mode (default: {dflt.compile_backend}; aot_eager "
                   "traces without generating code)")
    b.add_argument("--prefill-chunk", type=integer(0), default=0,
                   help="feed the prompt this many tokens at a time through the cache (bounds activation memory for "
                   "big batches; dense then runs transformers' masked SDPA for the later chunks); 0: whole prompt "
                   "(default: 0)")
    b.add_argument("--backend", default=dflt.backend, choices=("auto", "triton", "reference"),
                   help=f"passed to kascade.enable: auto (Triton on CUDA where supported, else the reference), "
                   f"triton or reference (default: {dflt.backend})")
    b.add_argument("--plan", default=None, type=plan_arg, metavar="FILE|NAME",
                   help="a Kascade plan JSON used for every selected model (it must match each one's shape), or the "
                   f"name of a shipped plan ({', '.join(SHIPPED_VARIANTS)}; only the default model has shipped plans)")
    b.add_argument("--seed", type=integer(0), default=0, help="seed of the random prompt token ids (default: 0)")
    b.add_argument("--memory-limit", type=number(0.0), default=None,
                   help="GB a configuration may use, weights included (default: the GPU's free memory plus what this "
                   "process holds; no check on CPU)")
    b.add_argument("--time-budget", type=number(0.0, low_open=False), default=dflt.time_budget_s,
                   help="seconds for the whole run, model loading included: a configuration predicted to overrun it "
                   "is skipped (from the previous one's measurements: the attention share of its prefills scaled "
                   "by length squared, the rest linearly, all by batch; its compile and capture time once); 0: no "
                   "limit "
                   f"(default: {dflt.time_budget_s:.0f})")
    b.add_argument("--out", default="kascade-bench", metavar="DIR",
                   help="output folder, created if missing; checked before any model is loaded (default: "
                   "./kascade-bench)")
    model_args(b)
    b.set_defaults(func=run, parser=b)
