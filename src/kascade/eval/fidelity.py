"""Teacher-forced fidelity of Kascade plans against the dense model on token windows."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..integration.hf import enable
from .metrics import Fidelity, fidelity

SCORED_FRACTION = 0.5  # score the second half of each window: the long-context positions


def scored_logits(model, ids: torch.Tensor, scored_fraction: float = SCORED_FRACTION):
    """``(logits [P, V] fp32, targets [P])`` for the last ``scored_fraction`` of the positions of ``ids [1, n]``
    (position t's logits predict token t+1; the last position, whose target is outside the window, is dropped)."""
    keep = max(1, int(ids.shape[1] * scored_fraction)) + 1
    logits = model(ids, use_cache=False, logits_to_keep=keep).logits[0, :-1].float()
    return logits, ids[0, -keep + 1 :]


@torch.no_grad()
def compare_plans(model, plans: dict, windows: list[torch.Tensor], *, scored_fraction: float = SCORED_FRACTION,
                  progress: bool = True, backend: str = "reference") -> dict[str, Fidelity]:
    """Top-1 agreement and KL(dense || plan) over the last ``scored_fraction`` of every window's positions,
    pooled over windows. Windows are the outer loop, so only one window's logits are held at a time."""
    if not windows:
        raise ValueError("no evaluation windows given")
    dev = next(model.parameters()).device
    agree = {n: 0.0 for n in plans}
    kl = {n: 0.0 for n in plans}
    count = 0
    with tqdm(total=len(windows) * (1 + len(plans)), desc="fidelity", unit="forward", disable=not progress) as bar:
        for w in windows:
            ids = w[None].to(dev)
            d, _ = scored_logits(model, ids, scored_fraction)
            bar.update(1)
            for name, plan in plans.items():
                with enable(model, plan, backend=backend, warn_uncalibrated=False):
                    s, _ = scored_logits(model, ids, scored_fraction)
                f = fidelity(d, s)
                agree[name] += f.top1_agreement * f.positions
                kl[name] += f.kl * f.positions
                bar.update(1)
            count += d.shape[0]
    return {n: Fidelity(top1_agreement=agree[n] / count, kl=kl[n] / count, positions=count) for n in plans}
