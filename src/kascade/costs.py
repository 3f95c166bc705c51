"""What a plan costs: per-layer attention time relative to a dense layer, from committed kernel measurements.

    plan_speedup(plan, "decode", length=131072, batch=32, shape="llama-3.1-8b")   # 3.67 for 5 of 32 anchors
    costs = layer_costs("prefill", length=131072)                                # one measured configuration
    costs.anchor(0.05), costs.reuse(0.2)                                         # relative to one dense layer

A forward pass's attention time is the sum of its layers' times (the model average of the kernel benchmarks,
``python -m benchmarks.decode`` and ``benchmarks.prefill``); a layer's time, relative to a dense layer, depends on
its kind and on the fraction ``f`` of the keys it attends:

- layer 0: dense attention plus a selection, ``layer0`` (its output is dense: no ``f``);
- an anchor: scoring + top-k (``select``, measured at the base budget) plus sparse attention over ``f`` of the keys;
- a reuse layer: sparse attention over ``f`` of the keys.

Sparse attention is modelled as proportional to the keys it reads (``time(f) = time(ratio) * f / ratio``, with
``ratio`` the budget the kernels were timed at): the reuse kernels gather rows at a steady rate at B >= 8 and N >=
32K (2.9-4.1 TB/s in the decode benchmark). It is optimistic for budgets below the measured one where launch latency
dominates (B = 1, N <= 32K) and the selection's cost is taken at the measured budget whatever the depth of the
ranking. ``f`` is :meth:`kascade.Budget.decode_counts` over ``N`` for both modes (prefill rows keep the same
fraction of their causal keys: 0.09998 measured at 10%).

The numbers ship in the per-card results files, ``kascade/results/<card>.json`` (the measurements the README and the
manual quote), as each file's ``costs`` table (per shape, mode, batch and length, with the run they come from); today
the H200's. Only measured configurations are served. A table measured on another GPU by ``kascade costs``
(:mod:`kascade.costs_measure`, same format) is read with :func:`load_table` and passed as ``table=`` to every function
here; ``gpu`` then defaults to the table's only GPU.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .plan import KascadePlan, ModelFingerprint

MODES = ("decode", "prefill")
DEFAULT_GPU = "h200"
FORMAT = "kascade-costs/1"
ROW_FIELDS = ("dense", "dense_ours", "layer0", "select", "anchor", "reuse")  # times, in the mode's ``unit``
DEFAULT_SHAPE = "llama-3.1-8b"
DEFAULT_BATCH = {"decode": 32, "prefill": 1}
DEFAULT_LENGTH = 131072
BASELINES = ("best", "ours")  # dense: the fastest measured kernel, or our own (what `kascade bench` runs)
CARDS = ("h100", "h200")  # kascade/results/<card>.json; a card whose file has a ``costs`` table is served


@functools.cache
def _table() -> dict:
    table = {"format": FORMAT}
    for card in CARDS:
        results = json.loads((resources.files("kascade") / "results" / f"{card}.json").read_text())
        if "costs" in results:
            table[card] = results["costs"]
    return table


def load_table(path) -> dict:
    """A cost table file (``kascade-costs/1``, as ``kascade costs`` writes it), checked field by field: ValueError
    naming the file and the first bad field."""
    path = Path(path).expanduser()
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cost table {path}: not a readable JSON file ({e})") from None
    check_table(table, f"cost table {path}")
    return table


def check_table(table, where: str = "cost table") -> None:
    """ValueError naming the first field of ``table`` that is missing or malformed."""

    def need(cond, field, what):
        if not cond:
            raise ValueError(f"{where}: field {field!r} {what}")

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0

    need(isinstance(table, dict), "(top level)", "must be a JSON object")
    need(table.get("format") == FORMAT, "format", f"must be {FORMAT!r}, got {table.get('format')!r}")
    need(len(table) > 1, "(top level)", "has no GPU entry")
    for gpu, g in table.items():
        if gpu == "format":
            continue
        need(isinstance(g, dict), gpu, "must be an object (one GPU's measurements)")
        need(isinstance(g.get("gpu"), str), f"{gpu}.gpu", "must describe where it was measured (a string)")
        need(number(g.get("ratio")) and g["ratio"] <= 1, f"{gpu}.ratio", f"must be a fraction in (0, 1], got "
             f"{g.get('ratio')!r}")
        need(isinstance(g.get("shapes"), dict) and g["shapes"], f"{gpu}.shapes", "must name at least one shape")
        for name, sh in g["shapes"].items():
            for f in ("num_q_heads", "num_kv_heads", "head_dim"):
                x = sh.get(f) if isinstance(sh, dict) else None
                need(isinstance(x, int) and not isinstance(x, bool) and x > 0, f"{gpu}.shapes.{name}.{f}",
                     f"must be a positive integer, got {x!r}")
        need(any(m in g for m in MODES), f"{gpu}.{MODES[0]}", f"(or {MODES[1]}) is missing: nothing was measured")
        for mode in (m for m in MODES if m in g):
            m = g[mode]
            need(isinstance(m, dict), f"{gpu}.{mode}", "must be an object")
            need(isinstance(m.get("unit"), str), f"{gpu}.{mode}.unit", "must name the time unit (a string)")
            need(isinstance(m.get("rows"), list), f"{gpu}.{mode}.rows", "must be a list")
            for i, r in enumerate(m["rows"]):
                at = f"{gpu}.{mode}.rows[{i}]"
                need(isinstance(r, dict), at, "must be an object")
                need(r.get("shape") in g["shapes"], f"{at}.shape", f"must be one of {gpu}.shapes, got "
                     f"{r.get('shape')!r}")
                for f in ("batch", "length"):
                    x = r.get(f)
                    need(isinstance(x, int) and not isinstance(x, bool) and x > 0, f"{at}.{f}",
                         f"must be a positive integer, got {x!r}")
                for f in ROW_FIELDS:
                    need(number(r.get(f)), f"{at}.{f}", f"must be a positive time, got {r.get(f)!r}")


def _resolve(table):
    return _table() if table is None else table


def gpus(table: dict | None = None) -> tuple[str, ...]:
    return tuple(k for k in _resolve(table) if k != "format")


def _gpu_name(gpu, table) -> str:
    if gpu is not None:
        return gpu
    if table is None:
        return DEFAULT_GPU
    have = gpus(table)
    if len(have) != 1:
        raise ValueError(f"the cost table measures {len(have)} GPUs ({', '.join(have)}): name one")
    return have[0]


def _gpu(gpu: str | None, table: dict | None = None) -> dict:
    gpu = _gpu_name(gpu, table)
    if gpu not in gpus(table):
        raise ValueError(f"no cost measurements for GPU {gpu!r}; measured: {', '.join(gpus(table))}")
    return _resolve(table)[gpu]


def shapes(gpu: str | None = None, table: dict | None = None) -> dict[str, dict]:
    """``{name: {num_q_heads, num_kv_heads, head_dim}}`` of the shapes measured on ``gpu``."""
    return dict(_gpu(gpu, table)["shapes"])


def shape_for(fingerprint: ModelFingerprint, gpu: str | None = None, table: dict | None = None) -> str:
    """The measured shape with the model's heads and head dim, else :data:`DEFAULT_SHAPE` (a ``table`` without it:
    its first shape)."""
    own = dict(num_q_heads=fingerprint.num_q_heads, num_kv_heads=fingerprint.num_kv_heads,
               head_dim=fingerprint.head_dim)
    have = shapes(gpu, table)
    fallback = DEFAULT_SHAPE if DEFAULT_SHAPE in have or table is None else next(iter(have))
    return next((name for name, s in have.items() if s == own), fallback)


@dataclass(frozen=True)
class LayerCosts:
    """One measured configuration's layer times, relative to one dense layer (module docstring)."""

    mode: str
    gpu: str
    shape: str
    batch: int
    length: int
    ratio: float  # the budget fraction the sparse kernels were timed at
    dense: float  # one dense layer's time, in ``unit``
    unit: str
    layer0_x: float  # dense + selection
    select_x: float  # an anchor's scoring + top-k
    anchor_sparse_x: float  # an anchor's sparse attention at ``ratio``
    reuse_x: float  # a reuse layer at ``ratio``

    def layer0(self) -> float:
        return self.layer0_x

    def anchor(self, fraction: float) -> float:
        """An anchor attending ``fraction`` of the keys."""
        return self.select_x + self.anchor_sparse_x * fraction / self.ratio

    def reuse(self, fraction: float) -> float:
        """A reuse layer attending ``fraction`` of the keys."""
        return self.reuse_x * fraction / self.ratio

    def speedup_limit(self, num_layers: int, fraction: float) -> float:
        """The fastest plan of ``num_layers`` layers at ``fraction``: layer 0 its only anchor."""
        return num_layers / (self.layer0() + (num_layers - 1) * self.reuse(fraction))


