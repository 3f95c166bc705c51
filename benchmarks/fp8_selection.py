"""Low-precision scoring (``Budget.score_dtype`` "fp8" / "int8") against exact scoring of the anchors' selection,
on CPU.

Part one, the selection itself, per shape, per scoring and per layer (min / mean over layers): ``kept``, the share of
the exact selection's keys the low-precision selection keeps, ``|S_low & S_exact| / |S_exact|``, and ``mass``, the
share of the exact selection's pooled probability the low-precision selection captures, ``P(S_low) / P(S_exact)``
with ``P`` the exact pooled probabilities; both averaged over rows (KV head and query tile, or decode query; rows
that select no key are left out). Every layer selects here, at the budget of the rows' own counts (no per-layer
budget factor). ``--score-dtypes`` picks the scorings: ``fp8`` (:mod:`kascade.ops.fp8`), ``int8``
(:mod:`kascade.ops.int8`) and ``bf16``, a reference point that is no option: the exact scores of the vectors rounded
to bf16, what a bf16 model's own rounding of its fp32 queries and keys changes.

- ``model``: the default model's (SmolLM2-135M) real queries and keys (fp32), every layer, on eval-split windows of
  pydoc text (``--length``): prefill rows are every tile of a window, the decode row its last query over the
  window's keys. The budget is the model's default plan's.
- ``llama8b``: Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head dim 128) with random bf16
  inputs (``--draws`` draws per shape, reported as layers), decode at ``--decode-lengths``, prefill at
  ``--prefill-lengths``; the default budget (``kascade.Budget()``).

Part two (``--fidelity-lengths``), teacher-forced against dense on eval-split windows: agreement and KL of the
default plan with exact scoring and with each option of ``--score-dtypes`` (the reference backend), on the same
windows.

    python -m benchmarks.fp8_selection --windows 2 --length 4096 --fidelity-lengths 4096,8192
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from benchmarks.common import log, out_folder
from kascade import text
from kascade.budget import Budget
from kascade.fidelity import DenseReference, pool
from kascade.integration.hf import attach
from kascade.models import load_model
from kascade.ops import fp8, int8
from kascade.ops.reference import iter_pooled_prefill, pooled_decode
from kascade.plan import shipped_plan

LLAMA8B = dict(q_heads=32, kv_heads=8, head_dim=128)


# -- the two measures ------------------------------------------------------------------------------------------------
def _top_mask(cand: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``cand [H, R, m]`` (-inf: not a candidate), ``counts [R]`` -> bool ``[H, R, m]``: each row's ``counts[r]``
    largest candidates."""
    K = int(counts.max()) if counts.numel() else 0
    mask = torch.zeros(cand.shape, dtype=torch.bool)
    if K:
        top = cand.topk(K, dim=-1).indices
        keep = (torch.arange(K)[None, :] < counts[:, None]).expand(cand.shape[0], -1, -1)
        mask.scatter_(-1, top, keep)
    return mask


