"""`kascade calibrate`: development windows, the statistics pass, one plan by the chosen method, files to read.

    r = run(Settings(seq_len=4096, samples=4, anchors=6, method="faithful", out="cal"))
    print(report(r))

Methods (``Settings.method``): a reuse rule of :mod:`kascade.calibrate.rules` (``faithful``: the paper's method, the
DP's anchors and the argmax head map; ``any-anchor``, ``union2``, ``sinks``, ``layer-budget``, or several joined by
``+``), ``length`` (one sub-plan per calibration length), ``search`` (anchors by measured KL,
:mod:`kascade.calibrate.search`) and ``measured`` (the shipped default's method: that search with the faithful rule
on the development windows of every length together, then per-layer budgets from each layer's measured sensitivity
on the same windows, :mod:`kascade.calibrate.budgets`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import text
from ..fidelity import DenseReference, pool
from ..models import load_model
from ..plan import KascadePlan, ModelFingerprint
from .budgets import MEASURED_GRID, layer_sensitivity, measured_budget_plan
from .dp import dp_anchors, objective_table, plan_from_stats
from .rules import RULES, fingerprint, length_plan, plan_for_rule
from .search import searched_plan
from .stats import DEFAULT_K, CalibrationStats, collect_stats, min_window_tokens

METHODS = (*RULES, "length", "search", "measured")


def is_method(name: str) -> bool:
    """Whether ``name`` is one of :data:`METHODS` or reuse rules joined by ``+``."""
    return name in METHODS or all(x in RULES for x in name.split("+"))


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


def plan_from_method(method: str, model, stats_by_length: dict[int, CalibrationStats], num_anchors: int, *,
                     rule: str | None = None, search_windows: dict[int, list] | None = None, max_evals: int = 40,
                     budget: dict | None = None, progress: bool = True, log=None) -> KascadePlan:
    """One plan of a method (module docstring): a reuse rule on the longest length's statistics, ``length``
    (sub-plans per length with ``rule``), ``search`` (measured search on ``search_windows``, per length when
    several lengths are given) or ``measured``."""
    fp = fingerprint(model)
    lengths = sorted(stats_by_length)
    kw = dict(budget=budget)
    if method == "length":
        return length_plan(fp, stats_by_length, num_anchors, rule or "faithful", **kw)
    if method == "measured":
        if not search_windows:
            raise ValueError("method 'measured' needs development windows to score plans on")
        wins = [w for n in lengths for w in search_windows[n]]
        scorer = DenseReference(model, wins)
        plan, _ = searched_plan(model, stats_by_length[lengths[-1]], wins, num_anchors, "faithful",
                                max_evals=max_evals, progress=progress, log=log, scorer=scorer, **kw)
        sens = layer_sensitivity(scorer, plan, progress=progress, log=log)
        return measured_budget_plan(plan, sens, source=f"{plan.source}; per-layer budgets {list(MEASURED_GRID)} "
                                    "from each layer's measured sensitivity on the same windows (measured budgets)")
    if method == "search":
        if not search_windows:
            raise ValueError("method 'search' needs development windows to score plans on")
        plans = {}
        for n in lengths:
            plans[n], _ = searched_plan(model, stats_by_length[n], search_windows[n], num_anchors, rule or "faithful",
                                        max_evals=max_evals, progress=progress, log=log, **kw)
        if len(lengths) == 1:
            return plans[lengths[0]]
        return length_plan(fp, stats_by_length, num_anchors, rule or "faithful",
                           anchors_by_length={n: p.anchors for n, p in plans.items()}, **kw)
    return plan_for_rule(fp, stats_by_length[lengths[-1]], dp_anchors(stats_by_length[lengths[-1]], num_anchors),
                         method if rule is None else rule, **kw)


@dataclass(frozen=True)
class Settings:
    """What `kascade calibrate` runs with (the command's flags; ``rolling`` is ``not --no-rolling``)."""

    out: str | Path = "kascade-calibration"
    model: str | Path | None = None  # None: the embedded default model
    device: str = "cpu"  # cpu runs fp32, anything else bf16
    data: str | Path | None = None  # None: the development split of pydoc_data.topics
    text_field: str = "text"
    seq_len: int = 4096
    samples: int = 4  # windows of the statistics
    anchors: int = 6
    target_agreement: float | None = None  # instead of ``anchors``: the fewest reaching it on ``holdout`` windows
    holdout: int = 2
    max_anchors: int = 12
    k: int = DEFAULT_K
    ratio: float = 0.10
    k_min: int = 128
    tile: int = 32
    rolling: bool = True
    seed: int = 0
    method: str = "faithful"
    rule: str | None = None  # the reuse rule of the ``length`` / ``search`` sub-plans (None: faithful)
    lengths: tuple[int, ...] | None = None  # calibration lengths of ``length`` / ``search`` / ``measured``
    search_windows: int = 2  # development windows per length that ``search`` / ``measured`` score plans on
    search_evals: int = 24

    def __post_init__(self):
        need = min_window_tokens(self.k, self.tile)
        if self.seq_len < need:
            raise ValueError(f"--seq-len {self.seq_len} is too short: at least {need} tokens (one tile after k keys)")
        for name in (self.method, self.rule or "faithful"):
            if not is_method(name):
                raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)} (or reuse rules joined "
                                 "by '+')")
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(self.lengths))

    @property
    def budget(self) -> dict:
        return dict(ratio=self.ratio, k_min=self.k_min, tile=self.tile, rolling=self.rolling)

    @property
    def holdout_windows(self) -> int:
        """Held-out windows after the statistics' (only ``target_agreement`` uses them)."""
        return self.holdout if self.target_agreement is not None else 0


