"""The files of a `kascade eval` output folder: the rows as they finish (``rows.jsonl``, with ``run.json``, the
settings that made them: a folder is resumed only with the same settings), and what a person reads, rewritten from
all rows (results.json, results.csv, summary.md, scores.png). Every file is replaced whole or appended and flushed,
so an interrupted run leaves what it finished."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from collections import defaultdict
from pathlib import Path

from ..plots import pyplot

FIDELITY = "fidelity"
DENSE = "dense"
ROWS, RUN = "rows.jsonl", "run.json"
# the settings that define a folder's rows (Settings.defining), as the command names them; files count by content
FLAGS = dict(model="--model", dtype="--device (dtype)", seed="--seed", samples="--samples", plan="--plan",
             ratio="--ratio", k_min="--k-min", omnikv_layer="--omnikv-layer", longbench="--longbench", data="--data",
             text_field="--text-field", skip_texts="--skip-texts")
FILES = ("plan", "longbench", "data")


def row_key(row: dict) -> tuple:
    """What identifies a row within one output folder: ``(strategy, task, length, sample)``."""
    return row["strategy"], row["task"], row["length"], row["sample"]


def _digest(path) -> str | None:
    """A short content digest of a file (None for no file): a run's files are compared by content."""
    if path is None:
        return None
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()[:16]


