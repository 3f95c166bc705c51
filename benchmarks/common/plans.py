"""The plans the speed benchmarks time at random weights: ``kascade bench``'s uniform plan, with its reuse layers'
head maps as they are (identity) or rotated, the shape of a calibrated plan's maps."""

from __future__ import annotations

HEAD_MAPS = ("identity", "rotated")


def uniform_plan(fingerprint, anchors: int, head_maps: str = "identity"):
    """``anchors`` evenly spaced anchors (:meth:`kascade.KascadePlan.uniform`). ``head_maps="rotated"``: each reuse
    layer's KV head ``h`` follows its anchor's head ``h + 1`` (mod H), as the reuse layers of a calibrated plan
    follow other heads than their own (all 24 of the default model's): the sparse pass then reads the anchor's
    selection through a head map, which the identity map skips."""
    from kascade.plan import KascadePlan

    plan = KascadePlan.uniform(fingerprint, anchors)
    if head_maps == "identity":
        return plan
    if head_maps != "rotated":
        raise ValueError(f"head_maps must be one of {HEAD_MAPS}, got {head_maps!r}")
    H, n = fingerprint.num_kv_heads, fingerprint.num_layers
    own, rotated = tuple(range(H)), tuple((h + 1) % H for h in range(H))
    return KascadePlan(fingerprint, plan.anchors, tuple(own if plan.is_anchor(i) else rotated for i in range(n)),
                       calibrated=False, source=f"uniform: {anchors} evenly spaced anchors, rotated head maps")