def run(settings: Settings) -> dict:
    """Calibrate, write the files into ``settings.out``; ``{plan, stats, table, out, pictures, measured}``."""
    s = settings
    model, tok = load_model(s.model, device=s.device, dtype=torch.float32 if s.device == "cpu" else torch.bfloat16)
    fp = ModelFingerprint.from_model(model)
    if s.anchors is not None and not 1 <= s.anchors <= fp.num_layers:
        raise ValueError(f"--anchors must be in 1..{fp.num_layers} (the model's layer count), got {s.anchors}")
    wins = dev_windows(tok, data=s.data, field=s.text_field, seq_len=s.seq_len, count=s.samples + s.holdout_windows,
                       seed=s.seed)
    stats = collect_stats(model, wins[: s.samples], k=s.k, tile=s.tile)
    max_a = min(s.max_anchors, fp.num_layers)
    table = objective_table(stats, max_a)
    measured = {}
    if s.target_agreement is not None:
        num_anchors = _fewest_anchors(model, fp, stats, wins[s.samples :], s, max_a, measured)
    else:
        num_anchors = s.anchors
    plan = plan_from_stats(fp, stats, num_anchors, **s.budget)
    if s.method != "faithful":
        plan = _method_plan(s, model, tok, stats, num_anchors)
    r = dict(plan=plan, stats=stats, table=table, out=Path(s.out), measured=measured)
    r["pictures"] = write(r)
    return r


def _fewest_anchors(model, fp, stats, holdout, s: Settings, max_a: int, measured: dict) -> int:
    """The fewest anchors (from 2) whose DP plan reaches ``s.target_agreement`` on the held-out windows; each
    measured plan's fidelity goes into ``measured``."""
    ref = DenseReference(model, holdout)
    for A in range(2, max_a + 1):
        plan = plan_from_stats(fp, stats, A, **s.budget)
        fid = measured[A] = pool(ref.compare(plan))
        print(f"  A={A:2d} anchors {list(plan.anchors)}: held-out {fid}", flush=True)
        if fid.top1_agreement >= s.target_agreement:
            return A
    raise ValueError(f"no plan with up to {max_a} anchors reached agreement {s.target_agreement} on the "
                     f"held-out windows (best: {max(f.top1_agreement for f in measured.values()):.4f})")


def _method_plan(s: Settings, model, tok, stats, num_anchors: int) -> KascadePlan:
    """A method other than ``faithful`` on top of the same statistics; ``s.lengths`` adds statistics at other
    lengths (length-aware plans, one search per length)."""
    lengths = sorted(set(s.lengths or [s.seq_len]))
    by_len = {s.seq_len: stats} if s.seq_len in lengths else {}
    for n in lengths:
        if n not in by_len:
            by_len[n] = collect_stats(model, dev_windows(tok, data=s.data, field=s.text_field, seq_len=n,
                                                         count=s.samples, seed=s.seed), k=s.k, tile=s.tile)
    search = None
    if s.method in ("search", "measured"):
        # scored on other development windows than the statistics' (another seed; with --data, the texts after
        # those of the statistics and the holdout)
        used = s.samples + s.holdout_windows
        search = {n: dev_windows(tok, data=s.data, field=s.text_field, seq_len=n, count=s.search_windows,
                                 seed=s.seed + 11, skip=used,
                                 need="--samples, --holdout and --search-windows") for n in lengths}
    return plan_from_method(s.method, model, by_len, num_anchors, rule=s.rule, search_windows=search,
                            max_evals=s.search_evals, budget=s.budget, log=print)


def write(r: dict) -> list[Path]:
    """plan.json, stats.json, objective.csv (with the held-out fidelity of measured anchor counts) and the two
    pictures (when matplotlib is there) into ``r["out"]``; returns the pictures written."""
    out, plan, stats = r["out"], r["plan"], r["stats"]
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    (out / "stats.json").write_text(json.dumps(stats.to_dict()) + "\n")
    with open(out / "objective.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["anchors", "objective", "fraction_of_all_anchor", "layers", "heldout_agreement", "heldout_kl"])
        for row in r["table"]:
            m = r["measured"].get(row["anchors"])
            w.writerow([row["anchors"], f"{row['objective']:.5f}", f"{row['fraction']:.5f}",
                        " ".join(map(str, row["layers"])), f"{m.top1_agreement:.4f}" if m else "",
                        f"{m.kl:.4f}" if m else ""])
    try:
        from .plots import importance_curve, similarity_heatmap

        return [similarity_heatmap(stats, plan.anchors, out / "similarity.png"),
                importance_curve(stats, plan.anchors, out / "importance.png")]
    except ImportError as e:
        print(f"note: no plots written ({e})")
        return []


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
