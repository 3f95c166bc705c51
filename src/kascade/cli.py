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
    from .calibrate import run

    r = run.run(args)
    print()
    print(run.report(r))
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
    rows = runner.run(model, tok, strategies=args.strategies, tasks=tasks, lengths=args.lengths,
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


def _method(value):
    from .calibrate.variants import METHODS, RULES

    if value in METHODS or all(x in RULES for x in value.split("+")):
        return value
    raise argparse.ArgumentTypeError(f"unknown method {value!r}; choose from {', '.join(METHODS)} (or reuse rules "
                                     "joined by '+')")


def _model_args(p) -> None:
    """--model and --device: the same meaning in every command."""
    p.add_argument("--model", default=None,
                   help="a .gguf file or a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16) (default: cpu)")


def build_parser() -> argparse.ArgumentParser:
    from .calibrate import DEFAULT_K
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
    c.add_argument("--data", default=None,
                   help="development texts: a JSONL file (one object per line, text under --text-field) or a .txt "
                   "file (default: the development split of Python's pydoc_data.topics)")
    c.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    c.add_argument("--seq-len", type=int, default=4096, help="tokens per development window (default: 4096)")
    c.add_argument("--samples", type=int, default=4, help="development windows for the statistics (default: 4)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--anchors", type=int, default=6, help="number of anchor layers, layer 0 included (default: 6)")
    g.add_argument("--target-agreement", type=float, default=None,
                   help="instead of --anchors: the smallest number of anchors whose teacher-forced top-1 agreement "
                   "with dense on --holdout held-out development windows reaches this value")
    c.add_argument("--holdout", type=int, default=2,
                   help="held-out development windows for --target-agreement (default: 2)")
    c.add_argument("--max-anchors", type=int, default=12, help="largest budget in the table and search (default: 12)")
    c.add_argument("--k", type=int, default=DEFAULT_K,
                   help=f"top-k used to measure similarity (default: {DEFAULT_K}, as the authors)")
    c.add_argument("--ratio", type=float, default=0.10, help="plan budget: fraction of keys kept (default: 0.10)")
    c.add_argument("--k-min", type=int, default=128, help="plan budget: at least this many keys (default: 128)")
    c.add_argument("--tile", type=int, default=32, help="prefill query tile (default: 32)")
    c.add_argument("--no-rolling", action="store_true", help="plan budget: fixed instead of rolling prefill budget")
    c.add_argument("--seed", type=int, default=0, help="which development windows (default: 0)")
    c.add_argument("--method", default="faithful", type=_method,
                   help="which plan to write: faithful (the paper's method, default), a reuse rule of issue 8 "
                   "(any-anchor, union2, sinks, layer-budget, or several joined by '+'), length (one sub-plan per "
                   "--lengths, chosen from N at run time) or search (anchors by measured KL on other dev windows)")
    c.add_argument("--rule", default=None, type=_method,
                   help="with --method length / search: the reuse rule of the sub-plans (default: faithful)")
    c.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="with --method length / search: calibration lengths (default: --seq-len)")
    c.add_argument("--search-windows", type=int, default=2, help="with --method search: dev windows per length")
    c.add_argument("--search-evals", type=int, default=24, help="with --method search: plans scored per length")
    c.add_argument("--out", default="kascade-calibration", help="output folder (default: ./kascade-calibration)")
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
        "selects its own top-k); kascade (the calibrated plan); kascade-no-headmap; kascade-shared (one index set "
        "for all heads); streamingllm (4 sinks + recent window); quest (16-key pages by query-aware min/max "
        "bounds); omnikv (one selection layer reused by all later layers). The attended fraction of keys is "
        "measured from the selections made. Writes results.json, results.csv (per sample), summary.md and "
        "scores.png into --out.",
    )
    e.add_argument("--strategies", type=_csv("strategy", STRATEGIES), default=list(STRATEGIES),
                   help=f"comma-separated strategies, or 'all' (default: all); from: {', '.join(STRATEGIES)}")
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