def measured(mode: str = "decode", gpu: str | None = None, table: dict | None = None) -> list[tuple[str, int, int]]:
    """The ``(shape, batch, length)`` configurations measured for ``mode`` on ``gpu``."""
    _check_mode(mode)
    return [(r["shape"], r["batch"], r["length"]) for r in _gpu(gpu, table).get(mode, {}).get("rows", [])]


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def layer_costs(mode: str = "decode", *, length: int = DEFAULT_LENGTH, batch: int | None = None,
                gpu: str | None = None, shape: str = DEFAULT_SHAPE, baseline: str = "best",
                table: dict | None = None) -> LayerCosts:
    """The measured configuration (``batch`` default: 32 for decode, 1 for prefill); ValueError listing the
    measured ones for any other."""
    _check_mode(mode)
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
    gpu = _gpu_name(gpu, table)
    g = _gpu(gpu, table)
    if shape not in g["shapes"]:
        raise ValueError(f"no {gpu} cost measurements for shape {shape!r}; measured: {', '.join(g['shapes'])}")
    batch = DEFAULT_BATCH[mode] if batch is None else batch
    for r in g.get(mode, {}).get("rows", []):
        if (r["shape"], r["batch"], r["length"]) == (shape, batch, length):
            d = r["dense" if baseline == "best" else "dense_ours"]
            return LayerCosts(mode, gpu, shape, batch, length, g["ratio"], d, g[mode]["unit"], r["layer0"] / d,
                              r["select"] / d, (r["anchor"] - r["select"]) / d, r["reuse"] / d)
    have = sorted({(b, n) for s, b, n in measured(mode, gpu, table) if s == shape})
    raise ValueError(f"{mode} costs of {shape} on {gpu} are measured at (batch, length) "
                     + ", ".join(f"({b}, {n})" for b, n in have) + f"; not at ({batch}, {length})")