def compare_rows(exact: torch.Tensor, low: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' pooled probabilities under exact and FP8 scoring (``[H, R, m]``, -inf where a row may not choose a key)
    and their counts ``[R]`` -> per row with a count (flattened over heads): (kept, mass) as defined above."""
    m_exact, m_low = _top_mask(exact, counts), _top_mask(low, counts)
    p = exact.clamp_min(0).double()  # -inf -> 0: candidates only
    kept = (m_exact & m_low).sum(-1).double() / m_exact.sum(-1).clamp_min(1)
    mass = (p * m_low).sum(-1) / (p * m_exact).sum(-1)
    rows = (counts > 0).expand_as(kept)
    return kept[rows], mass[rows]


ROUNDINGS = {"fp8": fp8.rounded, "int8": int8.rounded,
             "bf16": lambda x: x.to(torch.bfloat16).to(torch.float64 if x.dtype == torch.float64 else torch.float32)}


def measure_sequence(q: torch.Tensor, k: torch.Tensor, budget: Budget, scale: float, prefill: bool = True,
                     scorings=("fp8",)) -> dict:
    """One sequence, ``q [HQ, L, D]`` (the last ``L`` positions), ``k [H, n, D]``: ``{(kind, scoring): (kept,
    mass)}`` row tensors for kind "decode" (the last query over every key) and "prefill", and each of ``scorings``
    (names of :data:`ROUNDINGS`)."""
    md = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(md), k.to(md)
    low = {s: (ROUNDINGS[s](q), ROUNDINGS[s](k)) for s in scorings}
    n = k.shape[1]
    out = {}
    count = torch.tensor([budget.decode(n)])
    exact = pooled_decode(q[:, -1:], k, scale)[:, None]
    for s, (rq, rk) in low.items():
        out["decode", s] = compare_rows(exact, pooled_decode(rq[:, -1:], rk, scale)[:, None], count)
    if not prefill:
        return out
    T, parts = budget.tile, {s: [] for s in scorings}
    iters = {s: iter_pooled_prefill(rq, rk, scale, T) for s, (rq, rk) in low.items()}
    for t0, pe in iter_pooled_prefill(q, k, scale, T):
        c, m = pe.shape[1], pe.shape[2]
        st = torch.arange(t0, t0 + c) * T  # each tile's first position: its candidates are the keys before it
        late = torch.arange(m)[None, :] >= st[:, None]
        counts = budget.prefill_tile(st, n)
        for s, it in iters.items():
            _, pl = next(it)
            parts[s].append(compare_rows(pe.masked_fill(late, float("-inf")), pl.masked_fill(late, float("-inf")),
                                         counts))
    for s in scorings:
        out["prefill", s] = tuple(torch.cat(x) for x in zip(*parts[s]))
    return out


class _Recorder:
    """An attention runtime (dense outputs) that measures every layer's selection on the side."""

    def __init__(self, budget: Budget, scorings):
        self.budget, self.scorings, self.rows = budget, scorings, {}  # (kind, scoring, layer) -> [(kept, mass)]

    def begin(self, fwd, q, k):
        if q.shape[0] != 1 or q.shape[2] != k.shape[2]:
            raise ValueError("one unpadded window at a time, without a KV cache")

    def attend(self, layer, q, k, v, fwd, scale):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        for (kind, s), rows in measure_sequence(q[0], k[0], self.budget, scale, scorings=self.scorings).items():
            self.rows.setdefault((kind, s, layer), []).append(rows)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def summary(per_layer: dict) -> dict:
    """``{layer: [(kept, mass) row tensors, ...]}`` -> min / mean over layers of each layer's row means."""
    kept = torch.stack([torch.cat([r[0] for r in rows]).mean() for rows in per_layer.values()])
    mass = torch.stack([torch.cat([r[1] for r in rows]).mean() for rows in per_layer.values()])
    return dict(layers=len(per_layer), kept_min=float(kept.min()), kept_mean=float(kept.mean()),
                mass_min=float(mass.min()), mass_mean=float(mass.mean()))


# -- the inputs ------------------------------------------------------------------------------------------------------
def model_rows(model, tok, budget: Budget, length: int, windows: int, seed: int, scorings=("fp8",)) -> list[dict]:
    rec = _Recorder(budget, scorings)
    wins = text.windows(tok, "eval", length, windows, seed=seed)
    dev = next(model.parameters()).device
    with torch.no_grad(), attach(model, rec):
        for i, w in enumerate(wins):
            model(w[None].to(dev))
            log(f"model: window {i + 1}/{len(wins)} measured")
    out = []
    for s in scorings:
        for kind in ("decode", "prefill"):
            layers = {l: rows for (kd, sd, l), rows in rec.rows.items() if (kd, sd) == (kind, s)}
            out.append(dict(inputs="model", scoring=s, kind=kind, length=length, windows=windows, **summary(layers)))
    return out


def llama8b_rows(budget: Budget, kind: str, n: int, draws: int, seed: int, scorings=("fp8",)) -> list[dict]:
    HQ, H, D = LLAMA8B["q_heads"], LLAMA8B["kv_heads"], LLAMA8B["head_dim"]
    L = 1 if kind == "decode" else n
    g = torch.Generator().manual_seed(seed)
    layers = {s: {} for s in scorings}
    for d in range(draws):
        q = torch.randn(HQ, L, D, generator=g).to(torch.bfloat16)
        k = torch.randn(H, n, D, generator=g).to(torch.bfloat16)
        rows = measure_sequence(q, k, budget, D ** -0.5, prefill=kind == "prefill", scorings=scorings)
        for s in scorings:
            layers[s][d] = [rows[kind, s]]
    return [dict(inputs="llama8b-random-bf16", scoring=s, kind=kind, length=n, windows=draws, **summary(layers[s]))
            for s in scorings]


def fidelity_rows(model, tok, lengths, windows: int, seed: int, scorings=("fp8",)) -> list[dict]:
    exact = shipped_plan(model, "default")
    plans = {"exact": exact, **{s: exact.with_budget(score_dtype=s) for s in scorings if s != "bf16"}}
    out = []
    for n in lengths:
        ref = DenseReference(model, text.windows(tok, "eval", n, windows, seed=seed))
        for name, plan in plans.items():
            t0 = time.perf_counter()
            f = pool(ref.compare(plan))
            out.append(dict(scoring=name, length=n, windows=windows, agreement=f.top1_agreement, kl=f.kl,
                            seconds=round(time.perf_counter() - t0, 1)))
            log(f"fidelity {n}: {name} agreement {f.top1_agreement:.4f} KL {f.kl:.4f}")
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="the model's windows, in tokens (default 4096)")
    p.add_argument("--windows", type=int, default=2, help="eval-split windows of the model's selection rows "
                   "(default 2; 0: none, e.g. for the fidelity rows alone)")
    p.add_argument("--decode-lengths", type=_ints, default=[32768, 131072])
    p.add_argument("--prefill-lengths", type=_ints, default=[4096])
    p.add_argument("--draws", type=int, default=4, help="random draws per Llama-3.1-8B decode shape (default 4)")
    p.add_argument("--prefill-draws", type=int, default=1, help="random draws per prefill shape (default 1)")
    p.add_argument("--fidelity-lengths", type=_ints, default=[], help="e.g. 4096,8192 (default: none)")
    p.add_argument("--fidelity-windows", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score-dtypes", default="fp8,int8,bf16",
                   help="the scorings compared with exact scoring, of fp8, int8 and bf16 (bf16: the vectors rounded "
                   "to bf16, a reference point; no fidelity run) (default: all three)")
    p.add_argument("--out", default=None, help="output folder (default out/fp8_selection)")
    a = p.parse_args(argv)
    scorings = tuple(x for x in a.score_dtypes.split(",") if x)
    if not scorings or set(scorings) - set(ROUNDINGS):
        p.error(f"--score-dtypes takes a comma-separated list of {', '.join(ROUNDINGS)}, got {a.score_dtypes!r}")
    out = out_folder(a.out, "fp8_selection")
    torch.set_grad_enabled(False)
    header = dict(machine=f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (CPU)",
                  torch=torch.__version__, python=platform.python_version())
    print(f"# {', '.join(scorings)} scoring vs exact scoring of the anchors' selection  ({header['machine']}, "
          f"torch {header['torch']})")
    model, tok = load_model(None, device="cpu", dtype=torch.float32)
    plan = shipped_plan(model, "default")
    rows = model_rows(model, tok, plan.budget, a.length, a.windows, a.seed, scorings) if a.windows else []
    for n in a.decode_lengths:
        rows += llama8b_rows(Budget(), "decode", n, a.draws, a.seed, scorings)
        log(f"llama8b decode {n} measured")
    for n in a.prefill_lengths:
        rows += llama8b_rows(Budget(), "prefill", n, a.prefill_draws, a.seed, scorings)
        log(f"llama8b prefill {n} measured")
    print("\n| scoring | inputs | kind | length | layers | kept keys min / mean | captured mass min / mean |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scoring']} | {r['inputs']} | {r['kind']} | {r['length']} | {r['layers']} | {r['kept_min']:.4f} / "
              f"{r['kept_mean']:.4f} | {r['mass_min']:.4f} / {r['mass_mean']:.4f} |")
    fid = (fidelity_rows(model, tok, a.fidelity_lengths, a.fidelity_windows, a.seed, scorings)
           if a.fidelity_lengths else [])
    if fid:
        print("\n| scoring | length | windows | agreement | KL |\n|---|---|---|---|---|")
        for r in fid:
            print(f"| {r['scoring']} | {r['length']} | {r['windows']} | {r['agreement']:.4f} | {r['kl']:.4f} |")
    result = dict(header, budget_model=dict(ratio=plan.ratio, k_min=plan.k_min, tile=plan.tile),
                  budget_llama8b=dict(ratio=Budget().ratio, k_min=Budget().k_min, tile=Budget().tile),
                  selection=rows, fidelity=fid)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
