"""Budgets by attention mass against budgets by count, teacher-forced, at the attended fraction each one measures.

Each spec is ``PLAN:MASS:CAP`` (``PLAN``: a shipped plan's name, e.g. ``default``, or ``oracle``, every layer
selecting its own keys at the default plan's budget; ``MASS`` a share of attention, or ``count`` for the plan's own budget;
``CAP`` the ratio that caps a row by mass). Every spec runs on the same windows of one split against dense.

    python -m benchmarks.mass_budgets --split dev --length 4096 --windows 2 default:count \\
        default:0.9:0.3 default:0.95:0.3 oracle:count oracle:0.9:0.3 oracle:0.93:0.3 oracle:0.95:0.3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import out_folder
from kascade import text
from kascade.fidelity import DenseReference, pool
from kascade.models import load_model
from kascade.plan import KascadePlan, ModelFingerprint, shipped_plan


def plan_of(model, spec: str) -> KascadePlan:
    name, *budget = spec.split(":")
    base = shipped_plan(model, "default" if name == "oracle" else name)  # ValueError naming the shipped plans
    if name == "oracle":
        base = KascadePlan.all_anchors(ModelFingerprint.from_model(model), ratio=base.ratio, k_min=base.k_min)
    if budget == ["count"]:
        return base
    mass, cap = map(float, budget)
    return base.with_budget(mass=mass, ratio=cap)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", metavar="PLAN:MASS:CAP")
    p.add_argument("--split", default="dev", choices=text.SPLITS)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default out/mass_budgets)")
    a = p.parse_args(argv)
    out = out_folder(a.out, "mass_budgets")
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32 if a.device == "cpu" else torch.bfloat16)
    plans = {s: plan_of(model, s) for s in a.specs}  # every spec checked before the dense pass
    ref = DenseReference(model, text.windows(tok, a.split, a.length, a.windows, seed=a.seed))
    print(f"| plan | mass | cap | agreement | KL | attended |  ({a.split}, {a.windows} x {a.length})\n|---|---|---|---|---|---|")
    with open(out / "rows.jsonl", "a") as log:
        for spec, plan in plans.items():
            t0 = time.perf_counter()
            f = pool(ref.compare(plan, account=True))
            row = dict(spec=spec, split=a.split, length=a.length, windows=a.windows, seed=a.seed, mass=plan.mass,
                       cap=plan.ratio, agreement=f.top1_agreement, kl=f.kl, attended=f.attended,
                       seconds=time.perf_counter() - t0)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"| {spec.split(':')[0]} | {plan.mass or 'by count'} | {plan.ratio} | {f.top1_agreement:.4f} | "
                  f"{f.kl:.4f} | {f.attended:.4f} |", flush=True)


if __name__ == "__main__":
    main()
