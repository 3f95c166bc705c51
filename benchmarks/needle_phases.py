"""Where Kascade loses the needle: its prefill, its decode, or both (issue 39's needle gap).

Each needle sample is answered greedily six ways, the prompt's prefill and the answer's decode steps each dense or
under a plan: dense / dense, plan / plan (what ``kascade eval`` measures), plan prefill / dense decode, dense
prefill / plan decode, the oracle (every layer selects its own keys) in both phases, and the plan with the prompt's
last 32 tokens (one tile: the question's end and the chat template's turn marks) attended densely in every layer
(``Budget.dense_tail=32``).
The pass rate of each, with 95% Wilson intervals, says which phase the default plan's misses come from.

    python -m benchmarks.needle_phases [--task needle_passkey] [--length 2048] [--samples 40] [--plan NAME|FILE]
        [--out DIR]

Writes rows.jsonl (one line per sample and way, appended as they finish; a rerun skips them) and summary.md under
--out (default out/needle_phases). CPU, fp32, the reference backend.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from benchmarks.common import RowLog, out_folder
from kascade import enable
from kascade.eval import needle
from kascade.eval.results import wilson
from kascade.models import load_model
from kascade.plan import KascadePlan, ModelFingerprint, resolve_plan

WAYS = {  # name: (what it is, the prefill's plan, the decode's plan)
    "dense": ("dense", None, None),
    "plan": ("the plan (prefill and decode)", "plan", "plan"),
    "plan-prefill": ("the plan's prefill, dense decode", "plan", None),
    "plan-decode": ("dense prefill, the plan's decode", None, "plan"),
    "oracle": ("every layer selects (prefill and decode)", "oracle", "oracle"),
    "plan-dense-tail": ("the plan, the prompt's last 32 tokens prefilled densely", "plan-dense-tail", "plan"),
}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="needle_passkey", choices=needle.TASKS)
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--ways", default=None,
                   help="comma list of the ways to run (default: all): " + ", ".join(WAYS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", default="default",
                   help="the plan of the plan ways: a shipped plan's name or a plan file (default: default)")
    p.add_argument("--model", default=None, help="GGUF or Hugging Face folder (default: the embedded model)")
    p.add_argument("--out", default=None, help="output folder (default out/needle_phases)")
    return p.parse_args(argv)


@torch.no_grad()
def answer(model, tok, ids: dict, prefill, decode, max_new: int) -> str:
    """Greedy answer with the prompt's prefill under ``prefill`` and each decode step under ``decode`` (plans, or
    None for dense)."""
    def phase(plan):
        return (contextlib.nullcontext() if plan is None
                else enable(model, plan, backend="reference", warn_uncalibrated=False))

    mask = ids["attention_mask"]
    with phase(prefill):
        out = model(input_ids=ids["input_ids"], attention_mask=mask, use_cache=True)
    cache = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [nxt]
    with phase(decode):
        for _ in range(max_new - 1):
            if nxt.item() == tok.eos_token_id:
                break
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
    return tok.decode(torch.cat(tokens, 1)[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def summary(rows: list[dict], args) -> str:
    lines = [f"{args.task}, {args.length} tokens, plan {args.plan}, greedy, reference backend; pass rate [95% Wilson "
             "interval]", "",
             "| way | what | samples | passed | pass rate |", "|---|---|---|---|---|"]
    for way, (what, *_) in WAYS.items():
        rs = [r for r in rows if r["way"] == way]
        if rs:
            k = sum(r["score"] for r in rs)
            lo, hi = wilson(round(k), len(rs))
            lines.append(f"| `{way}` | {what} | {len(rs)} | {k:g} | {k / len(rs):.2f} [{lo:.2f}, {hi:.2f}] |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    a = _parse(argv)
    names = list(WAYS) if a.ways is None else a.ways.split(",")
    if any(w not in WAYS for w in names):
        raise SystemExit(f"--ways: choose from {', '.join(WAYS)}")
    out = out_folder(a.out, "needle_phases")
    model, tok = load_model(a.model, device="cpu", dtype=torch.float32)
    plans = {"plan": resolve_plan(a.plan, model)}
    plans["plan-dense-tail"] = plans["plan"].with_budget(dense_tail=32)  # Budget.dense_tail: one tile
    plans["oracle"] = KascadePlan.all_anchors(ModelFingerprint.from_model(model), ratio=plans["plan"].ratio,
                                              k_min=plans["plan"].k_min)
    log = RowLog(out / "rows.jsonl", task=a.task, length=a.length, seed=a.seed, plan=a.plan)
    for i in range(a.samples):
        sample = needle.generate(a.task, tok, a.length, a.seed, i)
        ids = tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        t0 = time.perf_counter()
        for way in names:
            if not log.has(sample=i, way=way):
                _, pre, dec = WAYS[way]
                pred = answer(model, tok, dict(ids), plans.get(pre), plans.get(dec), sample.max_new_tokens)
                log.add(sample=i, way=way, score=needle.score(sample, pred), prediction=pred,
                        depth=sample.meta["depth"])
        print(f"sample {i}: " + ", ".join(f"{r['way']} {r['score']:g}" for r in log.rows if r["sample"] == i)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = log.rows
    text = summary(rows, a)
    (out / "summary.md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
