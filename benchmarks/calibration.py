"""Calibrate the default model and measure fidelity of uniform vs calibrated plans, one GPU call:

    python -m benchmarks.calibration --model MODEL.gguf --device cuda --out OUT
Writes calibration outputs (plan_A*.json, stats.json, plots) and fidelity.json / fidelity.md to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from benchmarks.common import out_folder
from kascade import KascadePlan, ModelFingerprint, text
from kascade.calibrate import collect_stats, objective_table, plan_from_stats
from kascade.calibrate.plots import importance_curve, similarity_heatmap
from kascade.fidelity import compare_plans
from kascade.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cal-len", type=int, default=8192)
    p.add_argument("--cal-samples", type=int, default=16)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--windows", type=int, nargs="+", default=[8, 5], help="eval windows per length")
    p.add_argument("--anchors", type=int, nargs="+", default=[4, 6, 8, 10])
    p.add_argument("--out", default=None, help="output folder (default out/calibration)")
    a = p.parse_args(argv)
    out = out_folder(a.out, "calibration")
    torch.manual_seed(0)
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32)
    fp = ModelFingerprint.from_model(model)
    dev = text.windows(tok, "dev", a.cal_len, a.cal_samples, seed=0)
    t0 = time.perf_counter()
    stats = collect_stats(model, dev)
    cal_s = time.perf_counter() - t0
    (out / "stats.json").write_text(json.dumps(stats.to_dict()) + "\n")
    table = objective_table(stats, 12)
    plans = {}
    for A in a.anchors:
        cal = plan_from_stats(fp, stats, A)
        cal.save(out / f"plan_A{A}.json")
        plans[f"uniform A={A}"] = KascadePlan.uniform(fp, A)
        plans[f"calibrated A={A}"] = cal
        plans[f"calibrated, identity head map A={A}"] = plan_from_stats(fp, stats, A, head_map=False)
    plans["oracle (all layers anchors)"] = KascadePlan.all_anchors(fp)
    sel6 = plan_from_stats(fp, stats, 6)
    similarity_heatmap(stats, sel6.anchors, out / "similarity.png")
    importance_curve(stats, sel6.anchors, out / "importance.png")
    results = {}
    for L, n in zip(a.lengths, a.windows):
        wins = text.windows(tok, "eval", L, n, seed=1)
        t1 = time.perf_counter()
        fid = compare_plans(model, plans, wins, progress=False)
        results[L] = {k: vars(v) for k, v in fid.items()}
        print(f"length {L}: {n} windows, {time.perf_counter() - t1:.1f} s", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    import transformers

    header = (f"machine: {gpu}; torch {torch.__version__}; transformers {transformers.__version__}; "
              f"model SmolLM2-135M-Instruct (Q4_1 GGUF de-quantised to fp32)")
    lines = ["# Calibration fidelity", "", header, "",
             f"Calibration: {a.cal_samples} dev windows of {a.cal_len} tokens (pydoc_data.topics dev split), k=64, "
             f"took {cal_s:.1f} s. Evaluation: disjoint eval-split windows, teacher-forced, second half of each "
             f"window scored; budget ratio 0.10, k_min 128, tile 32, rolling.", ""]
    lines.append("| plan | anchors | " + " | ".join(f"agree {L} | KL {L}" for L in a.lengths) + " |")
    lines.append("|---|---|" + "---|---|" * len(a.lengths))
    for name, plan in plans.items():
        cells = " | ".join(f"{results[L][name]['top1_agreement']:.4f} | {results[L][name]['kl']:.4f}" for L in a.lengths)
        anchors = "all" if len(plan.anchors) == fp.num_layers else str(list(plan.anchors))
        lines.append(f"| {name} | {anchors} | {cells} |")
    lines += ["", "DP objective (fraction of an all-anchor model's):", ""]
    lines += [f"- A={r['anchors']}: {r['fraction']:.4f} {r['layers']}" for r in table]
    md = "\n".join(lines) + "\n"
    (out / "fidelity.md").write_text(md)
    (out / "fidelity.json").write_text(json.dumps(dict(header=header, calibration_s=cal_s, results=results,
                                                       plans={k: v.to_dict() for k, v in plans.items()}), indent=1))
    print(md)


if __name__ == "__main__":
    main()
