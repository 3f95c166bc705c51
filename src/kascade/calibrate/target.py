"""Calibration for a target: the number of anchors from a speed target or an agreement target.

- ``--target-speedup X``: the most accurate plan whose modelled attention speedup (:mod:`kascade.costs`) is at least
  ``X``. The DP's objective never falls when an anchor is added, so the most accurate plan within the target is the
  one with the most anchors that still meets it; plans of one budget cost the same wherever their anchors sit, so
  the count is found from the cost model alone, before any statistics. A method with per-layer budgets may move
  the cost: its plan is checked and made with one anchor fewer until it meets the target.
- ``--target-agreement A``: the fastest plan (fewest anchors, from 2) whose DP plan's teacher-forced top-1 agreement
  with dense reaches ``A`` on held-out development windows.

Speedups are modelled on an H200 at 128K tokens (decode at batch 32, prefill at batch 1) with the kernel times of
the model's own shape when they were measured, else Llama-3.1-8B's (``cost_shape`` picks another). ``cost_table``
(a file ``kascade costs`` measured on the user's GPU) replaces the H200 times; where it lacks that batch and length,
its longest measured length is used. A target above what the fastest plan (layer 0 the only anchor) reaches is
refused before the model's weights are read.
"""

from __future__ import annotations

import functools
import os

from .. import costs
from ..budget import Budget
from ..fidelity import DenseReference, pool
from ..plan import KascadePlan, ModelFingerprint
from .dp import plan_from_stats

SPEEDUP_MODES = ("decode", "prefill", "both")
LENGTH = costs.DEFAULT_LENGTH


def modes(speedup_mode: str) -> tuple[str, ...]:
    return costs.MODES if speedup_mode == "both" else (speedup_mode,)


def _fraction(s, length: int = LENGTH) -> float:
    return float(Budget(ratio=s.ratio, k_min=s.k_min).decode_counts(length)) / length


@functools.lru_cache(maxsize=4)
def _load(path: str, stamp) -> dict:
    return costs.load_table(path)


def table(s) -> dict | None:
    """The cost table of ``s.cost_table``, loaded and checked (None: the shipped H200 measurements)."""
    if s.cost_table is None:
        return None
    path = os.path.abspath(os.path.expanduser(s.cost_table))
    try:
        st = os.stat(path)
        stamp = st.st_mtime_ns, st.st_size  # a rewritten file is read again
    except OSError:
        stamp = None  # load_table says why
    return _load(path, stamp)


def config(s, mode: str, shape: str) -> tuple[int, int]:
    """The ``(batch, length)`` whose kernel times model ``mode``: 128K tokens, decode at batch 32, prefill at batch
    1; from a ``cost_table`` without them, its longest measured length (then the batch nearest the default)."""
    want, t = (costs.DEFAULT_BATCH[mode], LENGTH), table(s)
    if t is None:
        return want
    have = [(b, n) for sh, b, n in costs.measured(mode, table=t) if sh == shape]
    if not have:
        raise ValueError(f"--cost-table {s.cost_table} has no {mode} times of shape {shape}; measure them with "
                         f"kascade costs --modes {mode}")
    return want if want in have else max(have, key=lambda bn: (bn[1], -abs(bn[0] - want[0])))


def _where(s) -> str:
    return "H200, 128K tokens" if table(s) is None else f"measured in {s.cost_table}"


def check_settings(s) -> None:
    """ValueError for a target setting of ``s`` (a :class:`~kascade.calibrate.pipeline.Settings`) that no model can
    meet or that is malformed; called before anything is loaded."""
    if s.speedup_mode not in SPEEDUP_MODES:
        raise ValueError(f"--speedup-mode must be one of {', '.join(SPEEDUP_MODES)}, got {s.speedup_mode!r}")
    have = costs.shapes(table=table(s))  # a --cost-table is read and checked here, before any model
    if s.cost_shape is not None and s.cost_shape not in have:
        raise ValueError(f"--cost-shape {s.cost_shape!r} was not measured; choose from {', '.join(have)}")
    if s.target_speedup is None:
        return
    x = s.target_speedup
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"--target-speedup must be a positive number, got {x!r}")
    if s.target_agreement is not None:
        raise ValueError("--target-speedup and --target-agreement are two ways to choose the plan: give one")
    shapes = [s.cost_shape] if s.cost_shape else list(have)
    for mode in modes(s.speedup_mode):
        # with ever more layers, the fastest plan tends to 1 / (reuse layer's cost): no model goes beyond it
        reach = []
        for sh in shapes:
            try:
                b, n = config(s, mode, sh)
            except ValueError:
                if s.cost_shape is not None or len(shapes) == 1:
                    raise
                continue  # another shape of the table may be the model's
            reach.append(1 / costs.layer_costs(mode, length=n, batch=b, shape=sh, table=table(s)).reuse(
                _fraction(s, n)))
        if not reach:
            raise ValueError(f"--cost-table {s.cost_table} has no {mode} times; measure them with kascade costs "
                             f"--modes {mode}")
        if x > max(reach):
            raise ValueError(f"--target-speedup {x:g} is out of reach: {mode} attention at --ratio {s.ratio:g} is at "
                             f"most {max(reach):.2f}x faster than dense even with every layer but the first reusing "
                             f"(modelled, {_where(s)}); lower the target or --ratio")


