"""Reuse variants against the paper's rule and the oracle at the same cost, one GPU call:

    python -m benchmarks.variants --model MODEL.gguf --device cuda --out OUT

Stages (results are written after each, so a run cut short keeps what it finished; --skip drops stages):
  1 calibrate  streamed statistics on "dev" windows at every --lengths (one set per length)
  2 screen     every reuse rule at the faithful anchors, scored by measured KL on separate dev windows; the
               rules that lower the dev KL are combined
  3 search     anchor search by measured dev KL (faithful rule, and the combined rule), one per length
  4 eval       faithful Kascade, the oracle and every variant on held-out "eval" windows (teacher-forced
               agreement, KL, attended fraction measured from the selections)
  5 niah       ruler niah_single_number at --niah-lengths (dense, kascade, oracle, combined, best; --niah-all)
Writes results.json, README.md, plans/<variant>.json and plan_best.json (the variant with the lowest mean dev KL;
chosen on dev windows, never on eval) into --out. Everything in fp32, same anchor count and budget for all.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kascade import KascadePlan, ModelFingerprint, text
from kascade.calibrate import collect_stats
from kascade import calibrate as cv
from kascade.eval import ruler
from kascade.eval.runner import _attended_fraction  # the evaluation's own accounting of attended keys
from benchmarks.common import log, out_folder
from benchmarks.common.fidelity import evaluate
from kascade.fidelity import DenseReference
from kascade.integration.hf import enable
from kascade.models import load_model

GOAL = {8192: (0.95, 0.02), 4096: (0.92, None)}
STAGES = ("calibrate", "screen", "search", "eval", "niah")


@torch.no_grad()
def niah(model, tok, plans: dict, length: int, samples: int, backend: str) -> dict:
    dev = next(model.parameters()).device
    out = {n: dict(score=0.0, attended_fraction=0.0, predictions=[]) for n in ["dense", *plans]}
    for i in range(samples):
        smp = ruler.generate("niah_single_number", tok, length, i)
        ids = tok.apply_chat_template([{"role": "user", "content": smp.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        ids = {k: v.to(dev) for k, v in ids.items()}
        for name in out:
            h = None if name == "dense" else enable(model, plans[name], account=True, warn_uncalibrated=False,
                                                    backend=backend)
            try:
                g = model.generate(**ids, max_new_tokens=smp.max_new_tokens, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
            finally:
                if h is not None:
                    h.disable()
            pred = tok.decode(g[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            o = out[name]
            o["score"] += ruler.string_match_all(pred, smp.answers) / samples
            o["attended_fraction"] += (_attended_fraction(h.runtime)[0] if h else 1.0) / samples
            o["predictions"].append(dict(pred=pred, answers=smp.answers))
    return out


def describe(plan: KascadePlan | None) -> str:
    if plan is None:
        return ""
    parts = []
    r = plan.reuse
    if r.sources is not None:
        parts.append(f"sources (up to {max(len(p) for row in r.sources for p in row)} per head)")
    if r.factor is not None:
        parts.append(f"factor {min(r.factor):.2f}-{max(r.factor):.2f}")
    if r.recent:
        parts.append(f"{r.sinks} sinks + recent {r.recent:.0%}")
    if plan.by_length:
        parts.append("by_length " + ", ".join(f"<= {m}: {list(p.anchors)}" for m, p in plan.by_length))
    return "; ".join(parts)


def write(out: Path, res: dict, plans: dict, header: str, lengths, niah_lengths) -> None:
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    pdir = out / "plans"
    pdir.mkdir(exist_ok=True)
    for name, p in plans.items():
        p.save(pdir / f"{name}.json")
    ev, nh, devs = res.get("eval", {}), res.get("niah", {}), res.get("dev_scores", {})
    lines = ["# Issue 8: Kascade variants at equal cost", "", header, "",
             "Same budget for every row (ratio 0.10, k_min 128, tile 32, rolling); anchor count = the faithful "
             "plan's (oracle: every layer). Calibration, screening and search on the dev split only; agreement / "
             "KL on held-out eval windows (second half scored). attended = measured fraction of causal keys "
             "attended over all layers (layer 0 dense), mean over the eval windows. Goal: 8K agreement >= 0.95 "
             "and KL <= 0.02, 4K agreement >= 0.92.", ""]
    cols = [f"agree {L} | KL {L}" for L in lengths] + [f"NIAH {L}" for L in niah_lengths]
    lines.append("| variant | anchors | attended | " + " | ".join(cols) + " | dev KL | goal | details |")
    lines.append("|---" * (len(lengths) * 2 + len(niah_lengths) + 6) + "|")
    names = list(dict.fromkeys(["dense", *plans]))
    for name in names:
        p = plans.get(name)
        cells, ok, fr, checked = [], True, [], False
        for L in lengths:
            r = ev.get(str(L), {}).get(name)
            if r is None:
                cells += ["", ""]
                ok = False
                continue
            cells += [f"{r['agreement']:.4f}", f"{r['kl']:.4f}"]
            fr.append(r["attended_fraction"])
            g = GOAL.get(L)
            checked |= g is not None
            if g and (r["agreement"] < g[0] or (g[1] is not None and r["kl"] > g[1])):
                ok = False
        for L in niah_lengths:
            r = nh.get(str(L), {}).get(name)
            cells.append("" if r is None else f"{r['score']:.2f}")
        anchors = "" if p is None else ("all" if len(p.anchors) == p.num_layers else str(len(p.anchors)))
        att = f"{sum(fr) / len(fr):.4f}" if fr else ("1.0000" if name == "dense" else "")
        dk = devs.get(name)
        goal = "" if name in ("dense", "oracle") or not fr else ("n/a" if not checked else "yes" if ok else "no")
        lines.append(f"| {name} | {anchors} | {att} | " + " | ".join(cells) +
                     f" | {'' if dk is None else f'{dk:.4f}'} | {goal} | {describe(p)} |")
    if res.get("best"):
        lines += ["", f"Best variant by mean dev KL: **{res['best']}** (plan_best.json)."]
    if res.get("combined_rule"):
        lines += [f"Combined reuse rule chosen on dev: `{res['combined_rule']}` (layer-budget alpha "
                  f"{res.get('alpha')}); kascade-best = that rule with anchors searched per length."]
    lines += ["", "Stage timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res.get("timings", {}).items())]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="output folder (default out/variants)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--anchors", type=int, default=6)
    p.add_argument("--cal-windows", type=int, default=6, help="calibration windows per length (dev split)")
    p.add_argument("--dev-windows", type=int, default=2, help="screening / search windows per length (dev split)")
    p.add_argument("--eval-windows", type=int, nargs="+", default=[8, 5], help="eval windows per length")
    p.add_argument("--search-evals", type=int, default=24, help="plans scored per anchor search")
    p.add_argument("--niah-lengths", type=int, nargs="*", default=[2048, 4096])
    p.add_argument("--niah-samples", type=int, default=2)
    p.add_argument("--niah-all", action="store_true",
                   help="NIAH for every variant (default: dense, kascade, oracle, kascade-combined and the best; "
                   "generation with the reference ops is the slowest stage)")
    p.add_argument("--skip", nargs="*", default=[], choices=STAGES)
    p.add_argument("--backend", default="reference", choices=["reference", "auto", "triton"],
                   help="attention backend for every run (default: reference, the specification)")
    a = p.parse_args(argv)
    if len(a.eval_windows) == 1:
        a.eval_windows = a.eval_windows * len(a.lengths)
    if len(a.eval_windows) != len(a.lengths):
        raise SystemExit("--eval-windows needs one count, or one per --lengths")
    out = out_folder(a.out, "variants")
    torch.manual_seed(0)
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32)
    fp = ModelFingerprint.from_model(model)
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"CPU ({platform.machine()})"
    import transformers

    header = (f"machine: {gpu}; torch {torch.__version__}; transformers {transformers.__version__}; "
              f"SmolLM2-135M-Instruct fp32; backend {a.backend}; {a.anchors} anchors; calibration {a.cal_windows} dev windows per length, "
              f"screen/search {a.dev_windows} other dev windows per length, eval windows {a.eval_windows}")
    log(f"model loaded ({fp.num_layers} layers); {header}")
    res = dict(header=header, args=vars(a), timings={})
    plans: dict[str, KascadePlan] = {}
    lengths = sorted(a.lengths)
    top = lengths[-1]

    # 1. calibration -------------------------------------------------------------------------------------------
    t = time.perf_counter()
    stats = {}
    for L in lengths:
        stats[L] = collect_stats(model, text.windows(tok, "dev", L, a.cal_windows, seed=0), progress=False)
        (out / f"stats_{L}.json").write_text(json.dumps(stats[L].to_dict()) + "\n")
        log(f"calibrated at {L} tokens ({a.cal_windows} windows)")
    res["timings"]["calibrate"] = time.perf_counter() - t
    base_anchors = cv.dp_anchors(stats[top], a.anchors)
    plans["kascade"] = cv.plan_for_rule(fp, stats[top], base_anchors, "faithful")
    plans["oracle"] = KascadePlan.all_anchors(fp)
    for rule in ("any-anchor", "union2", "sinks", "layer-budget"):
        plans[f"kascade-{rule}"] = cv.plan_for_rule(fp, stats[top], base_anchors, rule)
    if len(lengths) > 1:
        plans["kascade-length"] = cv.length_plan(fp, stats, a.anchors)
    res["faithful_anchors"] = list(base_anchors)
    log(f"faithful anchors {list(base_anchors)}; length-aware: {describe(plans.get('kascade-length'))}")
    write(out, res, plans, header, lengths, [])

    # 2. screen on dev windows (not the calibration ones: another seed) ----------------------------------------
    scorers = {L: DenseReference(model, text.windows(tok, "dev", L, a.dev_windows, seed=11),
                                 backend=a.backend) for L in lengths}

    def dev_kl(plan):
        return sum(scorers[L](plan.for_length(L) if plan.by_length else plan)["kl"] for L in lengths) / len(lengths)

    dev_scores = {}
    rule, alpha = "faithful", cv.ALPHA
    if "screen" not in a.skip:
        t = time.perf_counter()
        for name, plan in plans.items():
            if name != "oracle":
                dev_scores[name] = dev_kl(plan)
                log(f"  dev KL {name}: {dev_scores[name]:.4f}")
        # combine: the best source rule, then add sinks / layer-budget where each lowers the dev KL
        best_src = min(("faithful", "any-anchor", "union2"),
                       key=lambda r: dev_scores["kascade" if r == "faithful" else f"kascade-{r}"])
        rule, cur = best_src, dev_scores["kascade" if best_src == "faithful" else f"kascade-{best_src}"]
        for extra in ("sinks", "layer-budget"):
            cand = extra if rule == "faithful" else f"{rule}+{extra}"
            kl = dev_kl(cv.plan_for_rule(fp, stats[top], base_anchors, cand))
            log(f"  dev KL rule {cand}: {kl:.4f} (current {rule}: {cur:.4f})")
            if kl < cur:
                rule, cur = cand, kl
        if "layer-budget" in rule:  # how strongly budgets follow the dissimilarity: the default, or 0.5 / 2
            for al in (0.5, 2.0):
                kl = dev_kl(cv.plan_for_rule(fp, stats[top], base_anchors, rule, alpha=al))
                log(f"  dev KL rule {rule} alpha {al}: {kl:.4f} (current alpha {alpha}: {cur:.4f})")
                if kl < cur:
                    alpha, cur = al, kl
        res["combined_rule"], res["alpha"] = rule, alpha
        if rule != "faithful":
            plans["kascade-combined"] = cv.plan_for_rule(fp, stats[top], base_anchors, rule, alpha=alpha)
            dev_scores["kascade-combined"] = cur
        res["timings"]["screen"] = time.perf_counter() - t
        res["dev_scores"] = dev_scores
        write(out, res, plans, header, lengths, [])

    # 3. anchor search by measured dev KL, one per length, then a length-aware plan of the searched anchors -------
    if "search" not in a.skip:
        t = time.perf_counter()
        res["search"] = {}
        for label, r in (("kascade-search", "faithful"), ("kascade-best", rule)):
            if label == "kascade-best" and rule == "faithful":
                continue
            found = {}
            for L in lengths:
                best, s, hist = cv.search_anchors(lambda an: cv.plan_for_rule(fp, stats[L], an, r, alpha=alpha),
                                                  scorers[L],
                                                  cv.dp_anchors(stats[L], a.anchors), fp.num_layers,
                                                  max_evals=a.search_evals, progress=False)
                found[L] = best
                res["search"][f"{label}@{L}"] = dict(rule=r, best=list(best), score=s, history=hist)
                log(f"  search {label} at {L}: {list(best)} dev KL {s['kl']:.4f} ({len(hist)} plans)")
            if len(lengths) > 1:
                plans[label] = cv.length_plan(fp, stats, a.anchors, r, anchors_by_length=found, alpha=alpha)
            else:
                plans[label] = cv.plan_for_rule(fp, stats[top], found[top], r, alpha=alpha)
            dev_scores[label] = dev_kl(plans[label])
            log(f"  dev KL {label}: {dev_scores[label]:.4f}")
        res["timings"]["search"] = time.perf_counter() - t
        res["dev_scores"] = dev_scores
        write(out, res, plans, header, lengths, [])
    del scorers  # the cached dense logits

    cands = {n: s for n, s in dev_scores.items() if n in plans}
    if cands:
        res["best"] = min(cands, key=cands.get)
        plans[res["best"]].save(out / "plan_best.json")

    # 4. held-out evaluation -------------------------------------------------------------------------------------
    if "eval" not in a.skip:
        t = time.perf_counter()
        res["eval"] = {}
        for L, n in zip(a.lengths, a.eval_windows):
            t1 = time.perf_counter()
            res["eval"][str(L)] = evaluate(model, plans, text.windows(tok, "eval", L, n, seed=1),
                                         a.backend)
            log(f"eval at {L}: {n} windows, {time.perf_counter() - t1:.1f} s")
            write(out, res, plans, header, lengths, [])
        res["timings"]["eval"] = time.perf_counter() - t

    # 5. NIAH ----------------------------------------------------------------------------------------------------
    if "niah" not in a.skip and a.niah_lengths:
        t = time.perf_counter()
        res["niah"] = {}
        keep = plans if a.niah_all else {n: p for n, p in plans.items()
                                         if n in ("kascade", "oracle", "kascade-combined", res.get("best"))}
        for L in a.niah_lengths:
            res["niah"][str(L)] = niah(model, tok, keep, L, a.niah_samples, a.backend)
            log(f"niah at {L}: " + ", ".join(f"{k} {v['score']:.2f}" for k, v in res["niah"][str(L)].items()))
            write(out, res, plans, header, lengths, a.niah_lengths)
        res["timings"]["niah"] = time.perf_counter() - t
    write(out, res, plans, header, lengths, a.niah_lengths if "niah" not in a.skip else [])
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
