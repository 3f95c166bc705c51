"""`kascade eval`: every strategy on every task through the same attention path; files a person can read."""

from __future__ import annotations

import csv
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import text
from ..fidelity import DenseReference
from ..integration.hf import enable
from ..plots import pyplot
from . import longbench, ruler
from .strategies import make_strategy

FIDELITY = "fidelity"
TASKS = (FIDELITY, *ruler.TASKS)


def _attended_fraction(runtime) -> tuple[float, dict[int, float]]:
    if runtime is None:
        return 1.0, {}
    per_layer = {l: a / d for l, (a, d) in sorted(runtime.attended.items()) if d}
    att = sum(a for a, _ in runtime.attended.values())
    den = sum(d for _, d in runtime.attended.values())
    return (att / den if den else 1.0), per_layer


class Session:
    """One model and its strategies; runs samples under each strategy and keeps the budget accounting."""

    def __init__(self, model, tok, strategies, plan=None, budget=None, omnikv_layer=2, backend="reference"):
        self.model, self.tok, self.backend = model, tok, backend
        self.strategies = {s: make_strategy(s, model, plan, omnikv_layer=omnikv_layer, budget=budget)
                           for s in strategies}
        self.dev = next(model.parameters()).device

    def _ctx(self, name):
        spec = self.strategies[name]
        if spec is None:
            return None
        plan, selector = spec
        return enable(self.model, plan, backend=self.backend, selector=selector, account=True,
                      warn_uncalibrated=False)

    @torch.no_grad()
    def generate(self, name: str, sample: ruler.Sample):
        ids = self.tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
        ids = {k: v.to(self.dev) for k, v in ids.items()}
        handle = self._ctx(name)
        t0 = time.perf_counter()
        try:
            out = self.model.generate(**ids, max_new_tokens=sample.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id)
        finally:
            if handle is not None:
                handle.disable()
        pred = self.tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True,
                               clean_up_tokenization_spaces=False)
        frac, per_layer = _attended_fraction(handle.runtime if handle else None)
        return pred, frac, per_layer, time.perf_counter() - t0, ids["input_ids"].shape[1]

    def fidelity(self, window: torch.Tensor):
        """Per strategy: top-1 agreement and KL vs dense, and NLL of the true next tokens (second half scored)."""
        ref = DenseReference(self.model, [window])
        res = {}
        for name in self.strategies:
            handle = self._ctx(name)
            try:
                (f,) = ref.baseline() if handle is None else ref.measure()
            finally:
                if handle is not None:
                    handle.disable()
            frac, per_layer = _attended_fraction(handle.runtime if handle else None)
            res[name] = dict(agreement=f.top1_agreement, kl=f.kl, nll=f.nll, attended_fraction=frac,
                             attended_per_layer=per_layer)
        return res


def run(model, tok, *, strategies, tasks, lengths, samples, seed=0, plan=None, budget=None, longbench_file=None,
        longbench_limit=None, omnikv_layer=2, progress=True) -> list[dict]:
    """All (strategy, task, length, sample) rows."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(TASKS)}")
    sess = Session(model, tok, strategies, plan=plan, budget=budget, omnikv_layer=omnikv_layer)
    lb = longbench.load(longbench_file, limit=longbench_limit) if longbench_file else []
    jobs = [(t, L, i) for L in lengths for t in tasks for i in range(samples)] + [("longbench", None, i) for i in range(len(lb))]
    rows = []
    for task, L, i in tqdm(jobs, desc="eval", unit="sample", disable=not progress):
        if task == FIDELITY:
            win = text.windows(tok, "eval", L, samples, seed=seed)[i]
            for name, r in sess.fidelity(win).items():
                rows.append(dict(strategy=name, task=task, length=L, sample=i, score=r["agreement"], **r))
            continue
        sample = lb[i] if task == "longbench" else ruler.generate(task, tok, L, seed * 1000 + i)
        for name in strategies:
            pred, frac, per_layer, secs, n_tok = sess.generate(name, sample)
            sc = (longbench.score(sample.meta["dataset"], pred, sample.answers) if task == "longbench"
                  else ruler.string_match_all(pred, sample.answers))
            rows.append(dict(strategy=name, task=sample.task, length=L or n_tok, sample=i, score=sc,
                             attended_fraction=frac, attended_per_layer=per_layer, prediction=pred,
                             answers=sample.answers, prompt_tokens=n_tok, seconds=secs))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["strategy"], r["task"], r["length"])].append(r)
    out = []
    for (s, t, L), rs in groups.items():
        row = dict(strategy=s, task=t, length=L, samples=len(rs), score=sum(r["score"] for r in rs) / len(rs),
                   attended_fraction=sum(r["attended_fraction"] for r in rs) / len(rs))
        if t == FIDELITY:
            row.update(kl=sum(r["kl"] for r in rs) / len(rs), nll=sum(r["nll"] for r in rs) / len(rs))
        out.append(row)
    return out


def table(summary: list[dict]) -> str:
    strategies = list(dict.fromkeys(r["strategy"] for r in summary))
    cols = list(dict.fromkeys((r["task"], r["length"]) for r in summary))
    by = {(r["strategy"], r["task"], r["length"]): r for r in summary}
    head = "| strategy | attended | " + " | ".join(f"{t} {L}" + (" (agree / KL)" if t == FIDELITY else "") for t, L in cols) + " |"
    lines = [head, "|---" * (len(cols) + 2) + "|"]
    for s in strategies:
        att = [by[(s, t, L)]["attended_fraction"] for t, L in cols if (s, t, L) in by]
        cells = []
        for t, L in cols:
            r = by.get((s, t, L))
            cells.append("" if r is None else f"{r['score']:.3f} / {r['kl']:.3f}" if t == FIDELITY else f"{r['score']:.3f}")
        lines.append(f"| {s} | {sum(att) / len(att):.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(rows: list[dict], out: Path, header: str = "") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summ = summarize(rows)
    (out / "results.json").write_text(json.dumps(dict(header=header, rows=rows, summary=summ), indent=1) + "\n")
    keys = ["strategy", "task", "length", "sample", "score", "attended_fraction", "kl", "nll", "prediction", "answers"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "answers": " | ".join(r.get("answers", []))})
    md = (f"{header}\n\n" if header else "") + table(summ) + "\n"
    (out / "summary.md").write_text(md)
    files = [out / "results.json", out / "results.csv", out / "summary.md"]
    try:
        files.append(_chart(summ, out / "scores.png"))
    except ImportError as e:
        print(f"note: no chart written ({e})")
    return dict(summary=summ, markdown=md, files=files)


def _chart(summary, path: Path) -> Path:
    plt = pyplot()
    strategies = list(dict.fromkeys(r["strategy"] for r in summary))
    cols = list(dict.fromkeys((r["task"], r["length"]) for r in summary))
    by = {(r["strategy"], r["task"], r["length"]): r["score"] for r in summary}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cols) + 2), 4))
    w = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        ax.bar([c + i * w for c in range(len(cols))], [by.get((s, t, L), 0) for t, L in cols], w, label=s)
    ax.set_xticks([c + 0.4 - w / 2 for c in range(len(cols))])
    ax.set_xticklabels([f"{t}\n{L}" for t, L in cols], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("score (fidelity: top-1 agreement)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
