"""`kascade calibrate`: data loading, the statistics pass, the DP per budget, files a person can read."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from .. import text
from ..eval.fidelity import compare_plans
from ..models import load_model
from ..plan import ModelFingerprint
from . import collect_stats, min_window_tokens, objective_table, plan_from_stats


def load_texts(path: str | Path, field: str = "text") -> list[str]:
    """Texts from a JSONL file (one JSON object per line, the text under ``field``) or a plain-text file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    raw = path.read_text()
    if not raw.strip():
        raise ValueError(f"the data file {path} is empty")
    if path.suffix not in (".jsonl", ".json"):
        return [raw]
    texts = []
    for n, obj in text.iter_jsonl(path):
        if field not in obj:
            raise ValueError(f"{path}:{n}: no {field!r} field (use --text-field to name another)")
        if not isinstance(obj[field], str):
            raise ValueError(f"{path}:{n}: the {field!r} field is not a string")
        texts.append(obj[field])
    if not texts:
        raise ValueError(f"the data file {path} holds no texts")
    return texts


def dev_windows(tok, *, data=None, field="text", seq_len: int, count: int, seed: int = 0, skip: int = 0,
                need: str = "--samples plus --holdout") -> list[torch.Tensor]:
    """``count`` token windows of at most ``seq_len`` tokens: from the user's texts (the first ``seq_len`` tokens of
    each, after the first ``skip`` texts) or from the development split of pydoc_data.topics (``seed`` picks)."""
    if data is None:
        return text.windows(tok, "dev", seq_len, count, seed=seed)
    texts = load_texts(data, field)
    if len(texts) < skip + count:
        raise ValueError(f"{data} holds {len(texts)} texts; {skip + count} are needed ({need})")
    return [torch.tensor(tok(t, add_special_tokens=False).input_ids[:seq_len]) for t in texts[skip : skip + count]]


def run(args) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, tok = load_model(args.model, device=args.device, dtype=dtype)
    fp = ModelFingerprint.from_model(model)
    if args.anchors is not None and not 1 <= args.anchors <= fp.num_layers:
        raise ValueError(f"--anchors must be in 1..{fp.num_layers} (the model's layer count), got {args.anchors}")
    need = min_window_tokens(args.k, args.tile)
    if args.seq_len < need:
        raise ValueError(f"--seq-len {args.seq_len} is too short: at least {need} tokens (one tile after k keys)")
    holdout = args.holdout if args.target_agreement is not None else 0
    wins = dev_windows(tok, data=args.data, field=args.text_field, seq_len=args.seq_len,
                       count=args.samples + holdout, seed=args.seed)
    stats = collect_stats(model, wins[: args.samples], k=args.k, tile=args.tile)
    max_a = min(args.max_anchors, fp.num_layers)
    table = objective_table(stats, max_a)
    budget = dict(ratio=args.ratio, k_min=args.k_min, tile=args.tile, rolling=not args.no_rolling)

    measured = {}
    if args.target_agreement is not None:
        chosen = None
        for A in range(2, max_a + 1):
            plan = plan_from_stats(fp, stats, A, **budget)
            fid = compare_plans(model, {f"A={A}": plan}, wins[args.samples :], progress=False)[f"A={A}"]
            measured[A] = fid
            print(f"  A={A:2d} anchors {list(plan.anchors)}: held-out {fid}", flush=True)
            if fid.top1_agreement >= args.target_agreement:
                chosen = A
                break
        if chosen is None:
            raise ValueError(f"no plan with up to {max_a} anchors reached agreement {args.target_agreement} on the "
                             f"held-out windows (best: {max(f.top1_agreement for f in measured.values()):.4f})")
        num_anchors = chosen
    else:
        num_anchors = args.anchors
    plan = plan_from_stats(fp, stats, num_anchors, **budget)
    method = getattr(args, "method", "faithful")
    if method != "faithful":
        plan = _variant_plan(args, model, tok, fp, stats, num_anchors, budget)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    (out / "stats.json").write_text(json.dumps(stats.to_dict()) + "\n")
    with open(out / "objective.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["anchors", "objective", "fraction_of_all_anchor", "layers", "heldout_agreement", "heldout_kl"])
        for row in table:
            m = measured.get(row["anchors"])
            w.writerow([row["anchors"], f"{row['objective']:.5f}", f"{row['fraction']:.5f}",
                        " ".join(map(str, row["layers"])), f"{m.top1_agreement:.4f}" if m else "",
                        f"{m.kl:.4f}" if m else ""])
    pictures = []
    try:
        from .plots import importance_curve, similarity_heatmap

        pictures = [similarity_heatmap(stats, plan.anchors, out / "similarity.png"),
                    importance_curve(stats, plan.anchors, out / "importance.png")]
    except ImportError as e:
        print(f"note: no plots written ({e})")
    return dict(plan=plan, stats=stats, table=table, out=out, pictures=pictures, measured=measured)


def _variant_plan(args, model, tok, fp, stats, num_anchors, budget):
    """`--method`: issue 8's variants (kascade.calibrate.variants) on top of the same statistics; `--lengths` adds
    statistics at other lengths (length-aware plans, one search per length)."""
    from . import variants

    lengths = sorted(set(args.lengths or [args.seq_len]))
    by_len = {args.seq_len: stats} if args.seq_len in lengths else {}
    for n in lengths:
        if n not in by_len:
            by_len[n] = collect_stats(model, dev_windows(tok, data=args.data, field=args.text_field, seq_len=n,
                                                         count=args.samples, seed=args.seed), k=args.k, tile=args.tile)
    search = None
    if args.method in ("search", "measured"):
        # scored on other development windows than the statistics' (another seed; with --data, the texts after
        # those of the statistics and the holdout)
        used = args.samples + (args.holdout if args.target_agreement is not None else 0)
        search = {n: dev_windows(tok, data=args.data, field=args.text_field, seq_len=n, count=args.search_windows,
                                 seed=args.seed + 11, skip=used,
                                 need="--samples, --holdout and --search-windows") for n in lengths}
    return variants.plan_from_method(args.method, model, by_len, num_anchors, rule=args.rule,
                                     search_windows=search, max_evals=args.search_evals, budget=budget, log=print)


def report(r: dict) -> str:
    plan = r["plan"]
    lines = [f"{'A':>3} {'objective':>10} {'of all-anchor':>14}  anchors"]
    for row in r["table"]:
        mark = " <- chosen" if row["anchors"] == len(plan.anchors) else ""
        lines.append(f"{row['anchors']:3d} {row['objective']:10.4f} {row['fraction']:14.4f}  {row['layers']}{mark}")
    reuse = [b for b in range(plan.num_layers) if not plan.is_anchor(b)]
    remapped = sum(plan.head_map[b] != tuple(range(plan.fingerprint.num_kv_heads)) for b in reuse)
    lines += ["", f"plan: anchors {list(plan.anchors)}; {remapped} of {len(reuse)} reuse layers follow other heads",
              f"wrote {r['out'] / 'plan.json'}, stats.json, objective.csv"
              + "".join(f", {p.name}" for p in r["pictures"])]
    return "\n".join(lines)
