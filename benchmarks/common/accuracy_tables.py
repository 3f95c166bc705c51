"""The accuracy tables of the manual: fidelity on held-out windows, the needle suite, budgets by mass, the anchors'
adaptation, the retrieval plan and low-precision scoring's selections (``accuracy.json``). Rendered through
:mod:`benchmarks.common.tables`, which names every table."""

from __future__ import annotations

import statistics

from kascade.eval.results import wilson

from .cells import SCORINGS, _n, _table, results


def heldout_means() -> dict[str, dict[str, float]]:
    """Per strategy, the mean agreement / KL / attended over the five held-out 8K windows."""
    out = {}
    windows = results("accuracy")["heldout_8k"]["windows"]
    for name in dict.fromkeys(w["strategy"] for w in windows):
        mine = [w for w in windows if w["strategy"] == name]
        out[name] = {k: statistics.mean(w[k] for w in mine) for k in ("agreement", "kl", "attended")}
        out[name]["windows"] = len(mine)
    return out


STRATEGY_NAMES = {"kascade": "Kascade, the default plan", "kascade-searched-budgets": "Kascade, `searched-budgets` "
                  "(the default before)", "kascade-faithful": "Kascade, the paper's method "
                  "(`\"faithful\"`)", "streamingllm": "StreamingLLM (4 sinks + recent keys)", "quest": "Quest "
                  "(16-key pages)"}


def heldout() -> str:
    rows = [[STRATEGY_NAMES[n], f"{m['agreement']:.3f}", f"{m['kl']:.3f}", f"{m['attended']:.3f}"]
            for n, m in heldout_means().items()]
    return _table(["strategy", "agreement with dense", "KL (nats)", "keys attended"], rows)


def plans_accuracy() -> str:
    rows = []
    for r in results("accuracy")["plans"]["rows"]:
        cells = [f"**{r['description']}**" if r["plan"] == "default" else r["description"]]
        for n in ("4096", "8192"):
            c = r[n]
            cells.append(f"{c['agreement']:.3f} / {c['kl']:.3f}")
        rows.append(cells)
    return _table(["plan (6 anchors of 30)", "4K: agreement / KL", "8K: agreement / KL"], rows)


def needle() -> str:
    """The needle suite: each task and length, dense, the searched-budgets plan (``kascade``: the default when
    measured) and the default plan (``retrieval``: shipped under that name when measured), with their 95% intervals."""
    def cell(x):
        return f"{x['score']:.2f} [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}]"

    rows = [[f"`{r['task']}`", _n(r["length"]), r["samples"], cell(r["dense"]), cell(r["kascade"]),
             cell(r["retrieval"]), f"{r['kascade']['attended']:.3f}"] for r in results("accuracy")["needle"]["rows"]]
    return _table(["task", "tokens", "samples", "dense", "Kascade (`searched-budgets`, the default before)",
                   "Kascade (the default plan)", "keys attended"], rows)


def mass_budgets() -> str:
    """Budgets by attention mass against the budget by count, per plan."""
    names = {"default": "default plan", "searched-budgets": "`searched-budgets` (the default before)",
             "oracle": "every layer selects (oracle)"}
    rows = [[names[r["plan"]], "by count" if r["mass"] is None else f"mass {r['mass']}, cap {r['cap']}",
             f"{r['agreement']:.3f}", f"{r['kl']:.4f}", f"{r['attended']:.3f}"]
            for r in results("accuracy")["mass"]["rows"]]
    return _table(["plan", "budget", "agreement", "KL (nats)", "keys attended"], rows)


def adaptation_table(rows: list[dict]) -> str:
    """Anchors per input against anchors once (``benchmarks.anchor_adaptation``'s rows: plan, window, agreement,
    kl): means over windows, and each plan's per-window change of agreement against the calibrated plan's."""
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    cal = {r["window"]: r["agreement"] for r in rows if r["plan"] == "calibrated"}
    out = []
    for name in plans:
        rs = [r for r in rows if r["plan"] == name]
        d = [r["agreement"] - cal[r["window"]] for r in rs if r["window"] in cal]
        out.append([name, len(rs), f"{statistics.mean(r['agreement'] for r in rs):.4f}",
                    f"{statistics.mean(r['kl'] for r in rs):.4f}",
                    "-" if name == "calibrated" or not d else
                    f"{min(d):+.4f} / {statistics.mean(d):+.4f} / {max(d):+.4f}",
                    "-" if name == "calibrated" or not d else f"{sum(x > 0 for x in d)} / {sum(x < 0 for x in d)}"])
    return _table(["anchors chosen", "windows", "agreement", "KL (nats)",
                   "change of agreement per window: min / mean / max", "windows better / worse"], out)


def _pass_rate(passed: int, samples: int) -> str:
    """A pass rate with its 95% Wilson interval: ``0.85 [0.77, 0.91]``."""
    lo, hi = wilson(passed, samples)
    return f"{passed / samples:.2f} [{lo:.2f}, {hi:.2f}]"


def needle_phases() -> str:
    """Where the searched-budgets plan (the default when measured) loses the needle: each way's pass rate with its 95% Wilson interval."""
    t = results("accuracy")["needle_phases"]
    rows = []
    for r in t["rows"]:
        rows.append([f"`{r['way']}`", r["what"], r["samples"], _pass_rate(r["passed"], r["samples"])])
    return _table(["way", "prefill and decode", "samples", "pass rate [95% interval]"], rows)


