"""Per-layer budgets from measured sensitivity, one GPU call:

    python -m benchmarks.measured_budget --model MODEL.gguf --out OUT [--proxy plan_searched_layer_budget.json]

1. From the shipped "searched" plan (searched anchors, faithful reuse; or --start), measure the teacher-forced KL
   against dense on "sensitivity" dev windows with one layer's budget changed at a time (every layer 1..29, every
   scale of the grid): :func:`kascade.calibrate.budgets.layer_sensitivity`.
2. Allocate one scale per layer by exact dynamic programming on those measurements (additive model, mean scale over
   layers 1..29 exactly 1): :func:`kascade.calibrate.budgets.allocate_factors`, for the full grid (up to 3x) and for
   the grid capped at 2x (anchors rank at most 2x deep), as --grids asks.
3. Score the candidates on *other* dev windows (the choice is made there), then evaluate every plan on the held-out
   eval windows (8 x 4K, 5 x 8K), reference backend, fp32.
Writes sensitivity.json, plan_measured.json, plan_measured_cap2.json, measured.json, measured.md into --out.
"""

from __future__ import annotations

import argparse
import json

import torch

from kascade import KascadePlan, text
from kascade.calibrate.budgets import layer_sensitivity, measured_budget_plan
from benchmarks.common import log, out_folder
from benchmarks.common.fidelity import evaluate
from kascade.fidelity import DenseReference
from kascade.models import load_model
from kascade.plan import shipped_plan

MEASURED_GRID = (0.5, 1.0, 1.5, 2.0, 3.0)  # measured; the library's default grid is the capped one (up to 2x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="output folder (default out/measured_budget)")
    ap.add_argument("--sens", type=int, nargs="+", default=[4096, 4096, 4096, 8192, 8192],
                    help="lengths of the sensitivity dev windows (default: 3 x 4K + 2 x 8K)")
    ap.add_argument("--choose", type=int, nargs="+", default=[4096, 4096, 8192, 8192],
                    help="lengths of the dev windows the candidates are chosen on (default: 2 x 4K + 2 x 8K)")
    ap.add_argument("--eval", type=int, nargs="+", default=[4096, 8192], help="held-out eval lengths")
    ap.add_argument("--eval-windows", type=int, nargs="+", default=[8, 5], help="held-out windows per eval length")
    ap.add_argument("--start", default=None,
                    help="a plan JSON to measure from (default: the shipped 'searched' plan, one budget per layer); "
                         "a plan with per-layer budgets gives a second round around its factors")
    ap.add_argument("--grids", nargs="+", default=["full", "cap2"], choices=["full", "cap2"],
                    help="allocation grids: full = 0.5-3x, cap2 = 0.5-2x (default: both)")
    ap.add_argument("--proxy", default=None,
                    help="the searched plan with per-layer budgets from the similarity proxy, evaluated beside the "
                         "measured ones (plan_searched_layer_budget.json of python -m benchmarks.ship_plan)")
    a = ap.parse_args(argv)
    out = out_folder(a.out, "measured_budget")

    import transformers

    res = dict(machine=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__,
               transformers=transformers.__version__, grid=list(MEASURED_GRID))
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32)

    def dev_windows(lengths, seed):
        wins = []
        for n in sorted(set(lengths)):
            wins += text.windows(tok, "dev", n, lengths.count(n), seed=seed)
        return wins

    searched = shipped_plan(model, "searched")
    plans = {"faithful": shipped_plan(model, "faithful"), "searched": searched}
    if a.proxy:
        plans["searched + layer budget (proxy)"] = KascadePlan.load(a.proxy)
    base = searched
    if a.start:
        base = plans["start"] = KascadePlan.load(a.start)
    grid = MEASURED_GRID if "full" in a.grids else tuple(s for s in MEASURED_GRID if s <= 2)
    sens = layer_sensitivity(DenseReference(model, dev_windows(a.sens, seed=21)), base, grid, progress=False, log=log)
    res["sensitivity"] = sens
    (out / "sensitivity.json").write_text(json.dumps(sens, indent=1))
    log(f"sensitivity done, base KL {sens['base']:.4f}")
    grids = {"full": ("measured", MEASURED_GRID), "cap2": ("measured_cap2", tuple(s for s in MEASURED_GRID if s <= 2))}
    for name, grid in (grids[g] for g in a.grids):
        p = measured_budget_plan(base, sens, grid)
        p.save(out / f"plan_{name}.json")
        plans[f"searched + layer budget ({name.replace('_', ', ')})"] = p
        log(f"{name}: factors {list(p.reuse.factor)}")
    chooser = DenseReference(model, dev_windows(a.choose, seed=7))
    res["choose"] = {n: chooser(p) for n, p in plans.items()}
    log("choose (dev): " + "; ".join(f"{n} {v['kl']:.4f}" for n, v in res["choose"].items()))
    res["eval"] = {}
    for L, n in zip(a.eval, a.eval_windows):
        res["eval"][L] = evaluate(model, plans, text.windows(tok, "eval", L, n, seed=1), "reference")
        log(f"eval {L}: " + "; ".join(f"{k} {v['agreement']:.4f}/{v['kl']:.4f}" for k, v in res["eval"][L].items()))
        (out / "measured.json").write_text(json.dumps(res, indent=1, default=str))
    best = min(res["choose"], key=lambda k: res["choose"][k]["kl"])
    res["best_on_dev"] = best
    (out / "measured.json").write_text(json.dumps(res, indent=1, default=str))
    head = "| plan | anchors | factors | dev KL (choice) | " + " | ".join(
        f"attended {L} | agree {L} | KL {L}" for L in a.eval) + " |"
    lines = [f"machine {res['machine']}; torch {res['torch']}; transformers {res['transformers']}; "
             f"SmolLM2-135M-Instruct "
             f"fp32; reference backend; 10% budget; held-out eval windows {dict(zip(a.eval, a.eval_windows))}; "
             f"sensitivity on dev windows {a.sens}, choice on other dev windows {a.choose}", "", head,
             "|" + "---|" * (4 + 3 * len(a.eval))]
    for name, p in plans.items():
        sc = "1" if p.reuse.factor is None else f"{min(p.reuse.factor[1:]):g}-{max(p.reuse.factor):g}"
        mark = " (chosen)" if name == best else ""
        row = f"| {name}{mark} | {list(p.anchors)} | {sc} | {res['choose'][name]['kl']:.4f} |"
        for L in a.eval:
            e = res["eval"][L][name]
            row += f" {e['attended_fraction']:.4f} | {e['agreement']:.4f} | {e['kl']:.4f} |"
        lines.append(row)
    lines += ["", f"Sensitivity (KL change with one layer at each scale, base KL {sens['base']:.4f}):", "",
              "| layer | at | " + " | ".join(f"{s}x" for s in grid) + " |", "|---|---|" + "---|" * len(grid)]
    for l, row in sens["kl"].items():
        lines.append(f"| {l}{' (anchor)' if base.is_anchor(int(l)) else ''} | {sens['current'][l]}x | " +
                     " | ".join(f"{row[s] - sens['base']:+.4f}" if s in row else "0" for s in grid) + " |")
    (out / "measured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
