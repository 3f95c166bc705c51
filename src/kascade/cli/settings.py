"""A command's settings: its frozen dataclass built from the parsed options, field by field."""

from __future__ import annotations

import argparse
from dataclasses import fields


def build(cls, args: argparse.Namespace, mapped: dict | None = None, unset: tuple[str, ...] = ()):
    """``cls(...)``, every field given: from the option of the same name (its argparse ``dest``), from ``mapped``
    where a flag and the field differ (``{"rolling": not args.no_rolling}``), or left at the dataclass's default
    where ``unset`` names it (a field no option sets).

    A field none of the three reaches is a ``TypeError`` naming it, so a field added to the dataclass later cannot be
    silently left at its default: it needs an option, a mapping or a place in ``unset``. So is a name in ``mapped``
    or ``unset`` that is no field, and a field in ``unset`` that an option of its name would set.
    """
    mapped = mapped or {}
    names = [f.name for f in fields(cls)]
    stray = [n for n in (*mapped, *unset) if n not in names]
    shadowed = [n for n in unset if hasattr(args, n)]
    missing = [n for n in names if n not in mapped and n not in unset and not hasattr(args, n)]
    for problem, which in (("fields with no option, no mapping and no unset rule", missing),
                           ("mapped or unset names that are no fields", stray),
                           ("fields left unset that an option of their name would set", shadowed)):
        if which:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}: {problem}: {', '.join(which)}")
    return cls(**{n: mapped[n] if n in mapped else getattr(args, n) for n in names if n not in unset})
