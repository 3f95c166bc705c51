"""Teacher-forced fidelity of sparse attention against the dense model, from the logits of the same tokens.

    ref = DenseReference(model, windows)           # one dense forward per window; its logits are kept
    pool(ref.compare(plan))                        # a plan against them, pooled over windows: a Fidelity
    ref(plan)                                      # {"agreement", "kl"}: the scorer of the measured searches
    compare_plans(model, {"a": plan_a, "b": plan_b}, windows)   # several plans, one window's logits at a time

Position ``t``'s logits predict token ``t + 1``. A window scores its last positions: the last ``scored_fraction``
(half by default: the long-context part) or the last ``positions``. Per window, :class:`Fidelity` holds the
top-1 agreement with dense, ``KL(dense || sparse)`` in nats per position and the negative log-likelihood of the
true next tokens under the sparse logits; :func:`pool` weights windows by their scored positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .integration.hf import enable

SCORED_FRACTION = 0.5


@dataclass(frozen=True)
class Fidelity:
    """Teacher-forced agreement of two next-token distributions over the same positions."""

    top1_agreement: float  # fraction of positions whose argmax token is the same
    kl: float  # mean KL(dense || sparse), nats per position
    positions: int
    nll: float | None = None  # mean negative log-likelihood of the true next tokens under the sparse logits
    attended: float | None = None  # keys attended / keys dense attention attends (counted from the selections)

    def __str__(self) -> str:
        return f"top-1 agreement {self.top1_agreement:.4f}, KL {self.kl:.4f} nats ({self.positions} positions)"

    def as_dict(self) -> dict:
        """JSON-ready: ``agreement``, ``kl``, ``nll``, ``positions``, ``attended_fraction``."""
        return dict(agreement=self.top1_agreement, kl=self.kl, nll=self.nll, positions=self.positions,
                    attended_fraction=self.attended)


def fidelity(dense_logits: torch.Tensor, sparse_logits: torch.Tensor, mask: torch.Tensor | None = None,
             targets: torch.Tensor | None = None) -> Fidelity:
    """Compare ``[..., V]`` logits position by position; ``mask`` (same leading shape) picks the positions;
    ``targets`` (same leading shape, token ids) adds the NLL of the true next tokens under the sparse logits."""
    if dense_logits.shape != sparse_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(dense_logits.shape)} vs {tuple(sparse_logits.shape)}")
    d = dense_logits.float().reshape(-1, dense_logits.shape[-1])
    s = sparse_logits.float().reshape(-1, sparse_logits.shape[-1])
    t = None if targets is None else targets.reshape(-1)
    if mask is not None:
        keep = mask.reshape(-1).to(torch.bool)
        d, s = d[keep], s[keep]
        t = None if t is None else t[keep]
    if d.shape[0] == 0:
        raise ValueError("no positions to compare")
    agree = (d.argmax(-1) == s.argmax(-1)).float().mean().item()
    ld, ls = d.log_softmax(-1), s.log_softmax(-1)
    kl = (ld.exp() * (ld - ls)).sum(-1).clamp_min(0).mean().item()
    nll = None if t is None else -ls.gather(-1, t.to(ls.device)[:, None]).mean().item()
    return Fidelity(top1_agreement=agree, kl=kl, positions=d.shape[0], nll=nll)


def pool(fids: Sequence[Fidelity]) -> Fidelity:
    """The windows' fidelities as one: means weighted by scored positions (NLL only where every window has it)."""
    if not fids:
        raise ValueError("no fidelities to pool")
    agree = kl = nll = 0.0
    count = 0
    for f in fids:
        agree += f.top1_agreement * f.positions
        kl += f.kl * f.positions
        nll += 0.0 if f.nll is None else f.nll * f.positions
        count += f.positions
    has_nll = all(f.nll is not None for f in fids)
    att = None
    if all(f.attended is not None for f in fids):
        att = sum(f.attended * f.positions for f in fids) / count
    return Fidelity(top1_agreement=agree / count, kl=kl / count, positions=count, nll=nll / count if has_nll else None,
                    attended=att)


