"""Logging and output folders of the benchmark scripts."""

from __future__ import annotations

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
