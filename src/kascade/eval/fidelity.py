"""Teacher-forced fidelity of Kascade plans against the dense model on token windows."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..integration.hf import enable
from .metrics import Fidelity

SCORED_FRACTION = 0.5  # score the second half of each window: the long-context positions


@torch.no_grad()
def compare_plans(model, plans: dict, windows: list[torch.Tensor], *, scored_fraction: float = SCORED_FRACTION,
                  progress: bool = True, backend: str = "reference") -> dict[str, Fidelity]:
    """Top-1 agreement and KL(dense || plan) over the last ``scored_fraction`` of every window's positions.

    Windows are the outer loop, so only one window's dense and sparse logits are held at a time.
    """
    if not windows:
        raise ValueError("no evaluation windows given")
    dev = next(model.parameters()).device
    agree = {n: 0.0 for n in plans}
    kl = {n: 0.0 for n in plans}
    count = 0
    steps = len(windows) * (1 + len(plans))
    with tqdm(total=steps, desc="fidelity", unit="forward", disable=not progress) as bar:
        for w in windows:
            ids = w[None].to(dev)
            keep = max(1, int(len(w) * scored_fraction)) + 1
            # logits at position t predict t+1: drop the last one, whose target is outside the window
            d = model(ids, use_cache=False, logits_to_keep=keep).logits[0, :-1].float()
            ld = d.log_softmax(-1)
            pd_ = ld.exp()
            top = d.argmax(-1)
            bar.update(1)
            for name, plan in plans.items():
                with enable(model, plan, backend=backend):
                    s = model(ids, use_cache=False, logits_to_keep=keep).logits[0, :-1].float()
                ls = s.log_softmax(-1)
                agree[name] += (s.argmax(-1) == top).sum().item()
                kl[name] += (pd_ * (ld - ls)).sum(-1).clamp_min(0).sum().item()
                bar.update(1)
            count += d.shape[0]
    return {n: Fidelity(top1_agreement=agree[n] / count, kl=kl[n] / count, positions=count) for n in plans}
