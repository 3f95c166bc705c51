"""The `kascade` command: demo | calibrate | eval | bench."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from . import demo
    from .plan import KascadePlan

    plan = KascadePlan.load(args.plan) if args.plan else None
    r = demo.run(tokens=args.tokens, max_new_tokens=args.max_new_tokens, compare_last=args.compare_last,
                 device=args.device, model_path=args.model, plan=plan, seed=args.seed)
    print()
    print(demo.report(r))
    return 0


def _calibrate(args) -> int:
    from .calibrate import pipeline

    settings = pipeline.Settings(
        out=args.out, model=args.model, device=args.device, data=args.data, text_field=args.text_field,
        seq_len=args.seq_len, samples=args.samples, anchors=args.anchors, target_agreement=args.target_agreement,
        holdout=args.holdout, max_anchors=args.max_anchors, k=args.k, ratio=args.ratio, k_min=args.k_min,
        tile=args.tile, rolling=not args.no_rolling, seed=args.seed, method=args.method, rule=args.rule,
        lengths=args.lengths, search_windows=args.search_windows, search_evals=args.search_evals)
    r = pipeline.run(settings)
    print()
    print(pipeline.report(r))
    return 0


def _csv(kind, choices):
    def parse(value):
        items = list(choices) if value == "all" else [x.strip() for x in value.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad or value!r}; choose from: all, {', '.join(choices)}")
        return items

    return parse


def _eval(args) -> int:
    import platform
    from pathlib import Path

    import torch
    import transformers

    from .eval import runner
    from .models import load_model
    from .plan import KascadePlan

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, tok = load_model(args.model, device=args.device, dtype=dtype)
    plan = KascadePlan.load(args.plan) if args.plan else None
    budget = {k: v for k, v in dict(ratio=args.ratio, k_min=args.k_min).items() if v is not None}
    tasks = [] if args.longbench and args.tasks is None else (args.tasks or ["fidelity", "niah_single_number"])
    from .eval.strategies import available

    strategies = args.strategies or list(available(model))
    rows = runner.run(model, tok, strategies=strategies, tasks=tasks, lengths=args.lengths,
                      samples=args.samples, seed=args.seed, plan=plan, budget=budget or None,
                      longbench_file=args.longbench, longbench_limit=args.longbench_limit,
                      omnikv_layer=args.omnikv_layer)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.machine()})"
    header = (f"machine: {dev}; torch {torch.__version__}; transformers {transformers.__version__}; "
              f"model {args.model or 'SmolLM2-135M-Instruct (default)'}; seed {args.seed}; "
              f"{args.samples} sample(s) per task and length")
    r = runner.write(rows, Path(args.out), header)
    print()
    print(r["markdown"])
    print("wrote " + ", ".join(str(f) for f in r["files"]))
    return 0


def _bench(args) -> int:
    from . import bench

    return bench.main_args(args)


def _positive(kind):
    def parse(value):
        try:
            x = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be a positive integer, got {value!r}") from None
        if x < 1:
            raise argparse.ArgumentTypeError(f"{kind} must be a positive integer, got {value!r}")
        return x

    return parse


def _method(value):
    from .calibrate.pipeline import METHODS, is_method

    if is_method(value):
        return value
    raise argparse.ArgumentTypeError(f"unknown method {value!r}; choose from {', '.join(METHODS)} (or reuse rules "
                                     "joined by '+')")


def _model_args(p) -> None:
    """--model and --device: the same meaning in every command."""
    p.add_argument("--model", default=None,
                   help="a .gguf file or a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16) (default: cpu)")


def build_parser() -> argparse.ArgumentParser:
    from .calibrate.pipeline import Settings as CalibrationSettings
    from .eval.runner import TASKS
    from .eval.strategies import STRATEGIES

    p = argparse.ArgumentParser(
        prog="kascade",
        description="Kascade sparse attention for Hugging Face models (arXiv 2512.16391).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="answer a needle question over a long prompt, densely and with Kascade, and compare",
        description="Builds a long prompt from Python's own documentation (pydoc_data.topics) with a needle fact "
        "in the middle and a question about it, then runs the model densely and with Kascade (the shipped "
        "calibrated plan for the model, or an uncalibrated uniform plan): prints both greedy answers, the "
        "teacher-forced top-1 agreement and KL between the two on the prompt's last positions, and wall times.",
    )
    d.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default: 4096)")
    d.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length (default: 24)")
    d.add_argument("--compare-last", type=int, default=512,
                   help="teacher-forced comparison over this many last prompt positions (default: 512)")
    d.add_argument("--plan", default=None, help="a Kascade plan JSON (default: shipped plan for the model, else uniform)")
    d.add_argument("--seed", type=int, default=0, help="which haystack window to use (default: 0)")
    _model_args(d)
    d.set_defaults(func=_demo)

    c = sub.add_parser(
        "calibrate",
        help="choose anchor layers and head map for a model from development text",
        description="Runs the model densely over development windows, streams the cross-layer similarity of "
        "top-k index sets (minimum over query tiles, averaged over windows) and each layer's importance, then "
        "picks the anchors by an exact dynamic program and each reuse head's anchor head by argmax. Writes "
        "plan.json (use it with kascade.enable or --plan), stats.json, objective.csv (DP objective per number of "
        "anchors) and two PNG plots into --out.",
    )
    cal = CalibrationSettings()
    c.add_argument("--data", default=None,
                   help="development texts: a JSONL file (one object per line, text under --text-field) or a .txt "
                   "file (default: the development split of Python's pydoc_data.topics)")
    c.add_argument("--text-field", default=cal.text_field,
                   help=f"JSONL field holding the text (default: {cal.text_field})")
    c.add_argument("--seq-len", type=int, default=cal.seq_len,
                   help=f"tokens per development window (default: {cal.seq_len})")
    c.add_argument("--samples", type=int, default=cal.samples,
                   help=f"development windows for the statistics (default: {cal.samples})")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--anchors", type=int, default=cal.anchors,
                   help=f"number of anchor layers, layer 0 included (default: {cal.anchors})")
    g.add_argument("--target-agreement", type=float, default=None,
                   help="instead of --anchors: the smallest number of anchors whose teacher-forced top-1 agreement "
                   "with dense on --holdout held-out development windows reaches this value")
    c.add_argument("--holdout", type=int, default=cal.holdout,
                   help=f"held-out development windows for --target-agreement (default: {cal.holdout})")
    c.add_argument("--max-anchors", type=int, default=cal.max_anchors,
                   help=f"largest budget in the table and search (default: {cal.max_anchors})")
    c.add_argument("--k", type=int, default=cal.k,
                   help=f"top-k used to measure similarity (default: {cal.k}, as the authors)")
    c.add_argument("--ratio", type=float, default=cal.ratio,
                   help=f"plan budget: fraction of keys kept (default: {cal.ratio:.2f})")
    c.add_argument("--k-min", type=int, default=cal.k_min,
                   help=f"plan budget: at least this many keys (default: {cal.k_min})")
    c.add_argument("--tile", type=int, default=cal.tile, help=f"prefill query tile (default: {cal.tile})")
    c.add_argument("--no-rolling", action="store_true", help="plan budget: fixed instead of rolling prefill budget")
    c.add_argument("--seed", type=int, default=cal.seed, help=f"which development windows (default: {cal.seed})")
    c.add_argument("--method", default=cal.method, type=_method,
                   help="which plan to write: faithful (the paper's method, default), a reuse rule (any-anchor, "
                   "union2, sinks, layer-budget, or several joined by '+'), length (one sub-plan per "
                   "--lengths, chosen from N at run time), search (anchors by measured KL on other dev windows) or "
                   "measured (the shipped default's method: search, then per-layer budgets from each layer's measured "
                   "sensitivity on those windows; about 30 + 3 x layers plan evaluations)")
    c.add_argument("--rule", default=None, type=_method,
                   help="with --method length / search: the reuse rule of the sub-plans (default: faithful)")
    c.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="with --method length / search / measured: calibration lengths (default: --seq-len)")
    c.add_argument("--search-windows", type=int, default=cal.search_windows,
                   help="with --method search / measured: dev windows per length")
    c.add_argument("--search-evals", type=int, default=cal.search_evals,
                   help="with --method search / measured: plans scored in the anchor search (per length for search)")
    c.add_argument("--out", default=str(cal.out), help=f"output folder (default: ./{cal.out})")
    _model_args(c)
    c.set_defaults(func=_calibrate)

    e = sub.add_parser(
        "eval",
        help="accuracy of Kascade against dense, the oracle and other sparse methods at the same budget",
        description="Runs each strategy on each task through the same attention path and budget. Tasks: "
        "'fidelity' (teacher-forced top-1 agreement, KL and NLL against dense on held-out pydoc_data windows; "
        "score = agreement) and RULER-style generated tasks (needle in a haystack: single number / word, "
        "multikey, multivalue, multiquery; variable tracking; common and frequent words extraction; score = "
        "RULER string match), plus LongBench-format files (--longbench). Strategies: dense; oracle (every layer "
        "selects its own top-k); kascade (the calibrated plan); kascade-faithful (the paper's method as shipped for the "
        "model); kascade-no-headmap; kascade-shared (one index set "
        "for all heads); streamingllm (4 sinks + recent window); quest (16-key pages by query-aware min/max "
        "bounds); omnikv (one selection layer reused by all later layers). The attended fraction of keys is "
        "measured from the selections made. Writes results.json, results.csv (per sample), summary.md and "
        "scores.png into --out.",
    )
    e.add_argument("--strategies", type=_csv("strategy", STRATEGIES), default=None,
                   help=f"comma-separated strategies, or 'all' (default: every one that runs on the model: "
                   f"kascade-faithful needs a shipped plan); from: {', '.join(STRATEGIES)}")
    e.add_argument("--tasks", type=_csv("task", TASKS), default=None,
                   help="comma-separated tasks, or 'all' (default: fidelity,niah_single_number; none with --longbench); "
                   f"from: {', '.join(TASKS)}")
    e.add_argument("--lengths", type=int, nargs="+", default=[2048], help="prompt lengths in tokens (default: 2048)")
    e.add_argument("--samples", type=int, default=2, help="samples per task and length (default: 2)")
    e.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default: 0)")
    e.add_argument("--plan", default=None, help="plan JSON for the kascade strategies (default: shipped plan)")
    e.add_argument("--ratio", type=float, default=None, help="override the budget ratio for every strategy")
    e.add_argument("--k-min", type=int, default=None, help="override k_min for every strategy")
    e.add_argument("--omnikv-layer", type=int, default=2, help="the OmniKV-style selection layer (default: 2)")
    e.add_argument("--longbench", default=None, help="a LongBench-format JSONL file (context, input, answers, dataset)")
    e.add_argument("--longbench-limit", type=int, default=None, help="use at most this many LongBench records")
    e.add_argument("--out", default="kascade-eval", help="output folder (default: ./kascade-eval)")
    _model_args(e)
    e.set_defaults(func=_eval)

    from .bench import MODELS, Settings

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
    b.add_argument("--models", type=_csv("model", MODELS), default=["default", "llama8b"],
                   help=f"comma-separated models, or 'all' (default: default,llama8b); from: {', '.join(MODELS)}")
    b.add_argument("--lengths", type=_positive("length"), nargs="+", default=list(dflt.lengths),
                   help=f"prompt lengths in tokens (default: {' '.join(map(str, dflt.lengths))})")
    b.add_argument("--batches", type=_positive("batch size"), nargs="+", default=list(dflt.batches),
                   help=f"batch sizes (default: {' '.join(map(str, dflt.batches))})")
    b.add_argument("--repeats", type=_positive("--repeats"), default=dflt.repeats,
                   help=f"timed prefills per mode after one warm-up; TTFT is their median (default: {dflt.repeats})")
    b.add_argument("--decode-steps", type=_positive("--decode-steps"), default=dflt.decode_steps,
                   help=f"greedy decode steps averaged into ITL (default: {dflt.decode_steps})")
    b.add_argument("--decode", choices=("graph", "eager"), default=None,
                   help="how decode steps run: graph (static cache + CUDA graph replay; the default on CUDA) or eager "
                   "(DynamicCache, one Python-driven forward per step; the default elsewhere)")
    b.add_argument("--prefill-chunk", type=int, default=0,
                   help="feed the prompt this many tokens at a time through the cache (bounds activation memory for "
                   "big batches; dense then runs transformers' masked SDPA for the later chunks); 0: whole prompt "
                   "(default: 0)")
    b.add_argument("--backend", default=dflt.backend,
                   help=f"passed to kascade.enable: auto (Triton on CUDA where supported, else the reference), "
                   f"triton or reference (default: {dflt.backend})")
    b.add_argument("--plan", default=None,
                   help="a Kascade plan JSON used for every selected model (it must match each one's shape)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids (default: 0)")
    b.add_argument("--memory-limit", type=float, default=None,
                   help="GB a configuration may use, weights included (default: the GPU's free memory plus what this "
                   "process holds; no check on CPU)")
    b.add_argument("--time-budget", type=float, default=dflt.time_budget_s,
                   help="seconds for the whole run, model loading included: a configuration predicted (from the "
                   "previous one, scaled up by batch and length squared) to overrun it is skipped; 0: no limit "
                   f"(default: {dflt.time_budget_s:.0f})")
    b.add_argument("--out", default="kascade-bench", help="output folder (default: ./kascade-bench)")
    _model_args(b)
    b.set_defaults(func=_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kascade {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
