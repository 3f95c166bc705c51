"""Logging, output folders and resumable row logs of the benchmark scripts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

T0 = time.perf_counter()


def log(*parts, every_rank: bool = False) -> None:
    """One progress line, with the seconds since the script started. Under ``torchrun`` only rank 0 prints, unless
    ``every_rank`` (then each line names its rank)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank:
        prefix = f"[{time.perf_counter() - T0:7.1f} s]" + (f" rank {rank}:" if every_rank else "")
        print(prefix, *parts, flush=True)


def out_folder(path: str | os.PathLike | None, name: str) -> Path:
    """The folder a script writes into, made if missing: ``path``, or ``out/<name>`` under the working directory
    (``out/`` is ignored by git: curated figures go to ``src/kascade/results/`` by hand)."""
    folder = Path(path) if path else Path("out") / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class RowLog:
    """A script's rows in ``path`` (JSON lines), resumable: the rows written before with the same ``key`` fields
    (``rows``), and each new row appended with them and flushed at once (``add``), so an interrupted run keeps its
    rows and a rerun skips them (``has``)."""

    def __init__(self, path: str | os.PathLike, **key):
        self.path, self.key = Path(path), key
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        self.rows = [r for r in map(json.loads, lines) if all(r.get(k) == v for k, v in key.items())]

    def has(self, **fields) -> bool:
        return any(all(r.get(k) == v for k, v in fields.items()) for r in self.rows)

    def add(self, **fields) -> dict:
        row = {**self.key, **fields}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row
