"""The files of a `kascade eval` output folder: the rows as they finish (``rows.jsonl``, with ``run.json``, the
settings that made them: a folder is resumed only with the same settings), and what a person reads, rewritten from
all rows (results.json, results.csv, summary.md, scores.png). Every file is replaced whole or appended and flushed,
so an interrupted run leaves what it finished."""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

from ..plots import pyplot

FIDELITY = "fidelity"
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
    md = (f"{header}\n\n" if header else "") + table(summ) + "\n"
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