def layer_fractions(plan: KascadePlan, length: int, attended: dict | None = None) -> list[float]:
    """Per layer, the fraction of ``length`` keys it attends (per-layer scales included; 1 for layer 0).

    A plan by attention mass (``plan.mass``) keeps what its inputs need: give the ``attended`` fractions measured on
    yours, ``{layer: [keys attended, keys dense attends]}`` as :class:`kascade.Attention` counts them with
    ``account=True`` (``handle.runtime.attended``); for other plans they replace the budget's counts too."""
    if attended is not None:
        return [1.0 if layer == 0 else attended[layer][0] / attended[layer][1] for layer in range(plan.num_layers)]
    if plan.mass is not None or any(p.mass is not None for _, p in plan.by_length):
        raise ValueError("a plan by attention mass attends what its inputs need: pass the fractions measured on "
                         "them (attended=handle.runtime.attended of kascade.enable(model, plan, account=True))")
    plan = plan.for_length(length)
    b = plan.budget
    return [1.0 if layer == 0 else float(b.decode_counts(length, plan.layer_factor(layer))) / length
            for layer in range(plan.num_layers)]


def plan_cost(plan: KascadePlan, costs: LayerCosts, attended: dict | None = None) -> float:
    """The plan's attention time per forward, in dense layers (a dense model costs ``num_layers``); ``attended``:
    measured fractions (:func:`layer_fractions`)."""
    fr = layer_fractions(plan, costs.length, attended)
    sub = plan.for_length(costs.length)
    return sum(costs.layer0() if layer == 0 else costs.anchor(f) if sub.is_anchor(layer) else costs.reuse(f)
               for layer, f in enumerate(fr))


def plan_speedup(plan: KascadePlan, mode: str = "decode", *, length: int = DEFAULT_LENGTH,
                 batch: int | None = None, gpu: str | None = None, shape: str | None = None,
                 baseline: str = "best", table: dict | None = None, attended: dict | None = None) -> float:
    """Modelled model-average attention speedup of ``plan``: dense attention time of all layers / the plan's, on
    ``gpu`` (of ``table``, default: the shipped one) at ``shape``'s kernel times (default: the plan's own shape if
    measured, else Llama-3.1-8B's). ``attended``: the layers' measured fractions (:func:`layer_fractions`; needed
    for a plan by attention mass)."""
    shape = shape_for(plan.fingerprint, gpu, table) if shape is None else shape
    costs = layer_costs(mode, length=length, batch=batch, gpu=gpu, shape=shape, baseline=baseline, table=table)
    return plan.num_layers / plan_cost(plan, costs, attended)


def describe(plan: KascadePlan, **kw) -> str:
    """``decode 3.67x, prefill 1.87x`` at the defaults of :func:`plan_speedup` (``kw``: shape, gpu, length)."""
    return ", ".join(f"{m} {plan_speedup(plan, m, **kw):.2f}x" for m in MODES)
