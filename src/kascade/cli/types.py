"""The value types of the commands' options: each turns a string into a value or refuses it with a message that
argparse prints on one line, naming the option, before any model is loaded."""

from __future__ import annotations

import argparse


def csv_of(kind, choices):
    def parse(value):
        items = list(choices) if value == "all" else [x.strip() for x in value.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad or value!r}; choose from: all, {', '.join(choices)}")
        return items

    return parse


def integer(low: int = 1, kind: str | None = None):
    """An argparse type: an integer >= ``low``. argparse names the option in the error; ``kind`` adds a word."""
    what = "a positive integer" if low == 1 else f"an integer >= {low}"
    prefix = f"{kind} " if kind else ""

    def parse(value):
        try:
            x = int(value)
        except ValueError:
            x = None
        if x is None or x < low:
            raise argparse.ArgumentTypeError(f"{prefix}must be {what}, got {value!r}")
        return x

    return parse


def positive(kind: str | None = None):
    return integer(1, kind)


def number(low: float = 0.0, high: float | None = None, low_open: bool = True):
    """An argparse type: a finite number in ``(low, high]`` (``[low, high]`` with ``low_open=False``)."""
    span = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"

    def parse(value):
        try:
            x = float(value)
        except ValueError:
            x = float("nan")
        inside = (x > low if low_open else x >= low) and (x <= high if high is not None else x < float("inf"))
        if not inside:  # NaN too
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {value!r}")
        return x

    return parse


def device(value):
    """An argparse type: a device this torch can use (cpu, cuda, cuda:N, or another type torch reports available)."""
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {value!r}; use cpu or cuda (cuda:N for one GPU)") from None
    if dev.type == "cpu":
        return value
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "" if torch.version.cuda else ", a build without CUDA"
            raise argparse.ArgumentTypeError(f"{value!r}: this torch ({torch.__version__}{why}) sees no CUDA device; "
                                             "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{value!r}: there are {torch.cuda.device_count()} CUDA device(s)")
        return value
    backend = getattr(torch, dev.type, None)
    if not getattr(backend, "is_available", lambda: False)():
        raise argparse.ArgumentTypeError(f"{value!r}: this torch cannot use {dev.type} devices; use cpu or cuda")
    return value


def plan_arg(value):
    """An argparse type: the name of a shipped plan (returned as it is: which plan it names depends on the model) or
    the path of a readable Kascade plan JSON (read once here to refuse anything else)."""
    from ..plan import SHIPPED_VARIANTS, KascadePlan

    if value in SHIPPED_VARIANTS:
        return value
    try:
        KascadePlan.load(value)
    except (ValueError, TypeError, OSError) as e:
        raise argparse.ArgumentTypeError(f"{e} (give a plan file or a shipped plan: {', '.join(SHIPPED_VARIANTS)})") \
            from None
    return value


def file(value):
    """An argparse type: the path of an existing file."""
    from pathlib import Path

    p = Path(value).expanduser()
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"no file at {value}" + (" (it is a folder)" if p.is_dir() else ""))
    return value


def method(value):
    """An argparse type: a calibration method (``kascade calibrate --method``)."""
    from ..calibrate.pipeline import method_problem

    why = method_problem(value)
    if why:
        raise argparse.ArgumentTypeError(why)
    return value


def rule(value):
    """An argparse type: a reuse rule, or several joined by '+' (``kascade calibrate --rule``)."""
    from ..calibrate.rules import rule_problem

    why = rule_problem(value)
    if why:
        raise argparse.ArgumentTypeError(why)
    return value


def batch_by_length(value: str) -> tuple[int, int]:
    """An argparse type: ``BxL``, a batch size and a prompt length (positive integers)."""
    try:
        b, n = (int(x) for x in value.lower().split("x"))
    except ValueError:
        b = n = 0
    if b < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"a configuration is BATCHxLENGTH of positive integers (e.g. 1x32768), "
                                         f"got {value!r}")
    return b, n


def model_args(p) -> None:
    """--model and --device: the same meaning in every command."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a .gguf file or a local transformers model folder (config.json, tokenizer and weights); "
                   "nothing is downloaded (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", type=device,
                   help="where the model runs: cpu (float32) or cuda / cuda:N (bfloat16) (default: cpu)")
