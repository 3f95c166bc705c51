"""Fidelity of Kascade's tensor-parallel plans against dense attention, teacher-forced on held-out windows (CPU):

    python -m benchmarks.tp_fidelity --out OUT

Under tensor parallelism a plan runs one of two ways. With ``kascade.enable(model, plan, exchange=True)`` the ranks
all-gather the anchors' selections and run the plan unchanged: its logits equal the single-process plan's
(tests/integration/test_tensor_parallel.py), so its fidelity is the unconstrained plan's at every size and is
measured here in one process. A shard-local plan (``plan.for_tensor_parallel(n, similarity)``) moves every link that
crosses ranks to the most similar anchor head of the reuse head's own rank (similarity from calibration statistics):
no communication, possibly lower fidelity. Two models:

  default  the embedded SmolLM2-135M-Instruct (3 KV heads: 1 or 3 ranks), its shipped default and "faithful" plans,
           unconstrained against shard-local at 3 ranks. With one KV head per rank a reuse head can only follow its
           own index, so the shard-local map is the identity whatever the statistics say (checked, not computed).
  tiny     a random Llama with 8 KV heads (random weights: the numbers show the mechanism, not quality),
           calibrated on its own statistics (the paper's DP on "dev" windows), unconstrained against shard-local at
           2, 4 and 8 ranks (at 8, one head per rank: the identity map).

Every plan runs on the same "eval" windows (disjoint from "dev"); the second half of each window is scored (top-1
agreement with dense, KL(dense || plan) in nats per position, NLL of the true tokens). Writes fidelity.json and
fidelity.md into --out after each model, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import kascade
from benchmarks.common import log, out_folder
from kascade import KascadePlan, ModelFingerprint, text
from kascade.calibrate import collect_stats, plan_from_stats
from kascade.fidelity import compare_plans
from kascade.bench.report import cpu_name
from kascade.plan import shipped_plan


def row(name: str, plan: KascadePlan, tp: int, fid) -> dict:
    """One table row: the plan, the tensor-parallel size it serves, its anchors, its fidelity."""
    return dict(plan=name, tensor_parallel=tp, anchors=list(plan.anchors), **fid.as_dict())


def default_model_rows(a, model, tok) -> dict:
    fp = ModelFingerprint.from_model(model)
    log(f"default model: {fp.num_layers} layers, {fp.num_kv_heads} KV heads")
    plans, meta = {}, {}
    for name, plan in (("default", kascade.default_plan(model)), ("faithful", shipped_plan(model, "faithful"))):
        local = plan.for_tensor_parallel(fp.num_kv_heads)
        # one KV head per rank: every reuse head follows its own index, with or without statistics
        assert all(local.head_map[l] == tuple(range(fp.num_kv_heads)) for l in range(fp.num_layers)), name
        plans[f"{name}, unconstrained"] = plan
        plans[f"{name}, shard-local TP {fp.num_kv_heads}"] = local
        meta[name] = dict(crossing_links=len(plan.crossing_links(fp.num_kv_heads)), reuse_links=_links(plan))
    wins = text.windows(tok, "eval", a.length, a.windows, seed=a.seed)
    log(f"{len(plans)} plans on {a.windows} eval windows of {a.length} tokens")
    res = compare_plans(model, plans, wins)
    rows = [row(n, plans[n], fp.num_kv_heads if "shard-local" in n else 1, f) for n, f in res.items()]
    return dict(model="SmolLM2-135M-Instruct (Q4_1 GGUF de-quantised to fp32)", kv_heads=fp.num_kv_heads,
                length=a.length, windows=a.windows, links=meta, rows=rows)


def _links(plan: KascadePlan) -> int:
    """Reuse links (reuse layer, KV head) of the plan: the most that can cross ranks."""
    return sum(len(pairs) for l in range(plan.num_layers) if not plan.is_anchor(l) for pairs in plan.sources_of(l))


def tiny_model_rows(a, tok) -> dict:
    import transformers

    torch.manual_seed(a.tiny_seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=a.tiny_layers, num_attention_heads=16, num_key_value_heads=8,
                                   head_dim=32, max_position_embeddings=8192, rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    fp = ModelFingerprint.from_model(model)
    dev = text.windows(tok, "dev", a.tiny_length, a.tiny_stats_windows, seed=0)
    log(f"tiny random Llama: {fp.num_layers} layers, {fp.num_kv_heads} KV heads; statistics on {len(dev)} dev "
        f"windows of {a.tiny_length} tokens")
    stats = collect_stats(model, dev)
    plan = plan_from_stats(fp, stats, a.tiny_anchors, source="the paper's DP on the tiny model's statistics")
    plans, links = {"unconstrained (= exchange at any TP)": plan}, {}
    for tp in a.tiny_tp:
        links[tp] = len(plan.crossing_links(tp))
        local = plan.for_tensor_parallel(tp, stats.similarity)
        if links[tp]:
            plans[f"shard-local TP {tp}"] = local
        else:  # nothing crosses: the shard-local plan is the unconstrained one
            assert local.head_map == plan.head_map
    wins = text.windows(tok, "eval", a.tiny_length, a.tiny_windows, seed=a.seed)
    log(f"{len(plans)} plans on {a.tiny_windows} eval windows of {a.tiny_length} tokens; crossing links {links}")
    res = compare_plans(model, plans, wins)
    rows = []
    for n, f in res.items():
        tp = int(n.rsplit(" ", 1)[1]) if n.startswith("shard-local") else 1
        rows.append(row(n, plans[n], tp, f))
    return dict(model=f"random Llama (seed {a.tiny_seed}; hidden 256, {a.tiny_layers} layers, 16 query heads, 8 KV "
                f"heads, head dim 32, transformers' default initialisation, the default model's tokenizer)",
                kv_heads=fp.num_kv_heads, length=a.tiny_length, windows=a.tiny_windows,
                stats_windows=a.tiny_stats_windows, anchors=list(plan.anchors), crossing_links=links,
                reuse_links=_links(plan), rows=rows)


def write(out: Path, res: dict) -> None:
    (out / "fidelity.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Tensor-parallel plans: fidelity against dense", "", res["header"], "", f"command: `{res['command']}`",
             "", "Teacher-forced on held-out `eval` windows, second half of each window scored; budget ratio 0.10, "
             "k_min 128, tile 32, rolling. *Unconstrained* is the global plan: what `exchange=True` computes at any "
             "tensor-parallel size (its logits equal one process's, tests/integration/test_tensor_parallel.py).", ""]
    for key, title in (("default", "Default model"), ("tiny", "Random tiny Llama, 8 KV heads (random weights: the "
                                                               "mechanism, not quality)")):
        if key not in res:
            continue
        r = res[key]
        lines += [f"## {title}", "", f"{r['model']}; {r['windows']} windows of {r['length']} tokens "
                  f"({r['rows'][0]['positions']} scored positions per plan)."]
        if key == "tiny":
            lines += [f"Plan: anchors {r['anchors']} from the paper's DP on {r['stats_windows']} `dev` windows of "
                      f"{r['length']} tokens; links that cross ranks (of {r['reuse_links']} reuse links): "
                      + ", ".join(f"TP {tp}: {n}" for tp, n in r["crossing_links"].items()) + "."]
        else:
            lines += ["Links that cross ranks at TP 3: " + ", ".join(
                f"{n} {m['crossing_links']} of {m['reuse_links']}" for n, m in r["links"].items()) + "."]
        lines += ["", "| plan | TP | top-1 agreement | KL (nats) | NLL |", "|---|---|---|---|---|"]
        for x in r["rows"]:
            tp = "1; any with exchange" if "unconstrained" in x["plan"] else x["tensor_parallel"]
            lines.append(f"| {x['plan']} | {tp} | {x['agreement']:.4f} | {x['kl']:.4f} | {x['nll']:.4f} |")
        lines.append("")
    (out / "fidelity.md").write_text("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for fidelity.json and fidelity.md (default out/tp_fidelity)")
    p.add_argument("--models", nargs="+", default=["default", "tiny"], choices=["default", "tiny"])
    p.add_argument("--length", type=int, default=2048, help="default model: tokens per eval window")
    p.add_argument("--windows", type=int, default=3, help="default model: eval windows")
    p.add_argument("--seed", type=int, default=1, help="seed of the eval windows")
    p.add_argument("--tiny-length", type=int, default=1024, help="tiny model: tokens per dev and eval window")
    p.add_argument("--tiny-windows", type=int, default=4, help="tiny model: eval windows")
    p.add_argument("--tiny-stats-windows", type=int, default=2, help="tiny model: dev windows of the statistics")
    p.add_argument("--tiny-layers", type=int, default=8)
    p.add_argument("--tiny-anchors", type=int, default=3, help="tiny model: anchors (layer 0 included)")
    p.add_argument("--tiny-tp", type=int, nargs="+", default=[1, 2, 4, 8], help="tiny model: tensor-parallel sizes")
    p.add_argument("--tiny-seed", type=int, default=0, help="seed of the tiny model's random weights")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = p.parse_args(argv)
    for name in ("length", "windows", "tiny_length", "tiny_windows", "tiny_stats_windows", "tiny_layers",
                 "tiny_anchors"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.tiny_anchors > a.tiny_layers:
        p.error("--tiny-anchors must be at most --tiny-layers")
    if any(tp < 1 or 8 % tp for tp in a.tiny_tp):
        p.error("--tiny-tp sizes must divide the tiny model's 8 KV heads")
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    out = out_folder(a.out, "tp_fidelity")
    header = (f"machine: CPU {cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads, shared "
              f"with other work); torch {torch.__version__}; transformers {transformers.__version__}; fp32, reference "
              "backend")
    res = dict(header=header, command=" ".join(["python", *sys.argv]), args=vars(a), seconds={})
    log(header)
    t = time.perf_counter()
    model, tok = kascade.load_default_model()  # the tiny model reads its text windows with this tokenizer too
    log(f"default model loaded in {time.perf_counter() - t:.1f} s")
    if "default" in a.models:
        t = time.perf_counter()
        res["default"] = default_model_rows(a, model, tok)
        res["seconds"]["default"] = round(time.perf_counter() - t, 1)
        write(out, res)
        log(f"default model done in {res['seconds']['default']} s")
    del model
    if "tiny" in a.models:
        t = time.perf_counter()
        res["tiny"] = tiny_model_rows(a, tok)
        res["seconds"]["tiny"] = round(time.perf_counter() - t, 1)
        write(out, res)
        log(f"tiny model done in {res['seconds']['tiny']} s")
    log(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'}")


if __name__ == "__main__":
    main()
