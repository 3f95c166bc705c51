"""The plans the speed benchmarks time at random weights: ``kascade bench``'s uniform plan, with its reuse layers'
head maps as they are (identity) or rotated, the shape of a calibrated plan's maps, and its budgets the same in every
layer or per layer (ranked anchors), the shape of the default model's shipped plan."""

from __future__ import annotations

HEAD_MAPS = ("identity", "rotated")
BUDGETS = ("uniform", "per-layer")
# per-layer budgets: layer i keeps PER_LAYER[i % 4] times the budget (the factors of the default model's plan)
PER_LAYER = (1.0, 0.5, 1.5, 2.0)


def add_plan_options(parser, head_maps: str = "identity") -> None:
    """The options that shape :func:`uniform_plan`'s plan in a benchmark: ``--head-maps`` (default ``head_maps``)
    and ``--budgets``."""
    parser.add_argument("--head-maps", choices=HEAD_MAPS, default=head_maps,
                        help=f"the reuse layers' head maps: identity (the uniform plan's) or rotated (KV head h follows "
                        f"its anchor's head h + 1: a calibrated plan's reuse layers follow other heads, all 24 of the "
                        f"default model's) (default {head_maps})")
    parser.add_argument("--budgets", choices=BUDGETS, default="uniform",
                        help="uniform: every layer the same budget (the paper's rule); per-layer: 0.5 to 2 times it per "
                        "layer, the default model's plan's kind: its anchors rank their keys and each reuse layer "
                        "attends a prefix of the ranking (default uniform)")


def uniform_plan(fingerprint, anchors: int, head_maps: str = "identity", budgets: str = "uniform"):
    """``anchors`` evenly spaced anchors (:meth:`kascade.KascadePlan.uniform`). ``head_maps="rotated"``: each reuse
    layer's KV head ``h`` follows its anchor's head ``h + 1`` (mod H), as the reuse layers of a calibrated plan
    follow other heads than their own (all 24 of the default model's): the sparse pass then reads the anchor's
    selection through a head map, which the identity map skips. ``budgets="per-layer"``: layer ``i`` keeps
    ``PER_LAYER[i % 4]`` times the budget, as the default model's plan keeps 0.5 to 2 times it per layer: its
    anchors then rank their keys (a ranked selection) and each reuse layer attends a prefix of the ranking."""
    import dataclasses

    from kascade.plan import KascadePlan, Reuse

    if head_maps not in HEAD_MAPS:
        raise ValueError(f"head_maps must be one of {HEAD_MAPS}, got {head_maps!r}")
    if budgets not in BUDGETS:
        raise ValueError(f"budgets must be one of {BUDGETS}, got {budgets!r}")
    plan = KascadePlan.uniform(fingerprint, anchors)
    H, n = fingerprint.num_kv_heads, fingerprint.num_layers
    if head_maps == "rotated":
        own, rotated = tuple(range(H)), tuple((h + 1) % H for h in range(H))
        plan = KascadePlan(fingerprint, plan.anchors, tuple(own if plan.is_anchor(i) else rotated for i in range(n)),
                           calibrated=False, source=f"uniform: {anchors} evenly spaced anchors, rotated head maps")
    if budgets == "per-layer":
        plan = dataclasses.replace(plan, reuse=Reuse(factor=tuple(PER_LAYER[i % 4] for i in range(n))),
                                   source=plan.source + ", per-layer budgets")
    return plan