def cost_shape(s, fp: ModelFingerprint) -> str:
    return s.cost_shape or costs.shape_for(fp, table=table(s))


def speedups(plan: KascadePlan, s, of: tuple[str, ...] | None = None) -> dict[str, float]:
    """The plan's modelled speedup in each mode of ``of`` (default: of ``s.speedup_mode``)."""
    shape = cost_shape(s, plan.fingerprint)
    out = {}
    for m in modes(s.speedup_mode) if of is None else of:
        b, n = config(s, m, shape)
        out[m] = costs.plan_speedup(plan, m, length=n, batch=b, shape=shape, table=table(s))
    return out


def meets(plan: KascadePlan, s) -> bool:
    return all(x >= s.target_speedup for x in speedups(plan, s).values())


def check_model(s, fp: ModelFingerprint) -> None:
    """ValueError when even the fastest plan of the model (layer 0 the only anchor) misses ``s.target_speedup``."""
    if s.target_speedup is None:
        return
    fastest = KascadePlan.uniform(fp, 1, **s.budget)
    if not meets(fastest, s):
        got = ", ".join(f"{m} {x:.2f}x" for m, x in speedups(fastest, s).items())
        raise ValueError(f"--target-speedup {s.target_speedup:g} is out of reach for this model: its fastest plan "
                         f"(layer 0 the only anchor) is modelled at {got} ({describe_costs(s, fp)})")


def _measured_modes(s, shape: str) -> tuple[str, ...]:
    return tuple(m for m in costs.MODES if any(sh == shape for sh, _, _ in costs.measured(m, table=table(s))))


def describe_costs(s, fp: ModelFingerprint) -> str:
    shape = cost_shape(s, fp)
    if table(s) is None:
        return (f"H200 kernel times of {shape}, {LENGTH // 1024}K tokens, decode at batch "
                f"{costs.DEFAULT_BATCH['decode']}, prefill at batch {costs.DEFAULT_BATCH['prefill']}")
    at = ", ".join(f"{m} at batch {b} and {n} tokens" for m in _measured_modes(s, shape)
                   for b, n in [config(s, m, shape)])
    return f"kernel times of {shape} measured in {s.cost_table}, {at}"


def most_anchors_within(s, fp: ModelFingerprint) -> int:
    """The most anchors (1..layers) whose one-budget plan meets ``s.target_speedup`` (:func:`check_model` first)."""
    check_model(s, fp)
    best = 1
    for a in range(2, fp.num_layers + 1):
        if not meets(KascadePlan.uniform(fp, a, **s.budget), s):
            break
        best = a
    return best


def within_target(make, num_anchors: int, s, log=print) -> KascadePlan:
    """``make(num_anchors)``, with one anchor fewer until the plan meets ``s.target_speedup`` (per-layer budgets
    can make a plan dearer than one of a single budget)."""
    plan = make(num_anchors)
    while not meets(plan, s) and num_anchors > 1:
        log(f"  {num_anchors} anchors: modelled {speedups(plan, s)} misses {s.target_speedup:g}x; one fewer")
        num_anchors -= 1
        plan = make(num_anchors)
    return plan


def fastest_reaching(model, fp: ModelFingerprint, stats, holdout, s, max_a: int, measured: dict) -> int:
    """The anchor count (2..``max_a``) of the fastest DP plan (made shard-local with ``s.tensor_parallel``) whose
    agreement reaches ``s.target_agreement`` on the held-out windows; each measured plan's fidelity goes into
    ``measured``. Plans are tried from the fastest (modelled) down, so the first one to reach it is the answer."""
    ref = DenseReference(model, holdout)
    plans = {}
    for a in range(2, max_a + 1):
        plans[a] = plan_from_stats(fp, stats, a, **s.budget)
        if s.tensor_parallel is not None:
            plans[a] = plans[a].for_tensor_parallel(s.tensor_parallel, stats.similarity)
    order = sorted(plans, key=lambda a: (-min(speedups(plans[a], s).values()), a))
    for a in order:
        fid = measured[a] = pool(ref.compare(plans[a]))
        x = ", ".join(f"{m} {v:.2f}x" for m, v in speedups(plans[a], s).items())
        print(f"  A={a:2d} anchors {list(plans[a].anchors)} ({x}): held-out {fid}", flush=True)
        if fid.top1_agreement >= s.target_agreement:
            return a
    raise ValueError(f"no plan with up to {max_a} anchors reached agreement {s.target_agreement} on the "
                     f"held-out windows (best: {max(f.top1_agreement for f in measured.values()):.4f})")


def report_line(plan: KascadePlan, s) -> str:
    """One line for the report: the chosen plan's modelled speedups and, with a target, whether it is met."""
    of = costs.MODES if table(s) is None else _measured_modes(s, cost_shape(s, plan.fingerprint))
    x = ", ".join(f"{m} {v:.2f}x" for m, v in speedups(plan, s, of).items())
    line = f"modelled attention speedup: {x} ({describe_costs(s, plan.fingerprint)})"
    if s.target_speedup is not None:
        line += f"; target {s.target_speedup:g}x ({s.speedup_mode}) {'met' if meets(plan, s) else 'NOT met'}"
    return line