class Results:
    """The rows of one output folder: ``rows.jsonl`` (one finished row per line, appended as rows finish),
    ``run.json`` (the settings that define the rows) and the summary files (:func:`write`), rewritten from all rows.

    Opening a folder that holds rows made with other settings is refused (ValueError naming them): rows of two
    settings never mix in one folder."""

    def __init__(self, out: str | Path, settings: dict, header: str = ""):
        self.out, self.header = Path(out), header
        settings = json.loads(json.dumps(settings))  # as it reads back
        run_file, rows_file = self.out / RUN, self.out / ROWS
        self.rows: list[dict] = []
        if run_file.is_file():
            try:
                before = json.loads(run_file.read_text())
            except json.JSONDecodeError:
                before = None
            if not isinstance(before, dict):
                raise ValueError(f"--out {self.out}: {RUN} is not a settings record; remove it or use another --out")
            diff = [k for k in sorted(set(before) | set(settings)) if before.get(k) != settings.get(k)]
            if diff:
                said = "; ".join(_difference(k, before.get(k), settings.get(k)) for k in diff)
                raise ValueError(f"--out {self.out} holds results of other settings ({said}): run with the same "
                                 "settings to resume them, or give another --out")
            self.rows = _read_rows(rows_file)
        elif rows_file.exists():
            raise ValueError(f"--out {self.out} holds {ROWS} without {RUN} (the settings that made the rows): remove "
                             "them or use another --out")
        self.settings = settings
        self.done = {row_key(r) for r in self.rows}

    def add(self, rows: list[dict]) -> None:
        """Append finished rows (flushed to disk before returning); the first ones write ``run.json`` too (a run
        refused before its first row leaves the folder as it was)."""
        if not (self.out / RUN).is_file():
            _write_text(self.out / RUN, json.dumps(self.settings, indent=1) + "\n")
        with open(self.out / ROWS, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows += json.loads(json.dumps(rows))  # as they read back (per-layer keys become strings)
        self.done |= {row_key(r) for r in rows}

    def write(self, chart: bool = True) -> dict:
        return write(self.rows, self.out, self.header, chart=chart)


def _difference(key: str, before, now) -> str:
    flag = FLAGS.get(key, key)
    if key in FILES:
        if before is None or now is None:
            return f"{flag} {'none' if before is None else 'given'} there, {'none' if now is None else 'given'} now"
        return f"{flag}: another file (or the file changed)"
    return f"{flag} {before!r} there, {now!r} now"


def _read_rows(path: Path) -> list[dict]:
    """The rows of ``rows.jsonl``; a last line cut short (the run was stopped while writing it) is dropped and the
    file rewritten without it."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise ValueError(f"{path}:{n}: not a result row (invalid JSON); remove the folder or use another "
                                 "--out") from None
            _write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _write_text(path: Path, content: str) -> None:
    """Write a file whole or not at all (an interrupted write leaves the previous version)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(content)
    os.replace(tmp, path)


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95% intervals


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``passed / n`` (95% by default): unlike the normal approximation
    it stays inside [0, 1] and is not empty at 0 / n or n / n."""
    if n < 1 or not 0 <= passed <= n:
        raise ValueError(f"a proportion needs 0 <= passed <= n and n >= 1, got {passed} / {n}")
    p, z2 = passed / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # exactly 0 at 0 / n and 1 at n / n (where rounding would leave 1e-17 or 0.9999999999999999)
    return (0.0 if passed == 0 else centre - half), (1.0 if passed == n else centre + half)


def normal_interval(scores: list[float], z: float = Z95) -> tuple[float, float] | None:
    """The normal-approximation interval of a mean, ``mean +- z s / sqrt(n)`` (``s`` the sample standard deviation),
    clipped to [0, 1] (every score lies there); None for a single score (no spread to estimate)."""
    n = len(scores)
    if n < 2:
        return None
    mean = sum(scores) / n
    s = math.sqrt(sum((x - mean) ** 2 for x in scores) / (n - 1))
    return max(0.0, mean - z * s / math.sqrt(n)), min(1.0, mean + z * s / math.sqrt(n))


def interval(scores: list[float]) -> dict:
    """The 95% confidence interval of a mean score: ``{ci_low, ci_high, ci_method}``. Scores that are all 0 or 1 (a
    pass rate) get the Wilson interval (``"wilson"``); fractional ones (string match over several answers, the
    fidelity task's agreement, LongBench's metrics) the normal approximation (``"normal"``; None bounds for one
    sample)."""
    if all(x in (0, 1) for x in scores):
        lo, hi = wilson(int(sum(scores)), len(scores))
        return dict(ci_low=lo, ci_high=hi, ci_method="wilson")
    b = normal_interval(scores)
    return dict(ci_low=b and b[0], ci_high=b and b[1], ci_method="normal")


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (strategy, task, length): the mean score and its 95% interval (:func:`interval`), the attended
    fraction, and for every strategy but dense dense's own score and interval on the same task and length
    (``dense_score``, ``dense_ci_low``, ``dense_ci_high``; None where dense did not run)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["strategy"], r["task"], r["length"])].append(r)
    out = []
    for (s, t, L), rs in groups.items():
        scores = [r["score"] for r in rs]
        row = dict(strategy=s, task=t, length=L, samples=len(rs), score=sum(scores) / len(rs), **interval(scores),
                   attended_fraction=sum(r["attended_fraction"] for r in rs) / len(rs))
        if t == FIDELITY:
            row.update(kl=sum(r["kl"] for r in rs) / len(rs), nll=sum(r["nll"] for r in rs) / len(rs))
        out.append(row)
    by = {(r["strategy"], r["task"], r["length"]): r for r in out}
    for row in out:
        if row["strategy"] != DENSE:
            d = by.get((DENSE, row["task"], row["length"]), {})
            row.update(dense_score=d.get("score"), dense_ci_low=d.get("ci_low"), dense_ci_high=d.get("ci_high"))
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


def _with_interval(r: dict) -> str:
    if r["ci_low"] is None:
        return f"{r['score']:.3f} [n={r['samples']}]"
    return f"{r['score']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def interval_table(summary: list[dict]) -> str:
    """Per task and length (rows), every strategy's mean score with its 95% interval (columns, dense first): each
    strategy beside dense on the same samples."""
    strategies = sorted(dict.fromkeys(r["strategy"] for r in summary), key=lambda s: s != DENSE)
    cols = list(dict.fromkeys((r["task"], r["length"]) for r in summary))
    by = {(r["strategy"], r["task"], r["length"]): r for r in summary}
    lines = ["| task | length | samples | " + " | ".join(strategies) + " |", "|---" * (len(strategies) + 3) + "|"]
    for t, L in cols:
        present = [by[(s, t, L)] for s in strategies if (s, t, L) in by]
        n = sorted({r["samples"] for r in present})
        cells = [_with_interval(by[(s, t, L)]) if (s, t, L) in by else "" for s in strategies]
        lines.append(f"| {t} | {L} | {', '.join(map(str, n))} | " + " | ".join(cells) + " |")
    methods = sorted({r["ci_method"] for r in summary})
    said = dict(wilson="Wilson score interval (pass / fail scores)",
                normal="normal approximation, mean +- 1.96 s / sqrt(n) clipped to [0, 1] (fractional scores)")
    return ("\n".join(lines) + "\n\nScores are means with 95% confidence intervals: "
            + "; ".join(said[m] for m in methods) + ".")


def write(rows: list[dict], out: Path, header: str = "", chart: bool = True) -> dict:
    """results.json, results.csv and summary.md (and, with ``chart``, scores.png) of ``rows`` into ``out``; each file
    replaced whole, so an interrupted write leaves the previous version."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summ = summarize(rows)
    _write_text(out / "results.json", json.dumps(dict(header=header, rows=rows, summary=summ), indent=1) + "\n")
    keys = ["strategy", "task", "length", "sample", "score", "attended_fraction", "kl", "nll", "prediction", "answers"]
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "answers": " | ".join(r.get("answers", []))})
    os.replace(tmp, out / "results.csv")
    md = (f"{header}\n\n" if header else "") + table(summ) + "\n\n" + interval_table(summ) + "\n"
    _write_text(out / "summary.md", md)
    files = [out / "results.json", out / "results.csv", out / "summary.md"]
    if chart:
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
