"""`kascade demo`: one needle question over a long prompt, answered densely and with Kascade (:mod:`kascade.demo`)."""

from __future__ import annotations

from .types import integer, model_args, plan_arg, positive


def run(args) -> int:
    from .. import demo

    r = demo.run(tokens=args.tokens, max_new_tokens=args.max_new_tokens, compare_last=args.compare_last,
                 device=args.device, model_path=args.model, plan=args.plan, seed=args.seed)
    print()
    print(demo.report(r))
    return 0


def add(sub) -> None:
    from ..plan import SHIPPED_VARIANTS
    d = sub.add_parser(
        "demo",
        help="answer a needle question over a long prompt, densely and with Kascade, and compare",
        description="Builds a long prompt from Python's own documentation (pydoc_data.topics) with a needle fact "
        "in the middle and a question about it, then runs the model densely and with Kascade (--plan, else the shipped "
        "calibrated plan for the model, else an uncalibrated uniform plan): prints both greedy answers, the "
        "teacher-forced top-1 agreement and KL between the two on the prompt's last positions, and wall times. "
        "Writes no files.",
    )
    d.add_argument("--tokens", type=positive(), default=4096,
                   help="prompt length in tokens, haystack, needle and question included, within a few tokens (the haystack's "
                   "halves are re-tokenised around the needle) (default: 4096)")
    d.add_argument("--max-new-tokens", type=positive(), default=24,
                   help="tokens of each greedy answer (default: 24)")
    d.add_argument("--compare-last", type=positive(), default=512,
                   help="the teacher-forced comparison scores this many last prompt positions (default: 512)")
    d.add_argument("--plan", default=None, type=plan_arg, metavar="FILE|NAME",
                   help="a Kascade plan JSON, as kascade calibrate writes, or the name of a plan shipped for the model "
                   f"({', '.join(SHIPPED_VARIANTS)}) (default: the shipped plan for the model, else a uniform one)")
    d.add_argument("--seed", type=integer(0), default=0,
                   help="which window of the evaluation text is the haystack (default: 0)")
    model_args(d)
    d.set_defaults(func=run, parser=d)