def scored_logits(model, ids: torch.Tensor, scored_fraction: float = SCORED_FRACTION, *,
                  positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [P, V] fp32, targets [P])`` for the scored positions of ``ids [1, n]``: the last
    ``scored_fraction`` of them, or the last ``positions`` (at most ``n - 1``). The last position, whose target is
    outside the window, is left out."""
    n = ids.shape[1]
    keep = (max(1, int(n * scored_fraction)) if positions is None else min(positions, n - 1)) + 1
    logits = model(ids, use_cache=False, logits_to_keep=keep).logits[0, :-1].float()
    return logits, ids[0, -keep + 1 :]


class DenseReference:
    """The dense model's scored logits on fixed windows (1-D token tensors), computed once, and the teacher-forced
    comparison of any attention routing against them.

    ``measure()`` scores the model as it runs now (whatever is enabled on it); ``compare(plan)`` runs it under
    ``kascade.enable(model, plan)``; both give one :class:`Fidelity` per window (:func:`pool` joins them).
    Calling it, ``ref(plan)``, gives the pooled ``{"agreement", "kl"}``: the scorer that
    :func:`kascade.calibrate.search.search_anchors` and :func:`kascade.calibrate.budgets.layer_sensitivity` take.
    """

    def __init__(self, model, windows: Sequence[torch.Tensor], *, scored_fraction: float = SCORED_FRACTION,
                 positions: int | None = None, backend: str = "reference"):
        if not windows:
            raise ValueError("a dense reference needs at least one window")
        self.model, self.backend = model, backend
        self.scored_fraction, self.positions = scored_fraction, positions
        dev = next(model.parameters()).device
        self.ids = [w[None].to(dev) for w in windows]
        with torch.no_grad():
            self.dense = [self._scored(ids) for ids in self.ids]  # [(logits [P, V], targets [P])] per window

    def _scored(self, ids):
        return scored_logits(self.model, ids, self.scored_fraction, positions=self.positions)

    @torch.no_grad()
    def measure(self) -> list[Fidelity]:
        """Per window: the model as it runs now against the dense logits."""
        return [fidelity(d, self._scored(ids)[0], targets=t) for ids, (d, t) in zip(self.ids, self.dense)]

    def compare(self, plan, *, selector=None, account: bool = False) -> list[Fidelity]:
        """Per window: the model under ``kascade.enable(model, plan, selector=...)`` against dense; with ``account``
        each :class:`Fidelity` also holds the fraction of keys the window attended."""
        if not account:
            with enable(self.model, plan, backend=self.backend, selector=selector, warn_uncalibrated=False):
                return self.measure()
        out = []
        for ids, (d, t) in zip(self.ids, self.dense):
            with torch.no_grad(), enable(self.model, plan, backend=self.backend, selector=selector, account=True,
                                         warn_uncalibrated=False) as h:
                f = fidelity(d, self._scored(ids)[0], targets=t)
            att = sum(a for a, _ in h.runtime.attended.values())
            den = sum(n for _, n in h.runtime.attended.values())
            out.append(dataclasses.replace(f, attended=att / den if den else 1.0))
        return out

    def baseline(self) -> list[Fidelity]:
        """Per window: dense against itself (agreement 1, KL 0, dense's NLL), without another forward."""
        return [fidelity(d, d, targets=t) for d, t in self.dense]

    def __call__(self, plan) -> dict:
        f = pool(self.compare(plan))
        return dict(agreement=f.top1_agreement, kl=f.kl)


def compare_plans(model, plans: dict, windows: Sequence[torch.Tensor], *, scored_fraction: float = SCORED_FRACTION,
                  progress: bool = True, backend: str = "reference", account: bool = False) -> dict[str, Fidelity]:
    """Every plan against dense on every window, pooled over windows (``account``: with the attended fraction of
    keys). Windows are the outer loop, so only one window's logits are held at a time."""
    if not windows:
        raise ValueError("no evaluation windows given")
    per_window = {name: [] for name in plans}
    with tqdm(total=len(windows) * (1 + len(plans)), desc="fidelity", unit="forward", disable=not progress) as bar:
        for w in windows:
            ref = DenseReference(model, [w], scored_fraction=scored_fraction, backend=backend)
            bar.update(1)
            for name, plan in plans.items():
                per_window[name] += ref.compare(plan, account=account)
                bar.update(1)
    return {name: pool(fids) for name, fids in per_window.items()}