def dense_tail() -> str:
    """The default plan with and without ``dense_tail=32`` on the same needle samples: pass rates with their 95%
    Wilson intervals, the samples one way answers and the other does not, and the keys attended."""
    t = results("accuracy")["dense_tail"]
    rows = []
    for r in t["rows"]:
        cells = [_pass_rate(r[way], r["samples"]) for way in ("plain", "tail")]
        rows.append([f"`{r['task']}`", _n(r["length"]), r["samples"], *cells, f"{r['tail_only']} / {r['plain_only']}",
                     f"{r['attended_plain']:.3f} / {r['attended_tail']:.3f}"])
    return _table(["task", "tokens", "samples", "default plan", "with `dense_tail=32`",
                   "answered one way only: with / without", "keys attended: without / with"], rows)


def retrieval_plan() -> str:
    """The default plan (shipped as "retrieval" when measured, the JSON's ``retrieval``) against searched-budgets (the
    default before, the JSON's ``default``): held-out fidelity, needles answered (paired), and the diagnosis that led
    to it (which reuse layers, selecting their own keys, bring the needle back)."""
    t = results("accuracy")["retrieval_plan"]
    rows = [[f"agreement / KL, {_n(r['length'])} ({r['windows']} held-out windows, CPU)",
             *(f"{r[p]['agreement']:.3f} / {r[p]['kl']:.3f}" for p in ("default", "retrieval")), ""]
            for r in t["fidelity"]["rows"]]
    for r in t["needle"]:
        where = f"{'H100' if 'H100' in r['machine'] else 'CPU'}, {'Triton' if 'Triton backend' in r['machine'] else 'reference'}"
        cells = [_pass_rate(r[p], r["samples"]) for p in ("default", "retrieval")]
        rows.append([f"{r['task']} {_n(r['length'])}, {r['samples']} samples ({where})", *cells,
                     f"{r['retrieval_only']} / {r['default_only']}"])
    d = t["diagnosis"]
    diag = [[r["selecting"], f"{r['passed']} of {d['samples']}"] for r in d["rows"]]
    return (_table(["measure", "searched-budgets (the default before)", "default",
                    "answered by one plan only: default / searched-budgets"], rows)
            + "\n\n" + _table(["reuse layers that select their own keys (needle_passkey 2K, CPU)", "answered"],
                                diag))


def anchor_adaptation() -> str:
    """Anchors per input against anchors once per model (issue 39's item 3)."""
    return adaptation_table(results("accuracy")["anchor_adaptation"]["rows"])


def fp8_selection() -> str:
    """Low-precision scoring's selection against exact scoring's, per scoring and shape: the exact selection's keys
    it keeps and the share of its pooled probability captured, min / mean over layers (or random draws)."""
    names = {"model": "default model, eval windows", "llama8b-random-bf16": "Llama-3.1-8B shapes, random bf16"}
    rows = [[SCORINGS[r["scoring"]], names[r["inputs"]], r["kind"], _n(r["length"]), r["layers"],
             f"{r['kept_min']:.3f} / {r['kept_mean']:.3f}", f"{r['mass_min']:.4f} / {r['mass_mean']:.4f}"]
            for r in results("accuracy")["fp8"]["selection"]]
    return _table(["scoring", "inputs", "rows", "tokens", "layers", "keys kept: min / mean",
                   "mass captured: min / mean"], rows)


def fp8_fidelity_triton() -> str:
    """The default plan on the Triton backend (bf16, a GPU) with exact and with low-precision scoring, teacher-forced
    against dense, per length, and each scoring's change of agreement from exact's in points."""
    t = results("accuracy")["fp8_triton"]["rows"]
    lengths = sorted({r["length"] for r in t})
    at = {(r["scoring"], r["length"]): r for r in t}
    rows = [[SCORINGS[s], *(f"{at[s, n]['agreement']:.3f} / {at[s, n]['kl']:.4f}" for n in lengths),
             *("" if s == "exact" else f"{100 * (at[s, n]['agreement'] - at['exact', n]['agreement']):+.2f}"
               for n in lengths)]
            for s in SCORINGS if any(r["scoring"] == s for r in t)]
    return _table(["scoring", *(f"{_n(n)}: agreement / KL" for n in lengths),
                   *(f"{_n(n)}: change, points" for n in lengths)], rows)


def fp8_fidelity() -> str:
    """The default plan (and searched-budgets, the default before it) with exact and with low-precision scoring,
    teacher-forced against dense, per length."""
    t = results("accuracy")["fp8"]["fidelity"]
    lengths = sorted({r["length"] for r in t})
    names = {"default": "default plan", "searched-budgets": "`searched-budgets`"}
    rows = [[names[p], SCORINGS[s]] + [next(f"{r['agreement']:.3f} / {r['kl']:.4f}" for r in t
                                            if (r["plan"], r["scoring"], r["length"]) == (p, s, n)) for n in lengths]
            for p in dict.fromkeys(r["plan"] for r in t) for s in SCORINGS
            if any((r["plan"], r["scoring"]) == (p, s) for r in t)]
    return _table(["plan", "scoring", *(f"{_n(n)}: agreement / KL" for n in lengths)], rows)
