"""`kascade calibrate`: development windows, the statistics pass, one plan by the chosen method, files to read.

    r = run(Settings(seq_len=4096, samples=4, anchors=6, method="faithful", out="cal"))
    print(report(r))

Methods (``Settings.method``): a reuse rule of :mod:`kascade.calibrate.rules` (``faithful``: the paper's method, the
DP's anchors and the argmax head map; ``any-anchor``, ``union2``, ``sinks``, ``layer-budget``, or several joined by
``+``), ``length`` (one sub-plan per calibration length), ``search`` (anchors by measured KL,
:mod:`kascade.calibrate.search`) and ``measured`` (the shipped default's method: that search with the faithful rule
on the development windows of every length together, then per-layer budgets from each layer's measured sensitivity
on the same windows, :mod:`kascade.calibrate.budgets`).

With ``Settings.data`` the windows are cut one after another from the file's texts, from its start, as ``kascade
eval --data`` cuts them (a long text gives several windows, none spans two texts): ``samples`` for the statistics,
then ``holdout`` held-out ones (with ``target_agreement``), then, from the texts after all of theirs,
``search_windows`` for the search (``search`` / ``measured``); the report says how many texts they reach into, and
``kascade eval --data FILE --skip-texts N`` evaluates on the texts after them. ``Settings.tensor_parallel`` makes the plan shard-local for that many
tensor-parallel ranks (:meth:`kascade.KascadePlan.for_tensor_parallel`, by the statistics' similarity).
"""

from __future__ import annotations

import csv
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import text
from ..fidelity import DenseReference
from ..files import output_folder
from ..models import beyond_context, load_model
from ..plots import pyplot
from ..plan import KascadePlan, ModelFingerprint
from ..text import load_texts
from . import target
from .budgets import MEASURED_GRID, layer_sensitivity, measured_budget_plan
from .joint import joint_plan
from .dp import dp_anchors, objective_table, plan_from_stats
from .rules import RULES, fingerprint, length_plan, plan_for_rule, rule_problem
from .search import searched_plan
from .stats import DEFAULT_K, CalibrationStats, collect_stats, min_window_tokens

METHODS = (*RULES, "length", "search", "measured")


def method_problem(name) -> str | None:
    """Why ``name`` is not a calibration method (one of :data:`METHODS`, or reuse rules joined by ``+``), or None."""
    if name in METHODS:
        return None
    if isinstance(name, str) and all(x in RULES for x in name.split("+")):
        return rule_problem(name)  # rules that cannot go together
    return f"unknown method {name!r}; choose from {', '.join(METHODS)} (or reuse rules joined by '+')"


def dev_windows(tok, *, data=None, field="text", seq_len: int, count: int, seed: int = 0, skip: int = 0,
                need: str = "--samples plus --holdout", texts: list[str] | None = None,
                avoid: list | None = None) -> list[torch.Tensor]:
    """``count`` token windows of ``seq_len`` tokens: from the user's texts (:func:`data_windows`, after the first
    ``skip`` texts; ``texts``, when given, are the file's, already loaded) or from the development split of
    pydoc_data.topics (``seed`` picks; ``avoid``: windows these must not share tokens with,
    :func:`kascade.text.windows`)."""
    if data is None:
        return text.windows(tok, "dev", seq_len, count, seed=seed, avoid=avoid)
    texts = load_texts(data, field) if texts is None else texts
    return data_windows(tok, texts, seq_len, count, skip=skip, need=need, source=data)[0]


def data_windows(tok, texts: list[str], seq_len: int, count: int, *, skip: int = 0, need: str = "--samples",
                 source="--data") -> tuple[list[torch.Tensor], int]:
    """``count`` windows of ``seq_len`` tokens cut one after another from ``texts[skip:]``, as ``kascade eval --data``
    cuts them (:func:`kascade.text.iter_windows`: a long text gives several, none spans two texts), and how many
    texts from the file's start they reach into (``skip`` included): ``kascade eval --skip-texts`` that many
    evaluates on other texts. ValueError (``need`` names the settings that asked for them) when the texts hold too
    few."""
    got = list(itertools.islice(text.iter_windows(tok, texts[skip:], seq_len), count))
    if len(got) < count:
        after = f" after the first {skip}" if skip else ""
        raise ValueError(f"{source}: the texts{after} hold {len(got)} window(s) of {seq_len} tokens (a window lies "
                         f"within one text); {need} need {count}: give more text, fewer windows or a shorter --seq-len "
                         "/ --lengths")
    return [w for _, w in got], skip + got[-1][0] + 1


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


