"""Would anchors chosen per input beat anchors chosen once per model? (issue 39, item 3: the paper's open question)

The paper's method (``faithful``: the similarity DP's anchors and argmax head map) is calibrated once on development
windows. Per evaluation window this measures, at the same anchor count, teacher-forced against dense:

- ``calibrated``: the plan from the development windows' statistics (what ships: chosen once);
- ``own window``: the plan from the window's *own* statistics (a dense pass over the whole window): the best any
  per-input choice by this rule could do, an upper bound that no run-time scheme reaches (it needs the dense pass
  that Kascade exists to avoid);
- ``prompt prefix``: the plan from the statistics of the window's first ``--prefix`` tokens, a scheme that could
  run: a dense prefill of the prompt's start (1/16 of the full attention at a quarter of it), then anchors for the
  rest;
- the shipped default (searched anchors, per-layer budgets) for reference.

Also per window: the DP objective of the calibrated anchors on the window's own statistics, as a share of that
window's optimum (1.0: the calibrated anchors are the window's best).

    python -m benchmarks.anchor_adaptation [--length 4096] [--windows 6] [--dev-windows 4] [--prefix 1024] [--out DIR]

Writes rows.jsonl (one line per window and plan, appended as they finish: an interrupted run keeps them and a rerun
skips them) and summary.md under --out (default out/anchor_adaptation). CPU, fp32, the reference backend.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RowLog, out_folder
from benchmarks.common.tables import adaptation_table
from kascade import text
from kascade.calibrate.dp import choose_anchors, layer_weights, objective, plan_from_stats
from kascade.calibrate.stats import collect_stats
from kascade.fidelity import DenseReference, pool
from kascade.models import load_model
from kascade.plan import shipped_plan

PLANS = ("calibrated", "own window", "prompt prefix", "shipped default")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="tokens per evaluation window")
    p.add_argument("--windows", type=int, default=6, help="evaluation windows (eval split)")
    p.add_argument("--dev-windows", type=int, default=4, help="development windows of the calibrated plan")
    p.add_argument("--prefix", type=int, default=1024, help="prompt tokens the 'prompt prefix' plan is chosen from")
    p.add_argument("--anchors", type=int, default=None, help="anchor count (default: the shipped default's)")
    p.add_argument("--model", default=None, help="GGUF or Hugging Face folder (default: the embedded model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default out/anchor_adaptation)")
    return p.parse_args(argv)


def objective_share(stats, anchors) -> float:
    """The DP objective of ``anchors`` on ``stats`` as a share of the best anchor set of the same size."""
    w = layer_weights(stats)
    best = choose_anchors(w, len(anchors))[1]
    return objective(w, anchors) / best if best else 1.0


def summary(rows: list[dict], setup: dict) -> str:
    by_plan = {r["plan"]: r for r in rows}
    shares = [r["objective_share"] for r in rows if r["plan"] == "calibrated"]
    lines = [f"Anchors per input against anchors once per model: eval windows of {setup['length']} tokens, "
             f"{setup['anchor_count']} anchors, the paper's rule; calibrated on {setup['dev_windows']} dev windows; prefix "
             f"{setup['prefix']} tokens. Changes are paired per window against 'calibrated'.", "",
             adaptation_table(rows), ""]
    if shares:
        lines.append(f"DP objective of the calibrated anchors on each window's own statistics, share of that "
                     f"window's optimum: min {min(shares):.4f}, mean {statistics.mean(shares):.4f}.")
    if "calibrated" in by_plan:
        lines.append(f"Anchor sets: calibrated {by_plan['calibrated']['anchors']}; own window "
                     + "; ".join(str(r["anchors"]) for r in rows if r["plan"] == "own window") + ".")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    a = _parse(argv)
    torch.manual_seed(a.seed)
    out = out_folder(a.out, "anchor_adaptation")
    model, tok = load_model(a.model, device="cpu", dtype=torch.float32)
    default = shipped_plan(model, "default")
    A = a.anchors or len(default.anchors)
    dev = text.windows(tok, "dev", a.length, a.dev_windows, seed=a.seed)
    evals = text.windows(tok, "eval", a.length, a.windows, seed=a.seed)
    setup = dict(length=a.length, windows=a.windows, dev_windows=a.dev_windows, prefix=a.prefix, anchor_count=A,
                 seed=a.seed)
    log = RowLog(out / "rows.jsonl", **setup)
    todo = [i for i in range(len(evals)) if not all(log.has(window=i, plan=name) for name in PLANS)]
    if todo:  # a rerun of a finished run calibrates nothing
        print(f"calibrating on {a.dev_windows} dev windows ...", flush=True)
        calibrated = plan_from_stats(model, collect_stats(model, dev), A, ratio=default.ratio, k_min=default.k_min)
    for i in todo:
        w = evals[i]
        t0 = time.perf_counter()
        own_stats = collect_stats(model, [w], progress=False)
        plans = {"calibrated": calibrated,
                 "own window": plan_from_stats(model, own_stats, A, ratio=default.ratio, k_min=default.k_min),
                 "prompt prefix": plan_from_stats(model, collect_stats(model, [w[:a.prefix]], progress=False),
                                                  A, ratio=default.ratio, k_min=default.k_min),
                 "shipped default": default}
        ref = DenseReference(model, [w])
        for name, plan in plans.items():
            if not log.has(window=i, plan=name):
                f = pool(ref.compare(plan))
                log.add(window=i, plan=name, agreement=f.top1_agreement, kl=f.kl, anchors=list(plan.anchors),
                        objective_share=objective_share(own_stats, plan.anchors))
        print(f"window {i}: " + ", ".join(f"{r['plan']} {r['agreement']:.4f}" for r in log.rows if r["window"] == i)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = log.rows
    text_ = summary(rows, setup)
    (out / "summary.md").write_text(text_)
    print(text_)
    return rows


if __name__ == "__main__":
    main()
