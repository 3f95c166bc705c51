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