def _int(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class Settings:
    """What `kascade calibrate` runs with (the command's flags; ``rolling`` is ``not --no-rolling``). Every value that
    does not depend on the model is checked here; :meth:`check_model` checks the rest against the model's shape."""

    out: str | Path = "kascade-calibration"
    model: str | Path | None = None  # None: the embedded default model
    device: str = "cpu"  # cpu runs fp32, anything else bf16
    data: str | Path | None = None  # None: the development split of pydoc_data.topics
    text_field: str = "text"
    seq_len: int = 4096
    samples: int = 4  # windows of the statistics
    anchors: int = 6  # not used with a target
    target_agreement: float | None = None  # instead of ``anchors``: the fastest reaching it on ``holdout`` windows
    target_speedup: float | None = None  # instead of ``anchors``: the most accurate modelled at least this fast
    speedup_mode: str = "decode"  # what target_speedup bounds: decode, prefill or both (:mod:`.target`)
    cost_shape: str | None = None  # whose kernel times model the speedup (None: the model's own, else Llama's)
    cost_table: str | Path | None = None  # a `kascade costs` file measured on this GPU (None: the shipped H200 times)
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
    lengths: tuple[int, ...] | None = None  # calibration lengths of a method other than ``faithful``
    search_windows: int = 2  # development windows per length that ``search`` / ``measured`` score plans on
    search_evals: int = 24
    joint_span: int = 2  # method measured with target_speedup: also try up to this many fewer anchors (.joint)
    tensor_parallel: int | None = None  # make the plan shard-local for this many tensor-parallel ranks

    def __post_init__(self):
        for name, value in (("--k", self.k), ("--tile", self.tile), ("--samples", self.samples),
                            ("--max-anchors", self.max_anchors), ("--k-min", self.k_min),
                            ("--search-windows", self.search_windows), ("--search-evals", self.search_evals)):
            _int(name, value)
        _int("--seed", self.seed, 0)
        _int("--joint-span", self.joint_span, 0)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"--ratio must be a fraction of the keys in (0, 1], got {self.ratio!r}")
        target.check_settings(self)
        if self.target_agreement is None and self.target_speedup is None:
            _int("--anchors", self.anchors)
        elif self.target_agreement is not None:
            t = self.target_agreement
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
                raise ValueError(f"--target-agreement must be a top-1 agreement in (0, 1], got {t!r}")
            _int("--holdout", self.holdout)
            if self.max_anchors < 2:
                raise ValueError(f"--target-agreement tries 2 anchors and more: --max-anchors must be >= 2, got "
                                 f"{self.max_anchors}")
        if self.tensor_parallel is not None:
            _int("--tensor-parallel", self.tensor_parallel)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"--text-field must name a field, got {self.text_field!r}")
        need = min_window_tokens(self.k, self.tile)
        if self.seq_len < need:
            raise ValueError(f"--seq-len {self.seq_len} is too short: at least {need} tokens (one tile after k keys)")
        why = method_problem(self.method)
        if why:
            raise ValueError(f"--method: {why}")
        if self.rule is not None and rule_problem(self.rule):
            raise ValueError(f"--rule: {rule_problem(self.rule)}")
        if self.rule is not None and self.method not in ("length", "search"):
            raise ValueError(f"--rule is the reuse rule of --method length or search, not of {self.method!r}")
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(self.lengths))
            if self.method == "faithful":
                raise ValueError("--lengths is for the methods other than faithful (whose plan is made at --seq-len)")
            if not self.lengths:
                raise ValueError("--lengths needs at least one length")
            for n in self.lengths:
                _int("--lengths", n)
                if n < need:
                    raise ValueError(f"--lengths {n} is too short: at least {need} tokens (one tile after k keys)")

    @property
    def budget(self) -> dict:
        return dict(ratio=self.ratio, k_min=self.k_min, tile=self.tile, rolling=self.rolling)

    @property
    def holdout_windows(self) -> int:
        """Held-out windows after the statistics' (only ``target_agreement`` uses them)."""
        return self.holdout if self.target_agreement is not None else 0

    @property
    def search_texts(self) -> int:
        """Windows per length that the anchor search scores plans on (``search`` / ``measured`` only)."""
        return self.search_windows if self.method in ("search", "measured") else 0

    @property
    def lengths_to_run(self) -> list[int]:
        """The calibration lengths of a method other than ``faithful`` (``lengths``, else ``seq_len``)."""
        return sorted(set(self.lengths or [self.seq_len]))

    def check_model(self, fp: ModelFingerprint) -> None:
        """ValueError for a setting the model of shape ``fp`` cannot run."""
        target.check_model(self, fp)
        if self.target_agreement is None and self.target_speedup is None and not 1 <= self.anchors <= fp.num_layers:
            raise ValueError(f"--anchors must be in 1..{fp.num_layers} (the model's layer count), got {self.anchors}")
        if self.target_agreement is not None and fp.num_layers < 2:
            raise ValueError("--target-agreement compares plans of 2 anchors and more; the model has 1 layer")
        tp, H = self.tensor_parallel, fp.num_kv_heads
        if tp is not None and H % tp:
            sizes = [d for d in range(1, H + 1) if H % d == 0]
            raise ValueError(f"--tensor-parallel {tp} does not divide the model's {H} KV heads (the heads are split "
                             f"evenly over the ranks); use one of {', '.join(map(str, sizes))}")


