"""Teacher-forced comparison of plans, as the plan-making scripts report it."""

from __future__ import annotations

from kascade.fidelity import compare_plans


def evaluate(model, plans: dict, windows, backend: str) -> dict:
    """Per plan: agreement / KL against dense pooled over the windows, and the attended fraction of keys."""
    return {n: f.as_dict() for n, f in compare_plans(model, plans, windows, backend=backend, account=True).items()}
