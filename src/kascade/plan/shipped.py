"""The calibrated plans that ship inside the package, and the default plan of a model.

``kascade/plans/<model>.json`` is the default; ``kascade/plans/<variant>/<model>.json`` are the alternatives a user
can name (``enable(model, plan="faithful")``).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .kascade_plan import KascadePlan, ModelFingerprint

SHIPPED_VARIANTS = {
    "default": "the library's default: anchors chosen by measured fidelity with one moved where needles are lost (layer "
               "1 to 7), per-layer budgets from each layer's measured sensitivity (same average budget); against "
               "searched-budgets: more needles answered, closer to dense at 8K, even at 4K, below at 2K "
               "(docs/calibration.md)",
    "searched-budgets": "the default until 2026-12-07: the default's budgets with the anchors the search by measured "
                        "fidelity found (layer 1 where the default has 7); fewer needles answered",
    "searched": "anchors chosen by measured fidelity, one budget for every layer (the faithful reuse rule: the "
                "cheapest decode selection)",
    "faithful": "the paper's method: the similarity DP's anchors and argmax head map",
    "fast": "the paper's method at the most anchors whose modelled decode attention speedup is >= 4x (H200, "
            "Llama-3.1-8B kernel times, batch 32, 128K tokens; kascade.costs): see docs/results.md",
    "balanced": "the paper's method at the most anchors modelled >= 3.5x faster decode attention (as \"fast\")",
    "retrieval": "the default (its name while it was the candidate for the default, until 2026-12-07)",
}
# Names that are another variant's plan: "retrieval" became the default.
_ALIASES = {"retrieval": "default"}


def shipped_plans(variant: str = "default") -> list[KascadePlan]:
    """The calibrated plans that ship inside the package for ``variant`` (see :data:`SHIPPED_VARIANTS`)."""
    if variant not in SHIPPED_VARIANTS:
        raise ValueError(f"unknown shipped plan variant {variant!r}; choose from {', '.join(SHIPPED_VARIANTS)}")
    variant = _ALIASES.get(variant, variant)
    folder = resources.files("kascade") / "plans"
    if variant != "default":
        folder = folder / variant
    if not folder.is_dir():
        return []
    return [KascadePlan.from_json(f.read_text()) for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".json")]


def _fingerprint(model) -> ModelFingerprint:
    return model if isinstance(model, ModelFingerprint) else ModelFingerprint.from_model(model)


def shipped_plan(model, variant: str = "default") -> KascadePlan:
    """The shipped ``variant`` plan for ``model``'s shape (a model or its :class:`ModelFingerprint`); ValueError
    (listing what exists) if there is none."""
    fp = _fingerprint(model)
    for plan in shipped_plans(variant):
        if plan.fingerprint == fp:
            return plan
    have = [v for v in SHIPPED_VARIANTS if any(p.fingerprint == fp for p in shipped_plans(v))]
    raise ValueError(f"no shipped {variant!r} plan for this model ({fp}); shipped for it: {have or 'none'} "
                     "(make one with `kascade calibrate`)")


def default_plan(model, num_anchors: int = 6) -> KascadePlan:
    """The shipped calibrated plan whose fingerprint matches ``model`` (a model or its :class:`ModelFingerprint`),
    else the uncalibrated uniform plan."""
    fp = _fingerprint(model)
    for plan in shipped_plans():
        if plan.fingerprint == fp:
            return plan
    return KascadePlan.uniform(fp, num_anchors=min(num_anchors, fp.num_layers))


def resolve_plan(plan, model) -> KascadePlan:
    """What ``enable`` and the commands' ``--plan`` take, as a plan for ``model`` (a model or its fingerprint):
    None (the model's default plan), a :class:`KascadePlan`, the name of a shipped variant (:data:`SHIPPED_VARIANTS`)
    or the path of a plan JSON file (as ``kascade calibrate`` writes; a name wins over a file of the same name in
    the working folder). ValueError saying which of these ``plan`` is not; the plan is not checked against the model
    here."""
    if plan is None:
        return default_plan(model)
    if isinstance(plan, KascadePlan):
        return plan
    if isinstance(plan, str) and plan in SHIPPED_VARIANTS:
        return shipped_plan(model, plan)
    if isinstance(plan, (str, os.PathLike)):
        path = Path(plan).expanduser()
        if path.exists() or path.suffix == ".json" or len(path.parts) > 1:
            return KascadePlan.load(path)
        raise ValueError(f"plan {str(plan)!r} is neither a shipped plan ({', '.join(SHIPPED_VARIANTS)}) nor a plan "
                         "file (no file there)")
    raise TypeError(f"plan must be a KascadePlan, the name of a shipped plan or a plan file's path, got "
                    f"{type(plan).__name__}")