@dataclass
class _Windows:
    """The token windows a calibration reads, made (and checked) before the model's weights are loaded."""

    stats: list  # the statistics' windows, then the held-out ones
    by_length: dict  # other calibration lengths: {n: windows} for the statistics at n
    search: dict | None  # {n: windows} the search scores plans on
    texts_used: int | None = None  # with --data: the texts the windows reach into, from the file's start


def _windows(s: Settings, tok, texts: list[str] | None) -> _Windows:
    first = s.samples + s.holdout_windows  # the statistics' windows, then the holdout's
    others = [n for n in s.lengths_to_run if n != s.seq_len] if s.method != "faithful" else []
    if texts is None:  # pydoc_data.topics' development split
        wins = dev_windows(tok, seq_len=s.seq_len, count=first, seed=s.seed)
        by_len = {n: dev_windows(tok, seq_len=n, count=s.samples, seed=s.seed) for n in others}
        search = None
        if s.search_texts:
            # scored on other development windows than the statistics' and the holdout's (another seed, away from
            # theirs)
            taken = [*wins, *(w for ws in by_len.values() for w in ws)]
            search = {n: dev_windows(tok, seq_len=n, count=s.search_windows, seed=s.seed + 11, avoid=taken)
                      for n in s.lengths_to_run}
        return _Windows(wins, by_len, search)
    # the user's texts, from the file's start: the statistics (and holdout) at every length, then the search's
    # windows from the texts after all of theirs
    need = "--samples plus --holdout" if s.holdout_windows else "--samples"
    wins, used = data_windows(tok, texts, s.seq_len, first, need=need, source=s.data)
    by_len = {}
    for n in others:
        by_len[n], u = data_windows(tok, texts, n, s.samples, source=s.data)
        used = max(used, u)
    search = None
    if s.search_texts:
        search, stats_used = {}, used
        for n in s.lengths_to_run:
            search[n], u = data_windows(tok, texts, n, s.search_windows, skip=stats_used, source=s.data,
                                        need="--search-windows (after the statistics' texts)")
            used = max(used, u)
    return _Windows(wins, by_len, search, texts_used=used)


