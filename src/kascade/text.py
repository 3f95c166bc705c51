"""Real English text that ships with every Python, cut into token windows.

The corpus is ``pydoc_data.topics`` (the Python reference's topic pages, about 113K tokens for SmolLM2's
tokenizer), in sorted topic order. Its token stream is split once into a *development* part (the first 60%, for
calibration) and an *evaluation* part (the last 40%, for fidelity tests and haystacks), so that the windows a plan
is calibrated on never overlap the windows it is judged on. :func:`load_texts` reads a user's texts (``--data``) and :func:`cut_windows` cuts token windows from them.
"""

from __future__ import annotations

import functools
import itertools
import json
import warnings
from pathlib import Path

import torch

SPLITS = ("dev", "eval")
DEV_FRACTION = 0.6


def corpus_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


@functools.lru_cache(maxsize=4)
def _corpus_ids(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(corpus_text(), add_special_tokens=False).input_ids, dtype=torch.long)


def split_ids(tokenizer, split: str) -> torch.Tensor:
    """Token ids of one split of the corpus."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ids = _corpus_ids(tokenizer)
    cut = int(len(ids) * DEV_FRACTION)
    return ids[:cut] if split == "dev" else ids[cut:]


def windows(tokenizer, split: str, length: int, count: int, seed: int = 0,
            avoid: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens from ``split``, deterministic in ``seed``.

    Windows are spread evenly over the split (starting at a seeded offset); they overlap only when the split is
    too short to hold ``count`` disjoint windows, and then a warning says how many of their tokens are distinct.
    ``avoid``: windows of the same split (from this function) that these must not share tokens with (the
    statistics' windows, for windows that score plans): where the seeded windows would, they are spread evenly over
    the rest of the split instead, or, where that is too short, kept with a warning of the tokens shared. Raises ValueError when one window
    does not fit."""
    if length < 1 or count < 1:
        raise ValueError(f"length and count must be >= 1, got {length}, {count}")
    ids = split_ids(tokenizer, split)
    room = len(ids) - length
    if room < 0:
        raise ValueError(f"the {split} split has {len(ids)} tokens, fewer than one window of {length}")
    if count * length <= len(ids):  # disjoint, evenly spaced, shifted by a seeded offset
        gap = (len(ids) - count * length) // count
        shift = int(torch.randint(0, gap + 1, (1,), generator=torch.Generator().manual_seed(seed)))
        starts = [shift + i * (length + gap) for i in range(count)]
    else:  # the split is too short: evenly spread, overlapping windows
        starts = [round(i * room / max(1, count - 1)) for i in range(count)]
    spans = sorted((st, st + len(w)) for w in avoid or [] for st in [_start(ids, w)])
    if any(a < st + length and st < e for st in starts for a, e in spans):
        free = _free_starts(len(ids), length, spans)
        if len(free) >= count:  # disjoint from the windows to avoid and from each other
            starts = [free[round(i * (len(free) - 1) / max(1, count - 1))] for i in range(count)]
    covered = {x for st in starts for x in range(st, st + length)}
    if len(covered) < count * length:
        warnings.warn(f"{count} windows of {length} tokens overlap: the {split} split holds {len(ids)} tokens, "
                      f"{len(covered) / (count * length):.0%} of the windows' tokens are distinct", stacklevel=2)
    shared = sum(1 for a, e in spans for x in range(a, e) if x in covered)
    if shared:
        warnings.warn(f"{count} windows of {length} tokens share {shared} tokens with the {len(spans)} windows they "
                      f"should avoid: the {split} split ({len(ids)} tokens) is too short for both", stacklevel=2)
    return [ids[st : st + length].clone() for st in starts]


def _start(ids: torch.Tensor, window: torch.Tensor) -> int:
    """Where ``window`` (a slice of ``ids`` made by :func:`windows`) starts in ``ids``."""
    for st in (ids[: len(ids) - len(window) + 1] == window[0]).nonzero().flatten().tolist():
        if torch.equal(ids[st : st + len(window)], window):
            return st
    raise ValueError("a window to avoid is not a window of this split")


def _free_starts(n: int, length: int, spans: list[tuple[int, int]]) -> list[int]:
    """Starts of non-overlapping windows of ``length`` in ``[0, n)`` outside ``spans``, packed from each gap's start."""
    out, pos = [], 0
    for a, e in [*sorted(spans), (n, n)]:
        out += range(pos, a - length + 1, length)
        pos = max(pos, e)
    return out


def iter_windows(tokenizer, texts, length: int):
    """``(text index, window)`` for the windows of ``length`` tokens cut one after another from ``texts`` in order:
    each text's tokens from its start, the tail of a text too short for another window left out (no window spans two
    texts). Texts are tokenized as the windows are asked for."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    for i, t in enumerate(texts):
        ids = tokenizer(t, add_special_tokens=False).input_ids
        for s in range(0, len(ids) - length + 1, length):
            yield i, torch.tensor(ids[s : s + length], dtype=torch.long)


def cut_windows(tokenizer, texts, length: int, count: int) -> list[torch.Tensor]:
    """The first ``count`` windows of :func:`iter_windows`; fewer when the texts run out (texts after the last window
    needed are not tokenized)."""
    if length < 1 or count < 1:
        raise ValueError(f"length and count must be >= 1, got {length}, {count}")
    return [w for _, w in itertools.islice(iter_windows(tokenizer, texts, length), count)]


def iter_jsonl(path: str | Path):
    """``(line number, object)`` for each non-blank line of a JSONL file; ValueError naming the line for bad JSON
    or a line that is not a JSON object."""
    path = Path(path)
    try:
        raw = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        yield n, obj


def load_texts(path: str | Path, field: str = "text") -> list[str]:
    """Texts from a JSONL file (``.jsonl`` or ``.json``: one JSON object per line, the text under ``field``) or a
    plain-text file (any other name: one text). ValueError naming the file (and line) for anything unusable."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        raw = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"the data file {path} is not UTF-8 text") from None
    if not raw.strip():
        raise ValueError(f"the data file {path} is empty")
    if path.suffix not in (".jsonl", ".json"):
        return [raw]
    texts = []
    for n, obj in iter_jsonl(path):
        if field not in obj:
            raise ValueError(f"{path}:{n}: no {field!r} field (use --text-field to name another)")
        if not isinstance(obj[field], str):
            raise ValueError(f"{path}:{n}: the {field!r} field is not a string")
        texts.append(obj[field])
    if not texts:
        raise ValueError(f"the data file {path} holds no texts")
    return texts
