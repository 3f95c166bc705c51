"""What every results table is made of: the results files, and the cells' formats (lengths in K tokens, ratios,
significant digits, Markdown tables)."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

MODEL_NAMES = {"llama-3.1-8b": "Llama-3.1-8B", "smollm2-135m": "SmolLM2-135M", "llama8b": "Llama-3.1-8B shapes",
               "default": "SmolLM2-135M"}
SCORINGS = {"exact": "exact (default)", "fp8": "FP8", "int8": "INT8", "bf16": "bf16 rounding (reference point)"}


@cache
def results(name: str) -> dict:
    """One results file: ``h100``, ``h200`` or ``accuracy``."""
    return json.loads((resources.files("kascade") / "results" / f"{name}.json").read_text())



def _n(x: int) -> str:
    """A length in K tokens."""
    return f"{x // 1024}K"



def _x(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"



def _sig(x: float, digits: int = 3) -> str:
    """``digits`` significant digits, no exponent."""
    return "0" if x == 0 else f"{x:.{max(0, digits - 1 - int(f'{abs(x):e}'.split('e')[1]))}f}"



def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)])



def _row(rows, **key) -> dict:
    (r,) = [r for r in rows if all(r[k] == v for k, v in key.items())]
    return r