def run(settings: Settings) -> dict:
    """Calibrate, write the files into ``settings.out``; ``{plan, stats, table, out, pictures, measured, settings}``.

    Everything that can be checked before the statistics is: the output folder and the data file first, then the
    model's shape and the token windows (from its config and tokenizer, before its weights are read). The output
    folder is held for the run (a second run into it meanwhile is refused), and removed if this run made it and then
    failed before writing into it (:func:`kascade.files.output_folder`)."""
    with output_folder(settings.out, "kascade calibrate") as out:
        return _run(settings, out)


def _run(s: Settings, out: Path) -> dict:
    texts = None if s.data is None else load_texts(s.data, s.text_field)
    ready: list[_Windows] = []

    def prepare(config, tok):
        s.check_model(ModelFingerprint.from_config(config))
        note = beyond_context(config, [s.seq_len, *s.lengths_to_run], "kascade calibrate")
        if note:
            print(note)
        ready.append(_windows(s, tok, texts))

    model, tok = load_model(s.model, device=s.device, dtype=torch.float32 if s.device == "cpu" else torch.bfloat16,
                            check=prepare)
    if not ready:  # a loader that does not call ``check``
        prepare(model.config, tok)
    wins = ready[0]
    fp = ModelFingerprint.from_model(model)
    stats = collect_stats(model, wins.stats[: s.samples], k=s.k, tile=s.tile)
    max_a, measured = min(s.max_anchors, fp.num_layers), {}
    if s.target_agreement is not None:
        num_anchors = target.fastest_reaching(model, fp, stats, wins.stats[s.samples :], s, max_a, measured)
    else:
        num_anchors = s.anchors if s.target_speedup is None else target.most_anchors_within(s, fp)

    def make(a):
        return plan_from_stats(fp, stats, a, **s.budget) if s.method == "faithful" else \
            _method_plan(s, model, stats, a, wins)

    joint = None
    if s.target_speedup is None:
        plan = make(num_anchors)
    elif s.method == "measured":  # anchors and per-layer budgets together (.joint)
        by_len = _stats_by_length(s, model, stats, wins)
        windows = [w for n in sorted(by_len) for w in wins.search[n]]
        plan, joint = joint_plan(model, by_len[max(by_len)], windows, s, num_anchors, span=s.joint_span)
    else:
        plan = target.within_target(make, num_anchors, s)
    table = objective_table(stats, max(max_a, len(plan.anchors)))
    moved = None
    if s.tensor_parallel is not None:
        moved = len(plan.crossing_links(s.tensor_parallel))
        plan = plan.for_tensor_parallel(s.tensor_parallel, stats.similarity)
    r = dict(plan=plan, stats=stats, table=table, out=out, measured=measured, settings=s, moved_links=moved,
             joint=joint, texts_used=wins.texts_used, texts=None if texts is None else len(texts))
    r["pictures"] = write(r)
    return r


def _stats_by_length(s: Settings, model, stats, wins: _Windows) -> dict:
    """The statistics at every calibration length: ``stats`` (at ``s.seq_len``) and those of ``s.lengths``."""
    by_len = {s.seq_len: stats} if s.seq_len in s.lengths_to_run else {}
    for n, w in wins.by_length.items():
        by_len[n] = collect_stats(model, w, k=s.k, tile=s.tile)
    return by_len


def _method_plan(s: Settings, model, stats, num_anchors: int, wins: _Windows) -> KascadePlan:
    """A method other than ``faithful`` on top of the same statistics; ``s.lengths`` adds statistics at other
    lengths (length-aware plans, one search per length)."""
    by_len = _stats_by_length(s, model, stats, wins)
    return plan_from_method(s.method, model, by_len, num_anchors, rule=s.rule, search_windows=wins.search,
                            max_evals=s.search_evals, budget=s.budget, log=print)


PICTURES = ("similarity.png", "importance.png")


