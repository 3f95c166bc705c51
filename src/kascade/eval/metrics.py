"""Fidelity of a sparse forward pass against the dense one, from their logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fidelity:
    """Teacher-forced agreement of two next-token distributions over the same positions."""

    top1_agreement: float  # fraction of positions whose argmax token is the same
    kl: float  # mean KL(dense || sparse), nats per position
    positions: int
    nll: float | None = None  # mean negative log-likelihood of the true next tokens under the sparse logits

    def __str__(self) -> str:
        return f"top-1 agreement {self.top1_agreement:.4f}, KL {self.kl:.4f} nats ({self.positions} positions)"


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
