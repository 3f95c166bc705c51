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


def build_parser() -> argparse.ArgumentParser:
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
    d.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16) (default: cpu)")
    d.add_argument("--model", default=None,
                   help="a .gguf file or a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    d.add_argument("--plan", default=None, help="a Kascade plan JSON (default: shipped plan for the model, else uniform)")
    d.add_argument("--seed", type=int, default=0, help="which haystack window to use (default: 0)")
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
    c.add_argument("--model", default=None,
                   help="a .gguf file or a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
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
    c.add_argument("--k", type=int, default=64, help="top-k used to measure similarity (default: 64, as the authors)")
    c.add_argument("--ratio", type=float, default=0.10, help="plan budget: fraction of keys kept (default: 0.10)")
    c.add_argument("--k-min", type=int, default=128, help="plan budget: at least this many keys (default: 128)")
    c.add_argument("--tile", type=int, default=32, help="prefill query tile (default: 32)")
    c.add_argument("--no-rolling", action="store_true", help="plan budget: fixed instead of rolling prefill budget")
    c.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16) (default: cpu)")
    c.add_argument("--seed", type=int, default=0, help="which development windows (default: 0)")
    c.add_argument("--out", default="kascade-calibration", help="output folder (default: ./kascade-calibration)")
    c.set_defaults(func=_calibrate)
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