def write(r: dict) -> list[Path]:
    """plan.json, stats.json, objective.csv (with the held-out fidelity of measured anchor counts) and the two
    pictures (when matplotlib is there) into ``r["out"]``; returns the pictures written. All are written under
    temporary names first and then put in place, plan.json last: an interrupted run leaves the folder's earlier
    files, or this run's plan with the rest of its files (never an earlier run's pictures beside it)."""
    out, plan, stats = r["out"], r["plan"], r["stats"]
    out.mkdir(parents=True, exist_ok=True)
    done: list[tuple[Path, Path]] = []  # (written, final)
    pictures = PICTURES
    try:
        pyplot()
    except ImportError as e:
        print(f"note: no plots written ({e})")
        pictures = ()

    def temp(name: str) -> Path:
        final = out / name
        done.append((final.with_name(f"{final.stem}.tmp{final.suffix}"), final))
        return done[-1][0]

    try:
        temp("stats.json").write_text(json.dumps(stats.to_dict()) + "\n")
        with open(temp("objective.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["anchors", "objective", "fraction_of_all_anchor", "layers", "heldout_agreement", "heldout_kl"])
            for row in r["table"]:
                m = r["measured"].get(row["anchors"])
                w.writerow([row["anchors"], f"{row['objective']:.5f}", f"{row['fraction']:.5f}",
                            " ".join(map(str, row["layers"])), f"{m.top1_agreement:.4f}" if m else "",
                            f"{m.kl:.4f}" if m else ""])
        if pictures:
            from .plots import importance_curve, similarity_heatmap

            similarity_heatmap(stats, plan.anchors, temp("similarity.png"))
            importance_curve(stats, plan.anchors, temp("importance.png"))
        else:
            for name in PICTURES:  # an earlier run's, which would not match this plan
                (out / name).unlink(missing_ok=True)
        plan.save(temp("plan.json"))
        for written, final in done:
            os.replace(written, final)
    finally:
        for written, _ in done:
            written.unlink(missing_ok=True)
    return [out / name for name in pictures]


def report(r: dict) -> str:
    plan = r["plan"]
    lines = [f"{'A':>3} {'objective':>10} {'of all-anchor':>14}  anchors"]
    for row in r["table"]:
        mark = ""
        if row["anchors"] == len(plan.anchors):  # the DP's layers; a search may have moved them
            mark = " <- chosen" if list(row["layers"]) == list(plan.anchors) else " <- chosen count (the plan's below)"
        lines.append(f"{row['anchors']:3d} {row['objective']:10.4f} {row['fraction']:14.4f}  {row['layers']}{mark}")
    reuse = [b for b in range(plan.num_layers) if not plan.is_anchor(b)]
    remapped = sum(plan.head_map[b] != tuple(range(plan.fingerprint.num_kv_heads)) for b in reuse)
    lines += ["", f"plan: anchors {list(plan.anchors)}; {remapped} of {len(reuse)} reuse layers follow other heads"]
    if r.get("moved_links") is not None:
        lines.append(f"      shard-local for {plan.tensor_parallel} tensor-parallel ranks: {r['moved_links']} links "
                     "that crossed ranks follow the most similar anchor head of their own rank")
    s, n = r.get("settings"), r.get("texts_used")
    if s is not None and n is not None:
        lines.append(f"used texts 1..{n} of {s.data} ({s.samples} statistics, {s.holdout_windows} held-out and "
                     f"{s.search_texts} search window(s) per length)")
        if n < r["texts"]:
            lines.append(f"to evaluate on the texts after them: kascade eval --data {s.data} --skip-texts {n}")
        else:
            lines.append(f"every text of {s.data} went into the calibration: evaluate the plan on other texts "
                         "(kascade eval --data OTHER_FILE), never on windows it was calibrated on")
    for row in r.get("joint") or ():
        x = ", ".join(f"{m} {v:.2f}x" for m, v in row["speedups"].items())
        mark = " <- chosen" if row["anchors"] == list(plan.anchors) else ""
        lines.append(f"joint search: {len(row['anchors'])} anchors {row['anchors']}, mean budget "
                     f"x{row['mean_factor']:.2f}: dev KL {row['kl']:.4f} ({x}){mark}")
    if s is not None:
        lines.append(target.report_line(plan, s))
    lines.append(f"wrote {r['out'] / 'plan.json'}, stats.json, objective.csv"
                 + "".join(f", {p.name}" for p in r["pictures"]))
    return "\n".join(lines)
