"""Re-make the default model's shipped plan with the best variant the fast kernels serve, one GPU call:

    python -m benchmarks.ship_plan --model MODEL.gguf --out OUT [--variants-best plan_best.json]

1. Statistics on 16 dev windows of 8K tokens (as for the first shipped plan), the DP's anchors.
2. Fidelity-driven anchor search with the faithful reuse rule (anchors + head map only: the Triton fast path serves
   it), scored by measured KL on dev windows of both target lengths (2 x 4K + 2 x 8K, disjoint from the
   calibration windows), so that one plan serves both; the same search with the per-layer-budget rule.
3. Held-out evaluation (eval split; 8 x 4K, 5 x 8K windows) of: the shipped faithful plan, the searched plan, the
   searched plan with per-layer budgets, and (if given) benchmarks.variants' best plan; the searched plan
   also with the Triton backend (same plan through the fast kernels; bf16 model for that row).
Writes plan_searched.json, plan_searched_layer_budget.json, ship.json, ship.md into --out.
"""

from __future__ import annotations

import argparse
import json

import torch

from kascade import KascadePlan, text
from kascade.calibrate import collect_stats, plan_from_stats
from kascade.calibrate import dp_anchors, plan_for_rule, search_anchors
from benchmarks.common import log, out_folder
from benchmarks.common.fidelity import evaluate
from kascade.fidelity import DenseReference
from kascade.models import load_model
from kascade.plan import default_plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="output folder (default out/ship_plan)")
    ap.add_argument("--variants-best", default=None, help="plan_best.json of benchmarks.variants (evaluated too)")
    ap.add_argument("--search-evals", type=int, default=36)
    ap.add_argument("--alpha", type=float, default=0.5)
    a = ap.parse_args(argv)
    out = out_folder(a.out, "ship_plan")

    import transformers
    import triton

    res = dict(machine=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__)
    model, tok = load_model(a.model, device="cuda", dtype=torch.float32)
    fp_plan = default_plan(model)
    stats = collect_stats(model, text.windows(tok, "dev", 8192, 16, seed=0), progress=False)
    log("statistics: 16 dev windows x 8192")
    dev = text.windows(tok, "dev", 4096, 2, seed=7) + text.windows(tok, "dev", 8192, 2, seed=7)
    scorer = DenseReference(model, dev)
    start = dp_anchors(stats, 6)
    found = {}
    for rule, kw in (("faithful", {}), ("layer-budget", dict(alpha=a.alpha))):
        best, s, hist = search_anchors(lambda x, r=rule, k=kw: plan_for_rule(model, stats, x, r, **k), scorer,
                                       start, model.config.num_hidden_layers, max_evals=a.search_evals,
                                       progress=False, log=log)
        plan = plan_for_rule(model, stats, best, rule, source=(
            f"calibrated + searched ({rule}): anchors {list(best)} by measured KL {s['kl']:.4f} on 2 x 4K + 2 x 8K "
            f"dev windows ({len(hist)} plans), from the DP over {stats.windows} dev windows of {stats.seq_len} "
            f"tokens"), **kw)
        found[rule] = plan
        res[f"search_{rule}"] = dict(anchors=list(best), dev=s, history=hist)
        log(f"search {rule}: {list(best)} dev KL {s['kl']:.4f}")
    found["faithful"].save(out / "plan_searched.json")
    found["layer-budget"].save(out / "plan_searched_layer_budget.json")
    plans = {"shipped (faithful DP)": fp_plan, "searched": found["faithful"],
             "searched + layer budget": found["layer-budget"],
             "DP anchors, faithful (re-calibrated)": plan_from_stats(model, stats, 6)}
    if a.variants_best:
        plans["variants.py best"] = KascadePlan.load(a.variants_best)
    res["eval"] = {}
    for L, n in ((4096, 8), (8192, 5)):
        wins = text.windows(tok, "eval", L, n, seed=1)
        res["eval"][L] = evaluate(model, plans, wins, "reference")
        log(f"eval {L}: " + "; ".join(f"{k} {v['agreement']:.4f}/{v['kl']:.4f}" for k, v in res["eval"][L].items()))
        (out / "ship.json").write_text(json.dumps(res, indent=1, default=str))
    model.to(torch.bfloat16)
    res["eval_bf16"] = {}
    for L, n in ((4096, 8), (8192, 5)):
        wins = text.windows(tok, "eval", L, n, seed=1)
        r = {}
        for backend in ("reference", "triton"):
            r[backend] = evaluate(model, {"searched": found["faithful"]}, wins, backend)["searched"]
        res["eval_bf16"][L] = r
        log(f"bf16 {L}: " + "; ".join(f"{b} {v['agreement']:.4f}/{v['kl']:.4f}" for b, v in r.items()))
    (out / "ship.json").write_text(json.dumps(res, indent=1, default=str))
    lines = [f"machine {res['machine']}; torch {res['torch']}; triton {res['triton']}; transformers "
             f"{res['transformers']}; SmolLM2-135M-Instruct fp32; 10% budget; held-out eval windows (8 x 4K, 5 x 8K)", "",
             "| plan | anchors | attended 8K | agree 4K | KL 4K | agree 8K | KL 8K |", "|---|---|---|---|---|---|---|"]
    for name, plan in plans.items():
        e4, e8 = res["eval"][4096][name], res["eval"][8192][name]
        lines.append(f"| {name} | {list(plan.anchors)} | {e8['attended_fraction']:.4f} | {e4['agreement']:.4f} | "
                     f"{e4['kl']:.4f} | {e8['agreement']:.4f} | {e8['kl']:.4f} |")
    lines += ["", "bf16, the searched plan through each backend:", ""]
    for L in (4096, 8192):
        for b, v in res["eval_bf16"][L].items():
            lines.append(f"- {L}, {b}: agreement {v['agreement']:.4f}, KL {v['kl']:.4f}")
    (out / "ship.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
